"""The device prefix cache (APC): bookkeeping of a paged pool of fixed-size KV blocks.

Modelled on vLLM's v1 block pool (DESIGN 7). A request's KV lives in blocks of
``block_size`` tokens; a full block whose KV is computed is *cached* under the hash
of the whole prefix it ends, and a later request whose prefix hashes the same reuses
the block without copying: the block's ``ref_cnt`` counts its users. Blocks nobody
uses sit in the :class:`~lmtier_connector.device.free_queue.FreeBlockQueue`, still cached, until
allocation reaches them and evicts their hash. Block 0 is a null placeholder for
padding block tables and is never handed out. This module holds no tensors: the
device memory and the copies between blocks and chunks live elsewhere (DESIGN 8).

Which hash keys a block
-----------------------
Decision: two chains from the same code (:class:`lmtier.chunks.keys.Xxh3ChunkHasher`).

- *Storage chunk keys*: the 256-token chain of :mod:`lmtier.chunks.keys`. They name KV
  outside this process (CPU, disk, Redis, S3), so a CPU warm-up job, a sidecar and a
  GPU engine must compute them identically whatever their block size.
- *Device block hashes*: a 16-token chain under the same namespace with
  ``chunk_size=block_size`` (:func:`block_hasher`). The namespace digest includes
  the chunk size, so a block hash never equals a chunk key; both are 32 bytes and
  carry the tenant's ``cache_salt``. The hash map lives and dies with the process,
  like vLLM's APC. The connector relates the two through the block table (chunk
  ``j`` is blocks ``16j .. 16j+15`` of the request at 256/16), never through hashes.
- In the vLLM-compatible mode the block hashes are vLLM's own (sha256 over CBOR)
  and each chunk key is bound to the block hash at the chunk's end boundary
  (:mod:`lmtier.chunks.vllm_hash`).

Measured on a 32k-token prompt (``benchmarks/bench_block_pool.py``, medians of runs
on a noisy shared 2-core machine): the 256-token chain costs 1.5-1.6 ns/token, the
16-token chain 14.4-15.2 (~235 ns per block: Python's per-call overhead, not xxh3),
vLLM's sha256-CBOR block hashes ~135, copying the demo model's KV (8 KiB/token, into
preallocated memory) 420-440. The extra chain is 3.3-3.5% of one KV copy, 0.48 ms
per 32k prompt, paid once per token (decode: one block hash per 16 tokens).

Rejected: *one* 16-token chain with chunk keys bound at chunk ends (the vLLM-mode
scheme). It would save the engine the 256-token chain (0.35% of a KV copy) but make
every process that only looks up storage hash 9-10x more: a sidecar lookup of a 32k
prompt would spend 0.48 ms hashing instead of 0.05 ms (LMCache's whole lookup takes
0.35 ms, DESIGN 10), and the stored key format would change. Also rejected: keying
device blocks by the 256-token chain alone (hits in 256-token steps: up to 255
tokens recomputed per request instead of 15, where the last 256 tokens of a 4k
prefill take 0.19 s on our CPU model, to save 0.5 ms of hashing); and a hand-written
16-token loop (10 ns/token), a second definition of the chain to save 1% of a copy.

Errors: an expected shortage returns ``None`` (not enough free blocks); a bug
(double free, a block already cached under another prefix) raises ``RuntimeError``
naming the block and the likely culprit. Ref counts are never clamped.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import cast

from lmtier.chunks.keys import ExtraKeys, Namespace, Xxh3ChunkHasher
from lmtier.chunks.tokens import TokenInput
from lmtier_connector.device.free_queue import Block, BlockHash, FreeBlockQueue

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "Block",
    "BlockHash",
    "BlockHashMap",
    "BlockPool",
    "FreeBlockQueue",
    "PrefixCache",
    "block_hasher",
    "block_hashes",
]

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16


def block_hasher(
    namespace: Namespace,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    extras: ExtraKeys | None = None,
    vocab_size: int | None = None,
) -> Xxh3ChunkHasher:
    """Incremental device block hashes of one sequence: the ``block_size``-token chain."""
    block_namespace = dataclasses.replace(namespace, chunk_size=block_size)
    return Xxh3ChunkHasher(block_namespace, extras=extras, vocab_size=vocab_size)


def block_hashes(
    tokens: TokenInput,
    namespace: Namespace,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    extras: ExtraKeys | None = None,
) -> list[BlockHash]:
    """Device block hashes of every full block of ``tokens``."""
    keys = block_hasher(namespace, block_size, extras=extras).extend(tokens)
    return cast(list[BlockHash], keys)  # the same bytes; the NewType says which chain


class BlockHashMap:
    """Cached blocks by hash; one hash may map to several blocks holding the same KV.

    Duplicates are tolerated on purpose. Two requests with the same prefix can both
    miss, get different blocks and compute the same KV before either caches it; when
    the second caches, the pool does not swap its block for the first one, because
    block tables are append-only (a block id handed to the engine never changes
    under it: the KV is already written there and the engine may have captured the
    table). Both blocks stay cached under one hash until one is evicted, costing a
    duplicate block for a while. A lookup returns the earliest-cached one.

    The value is a single :class:`Block` in the common case and a ``dict`` of
    ``block_id -> Block`` only for duplicates, sparing an inner dict per entry.
    """

    __slots__ = ("_map",)

    def __init__(self) -> None:
        self._map: dict[BlockHash, Block | dict[int, Block]] = {}

    def get_one(self, block_hash: BlockHash) -> Block | None:
        """Any block cached under ``block_hash`` (the earliest-cached one), or ``None``."""
        entry = self._map.get(block_hash)
        if entry is None or isinstance(entry, Block):
            return entry
        return next(iter(entry.values()))

    def insert(self, block_hash: BlockHash, block: Block) -> None:
        entry = self._map.get(block_hash)
        if entry is None:
            self._map[block_hash] = block
        elif isinstance(entry, Block):
            if entry is not block:
                self._map[block_hash] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block

    def pop(self, block_hash: BlockHash, block_id: int) -> Block | None:
        """Remove block ``block_id`` from under ``block_hash``; ``None`` if it is not there."""
        entry = self._map.get(block_hash)
        if entry is None:
            return None
        if isinstance(entry, Block):
            if entry.block_id != block_id:
                return None
            del self._map[block_hash]
            return entry
        block = entry.pop(block_id, None)
        if not entry:
            del self._map[block_hash]
        return block

    def clear(self) -> None:
        self._map.clear()

    def __len__(self) -> int:
        """Number of distinct hashes."""
        return len(self._map)

    def items(self) -> Iterator[tuple[BlockHash, Block]]:
        """Every (hash, block) pair, duplicates included (for tests; O(n))."""
        for block_hash, entry in self._map.items():
            blocks = (entry,) if isinstance(entry, Block) else tuple(entry.values())
            for block in blocks:
                yield block_hash, block


class BlockPool:
    """``num_blocks`` preallocated block records, a free queue and the prefix-cache map.

    Block 0 is the null block (``is_null``): the placeholder id for padded block-table
    entries, never handed out or cached, so ``num_blocks - 1`` blocks are usable.
    With ``enable_caching=False`` no block is ever cached and the pool is a plain
    ref-counted allocator. Not thread-safe: one scheduler thread owns it, as in vLLM.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[Block] = [Block(block_id) for block_id in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.cached_blocks = BlockHashMap()

    def get_new_blocks(self, num_blocks: int) -> list[Block] | None:
        """Hand out ``num_blocks`` blocks from the head of the free queue, each with ref 1.

        Returns ``None``, changing nothing, when fewer are free. A handed-out block
        that was cached loses its hash: its KV is about to be overwritten.
        """
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > self.free_queue.num_free:
            return None
        blocks = self.free_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.ref_cnt != 0:
                raise RuntimeError(
                    f"block {block.block_id} was in the free queue with ref_cnt={block.ref_cnt}; "
                    "the likely culprit is code that changed ref_cnt outside the pool"
                )
            if block.block_hash is not None:
                self._drop_hash(block)
            block.ref_cnt = 1
        return blocks

    def cache_full_blocks(
        self,
        blocks: Sequence[Block],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Cache ``blocks[num_cached_blocks:num_full_blocks]``, newly full, under their hashes.

        ``blocks`` is a request's block table and ``block_hashes[i]`` the hash of the
        prefix ending with ``blocks[i]``. The null block is skipped. Caching a block
        that already holds the same hash does nothing.
        """
        if not self.enable_caching or num_cached_blocks >= num_full_blocks:
            return
        if num_full_blocks > min(len(blocks), len(block_hashes)):
            raise ValueError(
                f"num_full_blocks={num_full_blocks} exceeds the {len(blocks)} blocks "
                f"or {len(block_hashes)} hashes given"
            )
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.is_null:
                continue
            block_hash = block_hashes[index]
            if block.block_hash is not None:
                if block.block_hash == block_hash:
                    continue
                raise RuntimeError(
                    f"block {block.block_id} is already cached under another prefix; the "
                    "likely culprit is num_cached_blocks too small or hashes misaligned"
                )
            block.block_hash = block_hash
            self.cached_blocks.insert(block_hash, block)

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        """A block holding the KV of the prefix ``block_hash`` names, or ``None``."""
        return self.cached_blocks.get_one(block_hash)

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on each block (a cache hit); a free one leaves the free queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[Block]) -> None:
        """Drop a reference on each block; blocks reaching 0 join the free queue.

        ``ordered_blocks`` is in eviction order, first evicted first: a request
        passes its blocks in reverse, so its tail goes before the prefix head that
        other requests are likelier to share. Blocks without a hash can serve no hit
        and go to the *front* of the queue, in that order, to be reused next (while
        their memory is probably still in the device's caches); hashed blocks go to
        the *back*, so the queue front stays the least recently used cached block.
        """
        to_front: list[Block] = []
        to_back: list[Block] = []
        try:
            for block in ordered_blocks:
                if block.is_null:
                    continue
                if block.ref_cnt <= 0:
                    raise RuntimeError(
                        f"double free of block {block.block_id} (ref_cnt is already 0); the "
                        "likely culprit is a request freed twice, or a block freed without a "
                        "matching allocation or touch"
                    )
                block.ref_cnt -= 1
                if block.ref_cnt == 0:
                    (to_back if block.block_hash is not None else to_front).append(block)
        finally:
            # Even when a double free stops the loop, the blocks already at 0 are
            # queued, so the pool stays consistent for the error report.
            self.free_queue.prepend_n(to_front)
            self.free_queue.append_n(to_back)

    def evict_blocks(self, block_ids: Iterable[int]) -> int:
        """Drop the hash of the given blocks (their KV is stale); return how many had one.

        Blocks keep their ref counts and their place: a block in use stays with its
        request, only no new request will hit it; a free one is reused in turn.
        """
        num_evicted = 0
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(
                    f"block id {block_id} is outside the pool (0..{self.num_blocks - 1}); "
                    "the likely culprit is a block id from another pool or engine"
                )
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._drop_hash(block)
                num_evicted += 1
        return num_evicted

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (after a weight update); ``False`` while any is in use."""
        num_used = self.num_blocks - 1 - self.free_queue.num_free
        if num_used > 0:
            logger.warning("prefix cache not reset: %d blocks are still in use", num_used)
            return False
        self.cached_blocks.clear()
        for block in self.blocks:
            block.block_hash = None
        logger.info("prefix cache reset")
        return True

    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now, cached or not."""
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks in use, 0.0 to 1.0."""
        return 1.0 - self.free_queue.num_free / (self.num_blocks - 1)

    def _drop_hash(self, block: Block) -> None:
        assert block.block_hash is not None
        self.cached_blocks.pop(block.block_hash, block.block_id)
        block.block_hash = None


class PrefixCache:
    """Per-request block tables over a :class:`BlockPool`: what a scheduler calls.

    A request's life: ``find_longest_cache_hit`` (side-effect free), then
    ``allocate`` with the hit blocks, ``cache`` as its blocks fill, ``allocate``
    again as it grows, ``free`` when it ends.
    """

    def __init__(self, pool: BlockPool, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self._blocks: dict[str, list[Block]] = {}
        self._num_cached_blocks: dict[str, int] = {}

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> tuple[list[Block], int]:
        """The cached blocks of the longest hit prefix and the number of tokens they hold.

        Never covers the last of ``num_tokens``: the model must run on at least one
        token to produce the next-token logits, so when the whole prompt is cached
        the last block is left out and recomputed. Stops at the first miss: a block's
        hash chains over everything before it, so no later block can hit.
        """
        if not self.pool.enable_caching or num_tokens <= 0:
            return [], 0
        max_blocks = (num_tokens - 1) // self.block_size
        hit: list[Block] = []
        for block_hash in block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def allocate(
        self, request_id: str, num_tokens: int, computed_blocks: Sequence[Block] = ()
    ) -> list[Block] | None:
        """Give ``request_id`` slots for ``num_tokens`` tokens in all; return the new blocks.

        ``computed_blocks`` (the hit from :meth:`find_longest_cache_hit`) is only
        accepted on a request's first allocation; they are touched and head its
        block table. Returns ``None``, changing nothing, when the pool is short.
        """
        blocks = self._blocks.get(request_id)
        if blocks is not None and computed_blocks:
            raise ValueError(
                f"request {request_id!r} already has blocks; cache hits are only "
                "accepted on its first allocation"
            )
        num_held = len(computed_blocks) + (len(blocks) if blocks is not None else 0)
        num_new = max(-(-num_tokens // self.block_size) - num_held, 0)
        # Touching a free hit block takes it out of the free queue, so it counts too.
        num_revived = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_new + num_revived > self.pool.get_num_free_blocks():
            return None
        if blocks is None:
            blocks = self._blocks[request_id] = []
            self._num_cached_blocks[request_id] = len(computed_blocks)
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new)
        assert new_blocks is not None  # capacity was checked above
        blocks.extend(new_blocks)
        return new_blocks

    def cache(self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Cache the blocks of ``request_id`` that the first ``num_tokens`` tokens fill."""
        blocks = self._request_blocks(request_id)
        num_cached = self._num_cached_blocks[request_id]
        num_full = min(num_tokens, len(block_hashes) * self.block_size) // self.block_size
        self.pool.cache_full_blocks(blocks, block_hashes, num_cached, num_full)
        self._num_cached_blocks[request_id] = max(num_cached, num_full)

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first; an unknown request is a no-op (abort)."""
        blocks = self._blocks.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        """Leading blocks of ``request_id`` shared by every running request.

        A block every running request references has ``ref_cnt ==
        num_running_requests`` (cascade attention computes that prefix once).
        """
        num_common = 0
        for block in self._request_blocks(request_id):
            if block.ref_cnt != num_running_requests:
                break
            num_common += 1
        return num_common

    def get_blocks(self, request_id: str) -> Sequence[Block]:
        """The request's block table, in token order."""
        return self._request_blocks(request_id)

    def _request_blocks(self, request_id: str) -> list[Block]:
        blocks = self._blocks.get(request_id)
        if blocks is None:
            raise KeyError(f"unknown request {request_id!r}: never allocated, or already freed")
        return blocks
