"""The conformance suite every tier must pass (needs pytest; import it from tests only).

Subclass :class:`TierConformance` in a test module and provide a ``make_tier``
fixture: an async callable returning a fresh, opened tier (each call a new one on
the same storage, so tests can reopen). Every test runs its body on a fresh event
loop with ``asyncio.run``; no pytest plugin is needed::

    class TestDiskTier(TierConformance):
        @pytest.fixture
        def make_tier(self, tmp_path):
            return lambda: DiskTier.open(tmp_path, capacity_bytes=1 << 30)

The suite checks the interface contract of :mod:`lmtier.storage.tier` with real encoded
chunks: leading-prefix ``contains``, round trips, misses as None, deletes, empty
batches, idempotent close, (for tiers that verify reads) that corrupt or misplaced
chunks become counted misses and are deleted, and that a purge deletes one namespace's
chunks and no other's (a tier that cannot purge must say so with NotSupportedError,
and its purge tests are skipped).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from lmtier.chunks.keys import ChunkKey
from lmtier.errors import InvalidRequestError, NotSupportedError
from lmtier.storage.tier import Tier
from lmtier.testing import make_chunk, random_key

__all__ = ["TierConformance"]

TierFactory = Callable[[], Awaitable[Tier]]

BUFFER_BYTES = 64 * 1024


def _run(body: Callable[[Tier], Coroutine[Any, Any, None]], make_tier: TierFactory) -> None:
    async def case() -> None:
        tier = await make_tier()
        try:
            await body(tier)
        finally:
            await tier.close()

    asyncio.run(case())


def _buffers(count: int, size: int = BUFFER_BYTES) -> list[memoryview]:
    return [memoryview(bytearray(size)) for _ in range(count)]


class TierConformance:
    """Contract tests for a :class:`~lmtier.storage.tier.Tier`; see the module docstring.

    Subclasses must define the ``make_tier`` fixture; pytest reports a missing one
    by name.
    """

    def test_round_trip(self, make_tier: TierFactory) -> None:
        async def body(tier: Tier) -> None:
            chunks = [make_chunk(seed=i) for i in range(5)]
            assert await tier.put(chunks) == 5
            keys = [key for key, _ in chunks]
            buffers = _buffers(5)
            sizes = await tier.get_into(keys, buffers)
            for (_, data), size, buffer in zip(chunks, sizes, buffers, strict=True):
                assert size == len(data)
                assert bytes(buffer[:size]) == data
            assert tier.stats.hits >= 5

        _run(body, make_tier)

    def test_contains_counts_leading_keys_only(self, make_tier: TierFactory) -> None:
        async def body(tier: Tier) -> None:
            a, b, c = make_chunk(), make_chunk(), make_chunk()
            await tier.put([a, c])
            assert await tier.contains([a[0]]) == 1
            assert await tier.contains([a[0], b[0], c[0]]) == 1
            assert await tier.contains([b[0], a[0]]) == 0
            await tier.put([b])
            assert await tier.contains([a[0], b[0], c[0], random_key()]) == 3

        _run(body, make_tier)

    def test_missing_keys_are_none(self, make_tier: TierFactory) -> None:
        async def body(tier: Tier) -> None:
            present = make_chunk()
            await tier.put([present])
            keys = [random_key(), present[0], random_key()]
            sizes = await tier.get_into(keys, _buffers(3))
            assert sizes == [None, len(present[1]), None]
            assert tier.stats.misses >= 2

        _run(body, make_tier)

    def test_chunk_larger_than_its_buffer_is_removed(self, make_tier: TierFactory) -> None:
        # Buffers are the cache's slabs: a chunk that does not fit one can never be
        # served, so it is a miss, counted, and removed (no phantom hit for lookups).
        async def body(tier: Tier) -> None:
            (key, data), (other, more) = make_chunk(), make_chunk()
            await tier.put([(key, data), (other, more)])
            sizes = await tier.get_into([key, other], [*_buffers(1, len(data) - 1), *_buffers(1)])
            assert sizes == [None, len(more)]
            assert tier.stats.unservable == 1
            assert await tier.contains([key]) == 0
            assert await tier.contains([other]) == 1

        _run(body, make_tier)

    def test_delete(self, make_tier: TierFactory) -> None:
        async def body(tier: Tier) -> None:
            a, b = make_chunk(), make_chunk()
            await tier.put([a, b])
            assert await tier.delete([a[0], random_key()]) == 1
            assert await tier.contains([a[0]]) == 0
            assert await tier.get_into([a[0], b[0]], _buffers(2)) == [None, len(b[1])]

        _run(body, make_tier)

    def test_overwrite_keeps_one_valid_chunk(self, make_tier: TierFactory) -> None:
        async def body(tier: Tier) -> None:
            key, first = make_chunk(seed=1)
            _, second = make_chunk(key, seed=2)
            await tier.put([(key, first)])
            await tier.put([(key, second)])
            buffer = _buffers(1)[0]
            (size,) = await tier.get_into([key], [buffer])
            assert size is not None
            assert bytes(buffer[:size]) in (first, second)

        _run(body, make_tier)

    def test_empty_batches(self, make_tier: TierFactory) -> None:
        async def body(tier: Tier) -> None:
            assert await tier.contains([]) == 0
            assert await tier.get_into([], []) == []
            assert await tier.put([]) == 0
            assert await tier.delete([]) == 0

        _run(body, make_tier)

    def test_mismatched_buffers_is_a_caller_bug(self, make_tier: TierFactory) -> None:
        async def body(tier: Tier) -> None:
            with pytest.raises(ValueError, match="buffers"):
                await tier.get_into([random_key()], [])

        _run(body, make_tier)

    def test_large_batch(self, make_tier: TierFactory) -> None:
        async def body(tier: Tier) -> None:
            chunks = [make_chunk(num_tokens=4, hidden=16) for _ in range(200)]
            assert await tier.put(chunks) == 200
            keys = [key for key, _ in chunks]
            assert await tier.contains(keys) == 200
            sizes = await tier.get_into(keys, _buffers(200, 8192))
            assert sizes == [len(data) for _, data in chunks]

        _run(body, make_tier)

    def test_corrupt_chunk_is_a_counted_miss_and_deleted(self, make_tier: TierFactory) -> None:
        async def body(tier: Tier) -> None:
            if not tier.properties.verify_reads:
                return  # memory this process validated on entry is trusted by declaration
            key, data = make_chunk()
            damaged = bytearray(data)
            damaged[-1] ^= 0xFF
            await tier.put([(key, bytes(damaged))])
            assert await tier.get_into([key], _buffers(1)) == [None]
            assert tier.stats.corrupt == 1
            assert await tier.contains([key]) == 0

        _run(body, make_tier)

    def test_chunk_stored_under_another_key_is_a_miss(self, make_tier: TierFactory) -> None:
        async def body(tier: Tier) -> None:
            if not tier.properties.verify_reads:
                return
            _, data = make_chunk()
            wrong = ChunkKey(random_key())
            await tier.put([(wrong, data)])
            assert await tier.get_into([wrong], _buffers(1)) == [None]
            assert tier.stats.corrupt == 1

        _run(body, make_tier)

    def test_close_is_idempotent(self, make_tier: TierFactory) -> None:
        async def body(tier: Tier) -> None:
            await tier.put([make_chunk()])
            await tier.close()

        _run(body, make_tier)

    def test_purge_deletes_one_namespace_and_spares_the_others(
        self, make_tier: TierFactory
    ) -> None:
        unsupported: list[str] = []

        async def body(tier: Tier) -> None:
            doomed_ns = os.urandom(16)
            near_ns = doomed_ns[:15] + bytes([doomed_ns[15] ^ 1])  # shares 15 bytes
            doomed = [make_chunk(random_key(doomed_ns), seed=i) for i in range(5)]
            kept = [make_chunk(random_key(ns)) for ns in (near_ns, near_ns, os.urandom(16))]
            assert await tier.put([*doomed, *kept]) == 8
            doomed_keys, kept_keys = [k for k, _ in doomed], [k for k, _ in kept]
            try:
                counted = await tier.count_namespace(doomed_ns)  # a dry run: counts only
                purged = await tier.purge(doomed_ns)
            except NotSupportedError:
                assert await tier.contains(doomed_keys) == 5  # it said so: nothing went
                unsupported.append(tier.name)
                return
            assert counted == 5 and purged == 5
            assert await tier.count_namespace(near_ns) == 2
            assert tier.stats.purged == 5
            assert [await tier.contains([key]) for key in doomed_keys] == [0] * 5
            assert await tier.get_into(doomed_keys, _buffers(5)) == [None] * 5
            assert await tier.contains(kept_keys) == 3
            assert await tier.get_into(kept_keys, _buffers(3)) == [len(d) for _, d in kept]
            assert await tier.purge(doomed_ns) == 0  # nothing left: nothing to count
            reopened = await make_tier()
            try:
                assert [await reopened.contains([key]) for key in doomed_keys] == [0] * 5
            finally:
                await reopened.close()

        _run(body, make_tier)
        if unsupported:
            pytest.skip(f"{unsupported[0]} cannot purge (NotSupportedError)")

    def test_purge_of_an_empty_namespace(self, make_tier: TierFactory) -> None:
        async def body(tier: Tier) -> None:
            kept = make_chunk()
            await tier.put([kept])
            try:
                assert await tier.purge(os.urandom(16)) == 0
            except NotSupportedError:
                return
            assert await tier.contains([kept[0]]) == 1

        _run(body, make_tier)

    def test_purge_needs_a_16_byte_namespace(self, make_tier: TierFactory) -> None:
        # A shorter prefix would select the chunks of every namespace that starts with it.
        async def body(tier: Tier) -> None:
            (key, data) = make_chunk()
            await tier.put([(key, data)])
            for bad in (key[:15], key, b"", "0" * 16, None):
                with pytest.raises(InvalidRequestError, match="16-byte"):
                    await tier.purge(bad)  # type: ignore[arg-type]
            assert await tier.contains([key]) == 1

        _run(body, make_tier)
