"""Reads: host-memory loads in the caller's thread, slabs of a tier's batch in address order."""

from __future__ import annotations

import asyncio
import threading

from lmtier.chunks.keys import ChunkKey
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.host_pool import HostPool
from lmtier.storage.lookup import LoadedChunk, Lookup, TierSpan
from lmtier.storage.manager import StorageManager
from lmtier.testing import DictTier, make_chunk

SLAB = 16 * 1024


def chunks(n: int) -> list[tuple[ChunkKey, bytes]]:
    return [make_chunk(num_tokens=4, hidden=16, seed=i) for i in range(n)]


def in_thread(fn: object) -> object:
    """``fn()`` in a thread with no event loop (an engine's thread)."""
    out: list[object] = []
    worker = threading.Thread(target=lambda: out.append(fn()))  # type: ignore[operator]
    worker.start()
    worker.join()
    return out[0]


def test_a_load_host_memory_holds_whole_is_served_in_the_callers_thread() -> None:
    async def case() -> None:
        pool = HostPool(SLAB, 16)
        manager = StorageManager(CPUTier(pool), [disk := DictTier("disk")])
        await manager.start()
        items = chunks(4)
        keys = [key for key, _ in items]
        await manager.cpu_tier.put(items[:3])
        disk.data.update(items[3:])
        reads = manager.reads

        loaded = in_thread(lambda: reads.get_now(keys[:3]))
        assert isinstance(loaded, list)
        assert [(c.key, c.tier) for c in loaded] == [(k, "cpu") for k in keys[:3]]
        for chunk, (_, data) in zip(loaded, items, strict=False):
            assert isinstance(chunk, LoadedChunk)
            assert bytes(chunk.handle.view[: len(data)]) == data
            chunk.release()
        # A chunk only a lower tier holds: the loop's walk, and nothing leased here.
        in_use = pool.num_in_use
        assert in_thread(lambda: reads.get_now(keys)) is None
        assert pool.num_in_use == in_use
        assert disk.calls == {}
        # A lookup's spans: served here when every one is host memory's.
        cpu_only = Lookup(2, (TierSpan("cpu", 0, 2),))
        lower = Lookup(4, (TierSpan("cpu", 0, 3), TierSpan("disk", 3, 4)))
        assert in_thread(lambda: reads.get_now(keys, lower)) is None
        served = in_thread(lambda: reads.get_now(keys, cpu_only))
        assert isinstance(served, list) and [c.key for c in served] == keys[:2]
        for chunk in served:
            chunk.release()
        await manager.close()
        assert pool.num_in_use == 0, "slabs leaked"
        pool.close()

    asyncio.run(case())


def test_a_tier_batch_reads_into_slabs_in_address_order() -> None:
    """LoadResult.kv copies evenly spaced slabs in one call: a batch's slabs go in
    address order, whatever order the pool's free list hands them out in."""

    async def case() -> None:
        pool = HostPool(SLAB, 16)
        manager = StorageManager(CPUTier(pool), [disk := DictTier("disk")])
        await manager.start()
        taken = [pool.acquire() for _ in range(6)]
        for handle in taken:  # released in order: the free list hands them back reversed
            assert handle is not None
            handle.release()
        items = chunks(6)
        disk.data.update(items)
        loaded = await manager.get([key for key, _ in items])
        indexes = [chunk.handle.index for chunk in loaded]
        # The first batch of a tier without an index is one chunk (SPECULATIVE_FIRST);
        # the free list had the other five in descending order.
        assert len(loaded) == 6 and indexes[1:] == sorted(indexes[1:])
        for chunk in loaded:
            chunk.release()
        await manager.close()
        pool.close()

    asyncio.run(case())
