"""Helpers for tests of lmtier and of code built on it (shipped with the library).

They build *real* encoded chunks with the real codec, so a test that stores them
in a tier exercises the same bytes production does. :class:`DictTier` is an
in-memory :class:`~lmtier.storage.tier.Tier` with fault knobs, for unit tests of code that
sits on tiers (like httpx's MockTransport); integration tests use the real backends.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

import numpy as np

from lmtier.chunks.encoding import encode
from lmtier.chunks.format import ChunkMeta
from lmtier.chunks.keys import ChunkKey, split_key
from lmtier.errors import BackendUnavailable
from lmtier.storage.stats import TierStats
from lmtier.storage.tier import Buffer, Tier, TierProperties

__all__ = ["DictTier", "FakeClock", "make_chunk", "random_key"]

TEST_NAMESPACE = b"lmtier-testing!!"
"""A 16-byte namespace digest for chunks made here."""


class FakeClock:
    """A clock for code that takes ``clock=`` (breakers, backoffs): advance ``now`` by hand."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def random_key(namespace: bytes = TEST_NAMESPACE) -> ChunkKey:
    """A fresh random chunk key in ``namespace`` (a 16-byte digest)."""
    return ChunkKey(namespace + os.urandom(16))


def make_chunk(
    key: ChunkKey | None = None, *, num_tokens: int = 16, hidden: int = 64, seed: int | None = None
) -> tuple[ChunkKey, bytes]:
    """A valid encoded chunk of float32 KV in the ``LKTHD`` layout (1 layer, 1 head).

    Payload size is ``2 * num_tokens * hidden * 4`` bytes; the values are random
    (``seed`` makes them reproducible). Returns ``(key, encoded bytes)``.
    """
    key = key if key is not None else random_key()
    rng = np.random.default_rng(seed)
    payload = rng.standard_normal((1, 2, num_tokens, 1, hidden), dtype=np.float32)
    namespace, chain = split_key(key)
    meta = ChunkMeta(
        key=chain,
        namespace=namespace,
        dtype="float32",
        shape=payload.shape,
        layout="LKTHD",
        num_tokens=num_tokens,
    )
    return key, encode(meta, payload)


class DictTier(Tier):
    """A dict-backed tier with fault injection, for unit tests.

    ``fail``: every call raises BackendUnavailable. ``hang``: every call waits
    forever (until cancelled by a timeout). ``calls`` counts calls per method name,
    and ``asked`` records the keys each ``contains`` was asked about.
    """

    def __init__(self, name: str = "dict", properties: TierProperties | None = None) -> None:
        self.name = name
        self.properties = properties or TierProperties(shared=False)
        self.stats = TierStats()
        self.data: dict[ChunkKey, bytes] = {}
        self.fail = False
        self.hang = False
        self.calls: dict[str, int] = {}
        self.asked: list[list[ChunkKey]] = []

    async def _enter(self, method: str) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if self.hang:
            await asyncio.Event().wait()
        if self.fail:
            raise BackendUnavailable(f"{self.name} is down (injected)")

    async def contains(self, keys: Sequence[ChunkKey]) -> int:
        await self._enter("contains")
        self.asked.append(list(keys))
        count = 0
        for key in keys:
            if key not in self.data:
                break
            count += 1
        return count

    async def _read_into(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        await self._enter("get")
        sizes: list[int | None] = []
        for key, buffer in zip(keys, buffers, strict=True):
            data = self.data.get(key)
            if data is None or len(data) > len(buffer):
                sizes.append(None)
                continue
            buffer[: len(data)] = data
            sizes.append(len(data))
        return sizes

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> int:
        await self._enter("put")
        for key, data in items:
            self.data[key] = bytes(data)
        self.stats.puts += len(items)
        return len(items)

    async def delete(self, keys: Sequence[ChunkKey]) -> int:
        await self._enter("delete")
        return sum(self.data.pop(key, None) is not None for key in keys)

    async def _purge(self, namespace: bytes) -> int:
        await self._enter("purge")
        doomed = [key for key in self.data if key.startswith(namespace)]
        for key in doomed:
            del self.data[key]
        return len(doomed)

    async def _count_namespace(self, namespace: bytes) -> int:
        await self._enter("purge")
        return sum(key.startswith(namespace) for key in self.data)
