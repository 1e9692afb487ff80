"""StorageManager under faults: late I/O after a timeout never touches a reused slab,
checks on every served chunk, paced batches, stores that never wait on remote tiers."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from lmtier.chunks.format import ChunkGeometry
from lmtier.chunks.keys import ChunkKey
from lmtier.storage.blocking import run_blocking
from lmtier.storage.check import ChunkCheck
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.host_pool import HostPool
from lmtier.storage.manager import StorageManager
from lmtier.storage.pacing import INITIAL_CHUNKS, BatchPacer
from lmtier.storage.tier import Buffer, TierProperties
from lmtier.storage.writes import PUTS_IN_FLIGHT
from lmtier.testing import DictTier, make_chunk

SLAB = 16 * 1024
MARK = 0x5A


class GatedTier(DictTier):
    """A tier whose reads and writes happen in a worker thread that waits for ``gate``:
    a slow device, whose I/O goes on after the StorageManager has given up on it. It
    keeps the tier contract (lmtier.storage.blocking): a call ends when its thread is done."""

    def __init__(self, name: str) -> None:
        super().__init__(name, TierProperties(shared=True, timeout_s=0.05))
        self.gate = threading.Event()
        self.threads = ThreadPoolExecutor(4)

    async def _read_into(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        def copy(key: ChunkKey, buffer: memoryview) -> int:
            self.gate.wait()
            data = self.data[key]
            buffer[: len(data)] = data
            return len(data)

        calls = [(copy, pair) for pair in zip(keys, buffers, strict=True)]
        return await run_blocking(self.threads, calls)

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> int:
        def copy(key: ChunkKey, data: Buffer) -> None:
            self.gate.wait()
            self.data[key] = bytes(data)

        await run_blocking(self.threads, [(copy, item) for item in items])
        return len(items)


def run(body: Callable[[StorageManager, GatedTier], Awaitable[None]], slabs: int = 8) -> None:
    async def case() -> None:
        pool = HostPool(SLAB, slabs)
        tier = GatedTier("slow")
        manager = StorageManager(CPUTier(pool, 0), [tier])
        await manager.start()
        try:
            await body(manager, tier)
        finally:
            tier.gate.set()
            await manager.close()
            tier.threads.shutdown()
        assert pool.num_in_use == 0, "slabs leaked"
        pool.close()

    asyncio.run(case())


def test_a_timed_out_read_never_writes_into_a_reused_slab() -> None:
    async def body(manager: StorageManager, tier: GatedTier) -> None:
        key, data = make_chunk(num_tokens=4, hidden=16, seed=1)
        tier.data[key] = data
        assert await manager.get([key]) == []  # timed out: the read is still pending
        assert tier.stats.errors == 1
        # Every slab the pool will give out now is marked; none may be the one the
        # pending read was given.
        handles = []
        while (handle := manager.cpu_tier.acquire_slab()) is not None:
            handle.view[:] = bytes([MARK]) * len(handle.view)
            handles.append(handle)
        assert len(handles) == manager.cpu_tier.pool.num_slabs - 1  # one in quarantine
        tier.gate.set()
        await asyncio.sleep(0)
        while manager.guards["slow"].abandoned:
            await asyncio.sleep(0.01)
        for handle in handles:
            assert set(handle.view) == {MARK}, "a late read landed in a reused slab"
            handle.release()
        assert manager.cpu_tier.pool.num_free == manager.cpu_tier.pool.num_slabs

    run(body)


def test_a_timed_out_write_keeps_its_slab_until_the_write_is_done() -> None:
    async def body(manager: StorageManager, tier: GatedTier) -> None:
        written = [make_chunk(num_tokens=4, hidden=16, seed=seed) for seed in (2, 3)]
        for key, data in written:  # two batches, each timing out in turn
            handle = manager.cpu_tier.acquire_slab()
            assert handle is not None
            handle.view[: len(data)] = data
            manager.put(key, handle, len(data))
            await manager.flush()  # the write timed out; its thread waits at the gate
        assert tier.stats.errors == 2
        await manager.cpu_tier.delete([key for key, _ in written])
        # Reuse every free slab with other bytes: the pending writes' slabs are not free.
        others = []
        while (other := manager.cpu_tier.acquire_slab()) is not None:
            other.view[:] = bytes([MARK]) * len(other.view)
            others.append(other)
        assert len(others) == manager.cpu_tier.pool.num_slabs - 2
        tier.gate.set()
        while manager.guards["slow"].abandoned:
            await asyncio.sleep(0.01)
        for key, data in written:
            assert tier.data[key] == data  # each late write stored the chunk it was given
        for other in others:
            other.release()
        # Each write gave back its own slab once it settled (and only its own).
        assert manager.cpu_tier.pool.num_free == manager.cpu_tier.pool.num_slabs

    run(body)


def test_load_is_cancelled_by_its_caller_and_slabs_wait_for_the_io() -> None:
    async def body(manager: StorageManager, tier: GatedTier) -> None:
        tier.properties = TierProperties(shared=True, timeout_s=60)
        manager.guards["slow"].timeout_s = 60
        key, data = make_chunk(num_tokens=4, hidden=16, seed=3)
        tier.data[key] = data
        task = asyncio.ensure_future(manager.get([key]))
        await asyncio.sleep(0.05)
        task.cancel()  # what Runtime.run does when its caller times out
        with pytest.raises(asyncio.CancelledError):
            await task
        assert manager.cpu_tier.pool.num_in_use == 1  # the read's slab, in quarantine
        tier.gate.set()
        while manager.guards["slow"].abandoned:
            await asyncio.sleep(0.01)
        assert manager.cpu_tier.pool.num_in_use == 0

    run(body)


def test_chunks_of_another_key_or_geometry_are_never_served() -> None:
    good_key, good = make_chunk(num_tokens=4, hidden=16, seed=4)
    other_key, other = make_chunk(num_tokens=4, hidden=16, seed=5)
    wide_key, wide = make_chunk(num_tokens=4, hidden=32, seed=6)

    async def case() -> None:
        pool = HostPool(SLAB, 8)
        remote = DictTier("remote", TierProperties(shared=True))
        remote.data.update({good_key: good, other_key: good, wide_key: wide})
        check = ChunkCheck(ChunkGeometry("float32", "LKTHD", (1, 2, 4, 1, 16)))
        manager = StorageManager(CPUTier(pool, 4 * pool.slab_bytes), [remote], check=check)
        await manager.start()
        (loaded,) = await manager.get([good_key])
        assert loaded.key == good_key
        loaded.release()
        # other_key holds good's bytes (its header names good_key); wide_key another shape.
        for key in (other_key, wide_key):
            assert await manager.get([key]) == []
            assert key not in remote.data  # deleted
        assert remote.stats.corrupt == 2
        # The CPU tier is checked as well: a slab changed behind its back is caught.
        handle = manager.cpu_tier.share(good_key)
        assert handle is not None
        handle[0].view[: len(other)] = other
        handle[0].release()
        # A load without a lookup goes on to the next tier: the remote copy is served.
        (again,) = await manager.get([good_key])
        assert (again.tier, manager.cpu_tier.stats.corrupt) == ("remote", 1)
        again.release()
        await manager.close()
        assert pool.num_in_use == 0
        pool.close()

    asyncio.run(case())


def test_store_lookups_never_ask_a_remote_tier() -> None:
    async def case() -> None:
        pool = HostPool(SLAB, 8)
        hung = DictTier("remote", TierProperties(shared=True))
        hung.hang = True
        manager = StorageManager(CPUTier(pool, 4 * pool.slab_bytes), [hung])
        key, data = make_chunk(num_tokens=4, hidden=16)
        await manager.cpu_tier.put([(key, data)])
        found = manager.lookup_local([key, *(make_chunk()[0] for _ in range(3))])
        assert found.num_chunks == 1
        assert "contains" not in hung.calls
        await manager.cpu_tier.close()
        pool.close()

    asyncio.run(case())


def test_pacer_starts_small_follows_the_rate_and_halves_on_a_timeout() -> None:
    pacer = BatchPacer(1.0)  # a fixed timeout per call
    assert pacer.size(1 << 20, 500) == INITIAL_CHUNKS
    pacer.succeeded(4 << 20, 0.05, 4)  # 80 MiB/s: 40 MiB fit in half the timeout
    assert pacer.size(1 << 20, 500) == 40
    pacer.timed_out(40 << 20, 40)  # slower than 40 MiB/s after all
    assert pacer.size(1 << 20, 500) == 20
    assert pacer.size(1 << 20, 3) == 3
    pacer.succeeded(20 << 20, 0.5, 20)  # 40 MiB/s measured
    assert pacer.size(1 << 20, 500) == 20
    slow = BatchPacer(0.5)
    slow.succeeded(1_600_000, 1.0, 4)  # 1.6 MB/s: a batch should take 0.25 s
    assert slow.size(100_000, 500) == 4  # 400 kB per 0.25 s
    assert slow.size(10_000_000, 500) == 1  # one chunk is the least


def test_close_waits_for_queued_writes_only_as_long_as_it_is_told(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # close_flush_s (the facade's) bounds the wait: at exit a hung tier must not hold
    # the process. What is still queued then is dropped, counted, and said once.
    async def body(manager: StorageManager, tier: GatedTier) -> None:
        for seed in range(20):  # more than a first batch (INITIAL_CHUNKS): some stay queued
            key, data = make_chunk(num_tokens=4, hidden=16, seed=10 + seed)
            handle = manager.cpu_tier.acquire_slab()
            assert handle is not None
            handle.view[: len(data)] = data
            assert manager.put(key, handle, len(data))
        with caplog.at_level("WARNING", logger="lmtier.storage.writes"):
            await manager.close(flush_s=0.0)
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "not done after 0 s (close_flush_s)" in warnings[0]
        dropped = int(warnings[0].split("): ")[1].split()[0])
        # At most PUTS_IN_FLIGHT first batches were being sent; the rest is dropped.
        sent = PUTS_IN_FLIGHT * INITIAL_CHUNKS
        assert dropped >= 20 - sent and tier.stats.queue_drops == dropped
        tier.gate.set()  # the batch being sent gives its slabs back once its I/O ends
        while manager.guards["slow"].abandoned:
            await asyncio.sleep(0.01)

    run(body, slabs=64)
