"""An out-of-tree storage backend, as a third party would ship one: a bounded in-memory
tier registered under the ``lmtier.backends`` entry point ``memo`` (see the
``.dist-info`` beside this package). The tests put this folder on ``sys.path`` and
check that lmtier finds it by name, opens it from ``extra_tiers`` and that it passes
the conformance suite."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from lmtier.chunks.keys import ChunkKey
from lmtier.errors import ConfigError
from lmtier.storage.stats import TierStats
from lmtier.storage.tier import UNSERVABLE, Buffer, Tier, TierProperties


class MemoTier(Tier):
    """Up to ``max_chunks`` chunks in an LRU dict."""

    def __init__(self, max_chunks: int = 1024, name: str = "memo") -> None:
        if max_chunks < 1:
            raise ConfigError(f"memo tier: max_chunks must be >= 1, got {max_chunks}")
        self.name = name
        self.properties = TierProperties()
        self.stats = TierStats()
        self.max_chunks = max_chunks
        self.data: OrderedDict[ChunkKey, bytes] = OrderedDict()

    async def contains(self, keys: Sequence[ChunkKey]) -> int:
        count = 0
        for key in keys:
            if key not in self.data:
                break
            count += 1
        return count

    async def _read_into(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        sizes: list[int | None] = []
        for key, buffer in zip(keys, buffers, strict=True):
            data = self.data.get(key)
            if data is None:
                sizes.append(None)
            elif len(data) > len(buffer):
                sizes.append(UNSERVABLE)
            else:
                buffer[: len(data)] = data
                self.data.move_to_end(key)
                sizes.append(len(data))
        return sizes

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> int:
        for key, data in items:
            self.data[key] = bytes(data)
            self.data.move_to_end(key)
            while len(self.data) > self.max_chunks:
                self.data.popitem(last=False)
        return len(items)

    async def delete(self, keys: Sequence[ChunkKey]) -> int:
        return sum(self.data.pop(key, None) is not None for key in keys)


async def open_tier(section: Any) -> MemoTier:
    """Entry point ``lmtier.backends: memo``: ``section.options`` are MemoTier's."""
    return await MemoTier.open(**section.options)
