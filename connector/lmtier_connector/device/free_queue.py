"""Block records of the device block pool and the free queue that orders their eviction.

Every :class:`Block` is created once, when the pool is built, and lives as long as the
pool: the hot path (allocate, touch, free) moves existing records between lists and
never creates Python objects. The free queue's links live inside the records for the
same reason (see :class:`FreeBlockQueue`). :mod:`.block_pool` builds on these.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NewType

__all__ = ["Block", "BlockHash", "FreeBlockQueue"]

BlockHash = NewType("BlockHash", bytes)
"""The key of one full block: a chained hash of every token up to the block's end
(the module docstring of :mod:`lmtier_connector.device.block_pool` says which chain)."""

_SENTINEL_ID = -1


@dataclass(slots=True, eq=False)
class Block:
    """Bookkeeping of one physical KV block; the KV itself lives in device memory elsewhere.

    Invariants, kept by :class:`lmtier_connector.device.block_pool.BlockPool`:

    - ``ref_cnt`` counts the requests (and other holders) using the block; it is never
      negative. A block with ``ref_cnt == 0`` is in the free queue, exactly once,
      whether or not it still has a hash; a block with ``ref_cnt > 0`` is not.
    - ``block_hash`` is set only on a full block whose KV is computed, and then the
      pool's hash map holds it under that hash: it is a prefix-cache entry, reusable
      by a later request until the block is handed out again or evicted.
    - ``prev_free``/``next_free`` are set exactly while the block is in the free
      queue; only :class:`FreeBlockQueue` touches them.
    - ``is_null`` marks block 0, the pool's placeholder: it pads block tables, is
      never handed out, never cached, and its ``ref_cnt`` is not maintained.

    ``eq=False``: blocks compare by identity, which is what a block *is*; generated
    field-wise equality would also recurse along the free-list links.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: Block | None = field(default=None, repr=False)
    next_free: Block | None = field(default=None, repr=False)
    is_null: bool = False


class FreeBlockQueue:
    """Free blocks in eviction order: the head is handed out (and its hash evicted) first.

    A doubly linked list threaded through the preallocated :class:`Block` records,
    between two sentinel records that are never removed (so no operation branches on
    an empty list or an end). It is hand-made rather than a ``collections.deque``
    because a prefix-cache hit must pull a free block out of the *middle* of the
    queue (``touch``) in O(1); a deque removes from the middle in O(n), and would also
    allocate a node per entry. Here every operation only rewires existing records.

    Order, as kept by the pool: blocks never used since start-up in id order; then
    the front takes blocks freed without a hash (worthless to the cache, reused
    first), the back takes hashed blocks as they are freed (least recently used at
    the front). A request frees its blocks tail first, so within one request the
    block ending the longest prefix is evicted first and the shared head of the
    prefix survives longest.
    """

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(_SENTINEL_ID)
        self._tail = Block(_SENTINEL_ID)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        self.append_n(blocks)

    def popleft(self) -> Block:
        """Remove and return the head (the next block to hand out)."""
        block = self._head.next_free
        if block is None or block is self._tail:
            raise RuntimeError("popleft on an empty free queue; callers check num_free first")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[Block]:
        """Remove and return the first ``n`` blocks, head first."""
        if n > self.num_free:
            raise RuntimeError(f"popleft_n({n}) with only {self.num_free} free blocks")
        popped: list[Block] = []
        block = self._head.next_free
        for _ in range(n):
            assert block is not None  # n <= num_free: never runs past the tail
            popped.append(block)
            following = block.next_free
            block.prev_free = block.next_free = None
            block = following
        assert block is not None
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free -= n
        return popped

    def remove(self, block: Block) -> None:
        """Take ``block`` out from anywhere in the queue, in O(1)."""
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(
                f"block {block.block_id} is not in the free queue (ref_cnt={block.ref_cnt}); "
                "the likely culprit is a touch or pop of a block that is already in use"
            )
        self._unlink(block)

    def append(self, block: Block) -> None:
        """Put ``block`` at the back (evicted last)."""
        self.append_n((block,))

    def append_n(self, blocks: Iterable[Block]) -> None:
        """Put ``blocks`` at the back, in order: the first of them is evicted first."""
        last = self._tail.prev_free
        assert last is not None
        count = 0
        for block in blocks:
            if block.prev_free is not None:
                self._refuse_queued(block)
            last.next_free = block
            block.prev_free = last
            last = block
            count += 1
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free += count

    def prepend_n(self, blocks: Iterable[Block]) -> None:
        """Put ``blocks`` at the front, in order: the first of them is evicted first."""
        first = self._head.next_free
        assert first is not None
        previous = self._head
        count = 0
        for block in blocks:
            if block.prev_free is not None:
                self._refuse_queued(block)
            previous.next_free = block
            block.prev_free = previous
            previous = block
            count += 1
        previous.next_free = first
        first.prev_free = previous
        self.num_free += count

    def get_all_free_blocks(self) -> list[Block]:
        """Every queued block, head first (for tests and debugging; O(n))."""
        blocks: list[Block] = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            blocks.append(block)
            block = block.next_free
        return blocks

    def check_links(self) -> None:
        """Raise ``RuntimeError`` unless the list is consistent both ways (for tests)."""
        forward = self.get_all_free_blocks()
        backward: list[Block] = []
        block = self._tail.prev_free
        while block is not None and block is not self._head:
            backward.append(block)
            block = block.prev_free
        if backward[::-1] != forward or len(forward) != self.num_free:
            raise RuntimeError(
                f"free queue links are inconsistent: {len(forward)} blocks forward, "
                f"{len(backward)} backward, num_free={self.num_free}"
            )
        if len({id(b) for b in forward}) != len(forward):
            raise RuntimeError("a block is in the free queue more than once")

    def _unlink(self, block: Block) -> None:
        previous, following = block.prev_free, block.next_free
        assert previous is not None and following is not None
        previous.next_free = following
        following.prev_free = previous
        block.prev_free = block.next_free = None
        self.num_free -= 1

    @staticmethod
    def _refuse_queued(block: Block) -> None:
        # Linking a queued block again would cut the list in two and lose blocks
        # silently; one attribute test per block (inline above) makes it a loud error.
        raise RuntimeError(
            f"block {block.block_id} is already in the free queue; the likely culprit "
            "is a block freed twice, or appended without being popped or removed"
        )
