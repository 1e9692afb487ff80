"""Purging a namespace through the StorageManager: every tier, CPU first; failing, hung
and unsupported tiers reported, never raised; writes, stores and promotions of the
namespace kept from bringing its chunks back; slabs held by readers freed only when
they let go. The tiers' own purges are in the conformance suite."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Sequence

import pytest

from lmtier.chunks.keys import ChunkKey
from lmtier.errors import BackendUnavailable, CacheClosedError, InvalidRequestError
from lmtier.storage.barriers import PurgeBarriers
from lmtier.storage.breaker import BreakerState, CircuitBreaker
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.host_pool import HostPool
from lmtier.storage.manager import PURGE_FAILED, PURGE_UNSUPPORTED, StorageManager
from lmtier.storage.reopening_tier import ReopeningTier
from lmtier.storage.tier import Buffer, Tier, TierProperties
from lmtier.testing import DictTier, make_chunk, random_key

SLAB = 16 * 1024
NS_A = b"namespace-aaaaa!"
NS_B = b"namespace-bbbbb!"


def chunks(namespace: bytes, n: int) -> list[tuple[ChunkKey, bytes]]:
    return [make_chunk(random_key(namespace), num_tokens=4, hidden=16, seed=i) for i in range(n)]


class GatedTier(DictTier):
    """A DictTier whose puts and purges wait for their gate (an asyncio.Event) while it
    is closed: a write or a purge in flight for as long as a test needs."""

    def __init__(self, name: str) -> None:
        super().__init__(name, TierProperties(shared=True))
        self.put_gate = asyncio.Event()
        self.put_gate.set()
        self.purge_gate = asyncio.Event()
        self.purge_gate.set()
        self.purging = asyncio.Event()
        """Set once a purge has started (and waits for ``purge_gate``)."""

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> int:
        await self.put_gate.wait()
        return await super().put(items)

    async def _purge(self, namespace: bytes) -> int:
        self.purging.set()
        await self.purge_gate.wait()
        return await super()._purge(namespace)


class CannotList(DictTier):
    """A tier that keeps the default purge: it cannot list its chunks."""

    _purge = Tier._purge


Body = Callable[[StorageManager, DictTier, GatedTier], Awaitable[None]]


def run(body: Body, *, extra: Sequence[Tier] = (), **options: object) -> None:
    async def case() -> None:
        pool = HostPool(SLAB, 48)
        cpu_tier = CPUTier(pool, 32 * pool.slab_bytes)
        disk, remote = DictTier("disk"), GatedTier("remote")
        manager = StorageManager(cpu_tier, [disk, remote, *extra], **options)  # type: ignore[arg-type]
        await manager.start()
        try:
            await body(manager, disk, remote)
        finally:
            remote.put_gate.set()
            remote.purge_gate.set()
            await manager.close()
        assert pool.num_in_use == 0, "slabs leaked"
        pool.close()

    asyncio.run(case())


def put_all(manager: StorageManager, items: list[tuple[ChunkKey, bytes]]) -> list[bool]:
    """``manager.put`` each chunk, as a store does; whether each was taken."""
    taken = []
    for key, data in items:
        (handle,) = manager.acquire_slabs(1)
        handle.view[: len(data)] = data
        taken.append(manager.put(key, handle, len(data)))
    return taken


def keys_of(items: list[tuple[ChunkKey, bytes]]) -> list[ChunkKey]:
    return [key for key, _ in items]


def test_every_tier_loses_the_namespace_and_keeps_the_others() -> None:
    async def body(manager: StorageManager, disk: DictTier, remote: GatedTier) -> None:
        doomed, kept = chunks(NS_A, 4), chunks(NS_B, 3)
        put_all(manager, doomed + kept)
        await manager.flush()
        assert await manager.purge(NS_A) == {"cpu": 4, "disk": 4, "remote": 4}
        assert (await manager.lookup(keys_of(doomed))).num_chunks == 0
        assert await manager.get(keys_of(doomed)) == []
        assert set(disk.data) == set(remote.data) == set(keys_of(kept))
        assert (await manager.lookup(keys_of(kept))).num_chunks == 3
        stats = manager.stats()
        assert [stats[name]["purged"] for name in ("cpu", "disk", "remote")] == [4, 4, 4]
        assert await manager.purge(NS_A) == {"cpu": 0, "disk": 0, "remote": 0}

    run(body)


def test_the_namespace_must_be_16_bytes() -> None:
    async def body(manager: StorageManager, disk: DictTier, remote: GatedTier) -> None:
        for bad in (b"", NS_A[:15], NS_A + b"!", NS_A.hex(), 16, None):
            with pytest.raises(InvalidRequestError, match="16-byte"):
                await manager.purge(bad)  # type: ignore[arg-type]
        assert disk.calls.get("purge") is None
        assert await manager.purge(bytearray(NS_A)) == {"cpu": 0, "disk": 0, "remote": 0}

    run(body)


def test_a_failing_tier_is_reported_and_the_others_still_purge() -> None:
    async def body(manager: StorageManager, disk: DictTier, remote: GatedTier) -> None:
        put_all(manager, chunks(NS_A, 2))
        await manager.flush()
        disk.fail = True
        assert await manager.purge(NS_A) == {"cpu": 2, "disk": PURGE_FAILED, "remote": 2}
        assert disk.stats.errors == 1 and manager.breakers["disk"].failures == 1

    run(body)


def test_a_hung_tier_times_out_into_a_failure() -> None:
    async def body(manager: StorageManager, disk: DictTier, remote: GatedTier) -> None:
        remote.hang = True
        started = asyncio.get_running_loop().time()
        assert (await manager.purge(NS_A))["remote"] == PURGE_FAILED
        assert asyncio.get_running_loop().time() - started < 2.0

    run(body, purge_timeout_s=0.1)


def test_an_open_breaker_skips_the_tier() -> None:
    async def body(manager: StorageManager, disk: DictTier, remote: GatedTier) -> None:
        disk.data.update(chunks(NS_A, 2))
        breaker = manager.breakers["disk"]
        breaker.record_failure()
        assert breaker.state is BreakerState.OPEN
        assert (await manager.purge(NS_A))["disk"] == PURGE_FAILED
        assert disk.stats.skipped == 1 and len(disk.data) == 2

    run(body, breaker_factory=lambda: CircuitBreaker(failure_threshold=1, reset_after_s=20))


def test_a_tier_that_cannot_list_is_skipped_and_reported() -> None:
    lister = CannotList("plain")

    async def body(manager: StorageManager, disk: DictTier, remote: GatedTier) -> None:
        put_all(manager, chunks(NS_A, 2))
        await manager.flush()
        purged = await manager.purge(NS_A)
        assert purged == {"cpu": 2, "disk": 2, "remote": 2, "plain": PURGE_UNSUPPORTED}
        assert len(lister.data) == 2  # nothing was deleted
        assert lister.stats.errors == 0 and manager.breakers["plain"].failures == 0

    run(body, extra=[lister])


def test_writes_queued_or_in_flight_do_not_bring_chunks_back() -> None:
    async def body(manager: StorageManager, disk: DictTier, remote: GatedTier) -> None:
        first, later, other = chunks(NS_A, 1), chunks(NS_A, 3), chunks(NS_B, 2)
        remote.put_gate.clear()
        put_all(manager, first)
        await asyncio.sleep(0.01)  # the remote's writer sends `first` and waits at the gate
        assert put_all(manager, later + other) == [True] * 5  # queued behind it
        await asyncio.sleep(0.01)  # the disk's writer has written them all
        purge = asyncio.create_task(manager.purge(NS_A))
        await asyncio.sleep(0.01)
        assert not purge.done()  # waits for the write in flight to the remote
        remote.put_gate.set()
        purged = await purge
        # 1: `later` was still queued (dropped as stale); 4: it was sent too, as the
        # second of PUTS_IN_FLIGHT batches, and the purge waited for it as well.
        assert purged["cpu"] == purged["disk"] == 4 and purged["remote"] in (1, 4)
        await manager.flush()
        assert set(disk.data) == set(remote.data) == set(keys_of(other))

    run(body)


def test_stores_and_promotions_during_a_purge_are_refused() -> None:
    async def body(manager: StorageManager, disk: DictTier, remote: GatedTier) -> None:
        below = chunks(NS_A, 1)
        remote.data.update(below)
        remote.purge_gate.clear()
        purge = asyncio.create_task(manager.purge(NS_A))
        await remote.purging.wait()
        assert put_all(manager, chunks(NS_A, 2)) == [False, False]
        assert put_all(manager, chunks(NS_B, 1)) == [True]
        (served,) = await manager.get(keys_of(below))  # served, but not cached again
        served.release()
        assert manager.cpu_tier.count_prefix(keys_of(below)) == 0
        remote.purge_gate.set()
        assert await purge == {"cpu": 0, "disk": 0, "remote": 1}
        await manager.flush()
        assert [key[:16] for key in disk.data] == [NS_B]
        assert put_all(manager, chunks(NS_A, 1)) == [True]  # after it: a new chunk

    run(body)


def test_a_reader_keeps_its_slab_until_it_lets_go() -> None:
    async def body(manager: StorageManager, disk: DictTier, remote: GatedTier) -> None:
        items = chunks(NS_A, 2)
        put_all(manager, items)
        await manager.flush()
        loaded = await manager.get(keys_of(items))
        in_use = manager.cpu_tier.pool.num_in_use
        told: list[ChunkKey] = []
        manager.add_evict_listener(told.append)
        assert (await manager.purge(NS_A))["cpu"] == 2
        assert told == keys_of(items)  # announced like evictions
        assert manager.cpu_tier.count_prefix(keys_of(items)) == 0
        assert manager.cpu_tier.pool.num_in_use == in_use  # the readers' slabs stay
        for chunk, (_, data) in zip(loaded, items, strict=True):
            assert bytes(chunk.handle.view[: len(data)]) == data
            chunk.release()
        assert manager.cpu_tier.pool.num_in_use == 0

    run(body)


def test_a_closed_manager_refuses_to_purge() -> None:
    async def body(manager: StorageManager, disk: DictTier, remote: GatedTier) -> None:
        await manager.close()
        with pytest.raises(CacheClosedError):
            await manager.purge(NS_A)

    run(body)


def test_barriers_make_what_began_before_a_purge_stale() -> None:
    barriers = PurgeBarriers()
    key, other = random_key(NS_A), random_key(NS_B)
    before = barriers.epoch
    assert not barriers.stale(key, before) and not barriers.purging(key)
    barriers.begin(NS_A)
    during = barriers.epoch
    assert barriers.purging(key) and not barriers.purging(other)
    assert barriers.stale(key, before) and barriers.stale(key, during)
    barriers.begin(NS_A)  # a second purge of it overlaps the first
    barriers.end(NS_A)
    assert barriers.purging(key)
    barriers.end(NS_A)
    after = barriers.epoch
    assert not barriers.purging(key)
    assert barriers.stale(key, before) and not barriers.stale(key, after)
    assert not barriers.stale(other, before)


def test_a_reopening_tier_purges_once_its_tier_is_open() -> None:
    real = DictTier("redis")
    real.data.update(chunks(NS_A, 2) + chunks(NS_B, 1))
    down = True

    async def opener() -> Tier:
        if down:
            raise BackendUnavailable("connection refused")
        return real

    async def case() -> None:
        nonlocal down
        tier = ReopeningTier("redis", opener, retry_after_s=0.0)
        with pytest.raises(BackendUnavailable):
            await tier.purge(NS_A)
        down = False
        assert await tier.purge(NS_A) == 2
        assert tier.stats.purged == 2 and len(real.data) == 1
        await tier.close()

    asyncio.run(case())


def test_an_unknown_namespace_deletes_nothing() -> None:
    async def body(manager: StorageManager, disk: DictTier, remote: GatedTier) -> None:
        put_all(manager, chunks(NS_B, 2))
        await manager.flush()
        assert await manager.purge(os.urandom(16)) == {"cpu": 0, "disk": 0, "remote": 0}
        assert len(disk.data) == len(remote.data) == 2

    run(body)
