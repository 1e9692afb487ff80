"""The GPU prefix-cache tier for engines that do not page their KV (HF transformers).

vLLM keeps every request's KV in pages and caches full blocks itself (APC). A plain
transformers model does not, so :class:`DevicePrefixCache` adds that tier above
lmtier's storage: paged K/V on the model's device (:mod:`.paged_kv`), the block
bookkeeping of :class:`~.block_pool.PrefixCache`, and block hashes from the 16-token
chain (:func:`~.block_pool.block_hashes`, decision in :mod:`.block_pool`). After a
prefill, its full blocks are scattered into pages and cached; the request's blocks
are freed at once, so they stay cached in LRU order until allocation evicts them, as
in vLLM after a request finishes.

A lookup never covers the last prompt token. A load gathers the hit blocks into one
new tensor in the chunk layout (``KVSpec.shape``), the same shape storage loads give.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmtier.chunks.keys import BLOCK_SIZE, Namespace
from lmtier.kv_spec import KVSpec, LayerKV
from lmtier_connector.device.block_pool import (
    Block,
    BlockHash,
    BlockPool,
    PrefixCache,
    block_hashes,
)
from lmtier_connector.device.paged_kv import PagedKVCache
from lmtier_connector.device.transfer import gather, scatter

__all__ = ["DeviceHit", "DevicePrefixCache"]


@dataclass(frozen=True, slots=True)
class DeviceHit:
    """The cached blocks of a prompt's prefix and the block hashes of its full blocks."""

    blocks: list[Block]
    hashes: list[BlockHash]
    num_tokens: int


class DevicePrefixCache:
    """Paged KV on the model's device with vLLM-style prefix caching (module docstring)."""

    def __init__(
        self,
        spec: KVSpec,
        num_blocks: int,
        *,
        block_size: int = BLOCK_SIZE,
        device: torch.device | str = "cpu",
    ) -> None:
        if spec.layout != "LKTHD":
            raise ValueError(f"the device tier keeps KV in the LKTHD layout, not {spec.layout}")
        self.spec = spec
        self.block_size = block_size
        self.pages = PagedKVCache(spec, num_blocks, block_size, device)
        self.pool = BlockPool(num_blocks)
        self.prefix = PrefixCache(self.pool, block_size)
        self._request_ids = itertools.count()

    def lookup(self, tokens: Sequence[int], namespace: Namespace) -> DeviceHit:
        """The longest cached prefix of ``tokens`` (whole blocks, never the last token)."""
        hashes = block_hashes(tokens, namespace, self.block_size)
        blocks, num_tokens = self.prefix.find_longest_cache_hit(hashes, len(tokens))
        return DeviceHit(blocks, hashes, num_tokens)

    def load(self, hit: DeviceHit, num_tokens: int) -> torch.Tensor:
        """The KV of the first ``num_tokens`` tokens of ``hit`` (a multiple of the block
        size), gathered into a new tensor shaped ``spec.shape(num_tokens)``."""
        if num_tokens % self.block_size or num_tokens > hit.num_tokens:
            raise ValueError(f"cannot load {num_tokens} tokens of a {hit.num_tokens}-token hit")
        out = torch.empty(
            self.spec.shape(num_tokens), dtype=self.pages.dtype, device=self.pages.device
        )
        if num_tokens:
            block_ids = [block.block_id for block in hit.blocks[: num_tokens // self.block_size]]
            gather(self.pages, block_ids, out)
        return out

    def save(self, hit: DeviceHit, layers: Sequence[LayerKV], num_tokens: int) -> int:
        """Cache the full blocks of a sequence whose KV (all ``num_tokens``) is ``layers``.

        Blocks of ``hit`` are reused as they are; new full blocks get pages (evicting
        least recently used cached blocks) and are cached. Returns the blocks written,
        0 when the pool cannot hold them (the device tier simply keeps less).
        """
        num_full = min(num_tokens // self.block_size, len(hit.hashes))
        reused = hit.blocks[:num_full]
        request_id = f"hf-{next(self._request_ids)}"
        new_blocks = self.prefix.allocate(request_id, num_full * self.block_size, reused)
        try:
            if new_blocks is None:
                return 0
            if new_blocks:
                start, stop = len(reused) * self.block_size, num_full * self.block_size
                kv = torch.stack([torch.stack((k[start:stop], v[start:stop])) for k, v in layers])
                scatter(kv, self.pages, [block.block_id for block in new_blocks])
            self.prefix.cache(request_id, hit.hashes, num_full * self.block_size)
            return len(new_blocks)
        finally:
            self.prefix.free(request_id)
