"""Back-pressure on stores (lmtier.storage.room): a store that finds a write queue
full, or every slab held by pending writes, waits while writes keep landing and loses
nothing; it gives up after ``write_wait_s`` with none landing, never waits for a tier
that is down, and never blocks the event loop.

Stores run in this test's thread, the manager on a Runtime's loop thread, as in
``LMTier``. No test here asserts a duration: a store that must wait is seen waiting
(``room.waiting``) before the tier is let go; one that must give up does so against
a tier that never moves.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from lmtier.chunks.keys import ChunkKey
from lmtier.runtime import Runtime
from lmtier.storage.breaker import BreakerState
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.host_pool import HostPool, SlabHandle
from lmtier.storage.manager import StorageManager
from lmtier.storage.tier import Buffer, TierProperties
from lmtier.testing import DictTier, make_chunk

SLAB = 16 * 1024
NEVER_S = 60.0
"""Longer than any wait here may take; reaching it means something hung."""
MANY = 40
"""More chunks than a queue of 2 and a stuck writer can take (2 batches of at most 4
being written, one sealed and waiting, 2 queued): some must wait, or be dropped."""


class SlowTier(DictTier):
    """A healthy tier slower than the stores: each write waits for ``gate``."""

    def __init__(self, depth: int) -> None:
        super().__init__("slow", TierProperties(shared=True, queue_depth=depth, timeout_s=NEVER_S))
        self.gate = threading.Event()

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> int:
        import asyncio

        while not self.gate.is_set():
            await asyncio.sleep(0.005)
        return await super().put(items)


@contextmanager
def manager_of(
    tier: SlowTier, *, slabs: int = 64, cached: int = 16, write_wait_s: float = NEVER_S
) -> Iterator[tuple[StorageManager, Runtime]]:
    runtime = Runtime("test-backpressure").start()
    pool = HostPool(SLAB, slabs)
    manager = StorageManager(CPUTier(pool, cached), [tier], write_wait_s=write_wait_s)
    runtime.run(manager.start())
    try:
        yield manager, runtime
    finally:
        tier.gate.set()
        runtime.run(manager.close(), timeout=NEVER_S)
        runtime.stop()
        assert pool.num_in_use == 0, "slabs leaked"
        pool.close()


def encoded(
    manager: StorageManager, count: int, seed: int = 0
) -> list[tuple[ChunkKey, SlabHandle, int]]:
    out = []
    for i in range(count):
        key, data = make_chunk(num_tokens=4, hidden=16, seed=seed + i)
        (handle,) = manager.acquire_slabs(1)
        handle.view[: len(data)] = data
        out.append((key, handle, len(data)))
    return out


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    return thread, result


def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + NEVER_S
    while not condition():
        assert time.monotonic() < deadline, "hung"
        time.sleep(0.005)


def test_a_store_waits_for_a_slow_tier_and_loses_nothing() -> None:
    tier = SlowTier(depth=2)
    with manager_of(tier) as (manager, runtime):
        chunks = encoded(manager, MANY)
        thread, result = in_thread(lambda: manager.put_many(chunks, wait=True))
        until(lambda: manager.writes.room.waiting > 0)  # the queue is full: it waits
        assert thread.is_alive()
        tier.gate.set()
        thread.join(NEVER_S)
        assert result == [MANY]
        runtime.run(manager.flush())
        assert len(tier.data) == MANY and tier.stats.queue_drops == 0
        assert tier.stats.queue_waits >= 1  # counted: the back-pressure is visible


def test_a_store_without_wait_drops_and_counts_as_before() -> None:
    tier = SlowTier(depth=2)
    with manager_of(tier) as (manager, _):
        stored = manager.put_many(encoded(manager, MANY))
        assert stored < MANY and tier.stats.queue_drops == MANY - stored


def test_a_stalled_tier_costs_a_store_write_wait_s_then_drops_counted() -> None:
    tier = SlowTier(depth=2)  # its gate never opens while the store runs
    with manager_of(tier, write_wait_s=0.2) as (manager, _):
        stored = manager.put_many(encoded(manager, MANY), wait=True)
        assert stored < MANY and tier.stats.queue_drops == MANY - stored
        # Until a write lands, the next store gives up at once: a stalled tier costs
        # write_wait_s once, not once per store (a wait now would hang this test).
        manager.write_wait_s = NEVER_S
        drops = tier.stats.queue_drops
        assert manager.put_many(encoded(manager, 4, seed=100), wait=True) == 0
        assert tier.stats.queue_drops == drops + 4


def test_a_tier_that_is_down_is_never_waited_for() -> None:
    tier = SlowTier(depth=2)
    with manager_of(tier) as (manager, runtime):
        assert manager.put_many(encoded(manager, MANY)) < MANY  # the queue is full now
        breaker = manager.breakers["slow"]
        runtime.call(lambda: [breaker.record_failure() for _ in range(breaker.failure_threshold)])
        assert breaker.state is BreakerState.OPEN
        drops = tier.stats.queue_drops
        # write_wait_s is NEVER_S: a wait would hang this test.
        stored = manager.put_many(encoded(manager, MANY, seed=100), wait=True)
        assert stored + tier.stats.queue_drops - drops == MANY
        assert manager.writes.room.waiting == 0 and tier.stats.queue_waits == 0


def test_the_event_loop_never_waits() -> None:
    tier = SlowTier(depth=2)
    with manager_of(tier) as (manager, runtime):
        chunks = encoded(manager, MANY)
        stored = runtime.call(lambda: manager.put_many(chunks, wait=True))
        # The writer runs on the loop too: nothing left the queue meanwhile.
        assert stored == 2 and tier.stats.queue_drops == MANY - 2


def test_a_pool_held_by_pending_writes_is_waited_for() -> None:
    # No CPU tier (capacity 0): every slab a store fills stays held by its write.
    tier = SlowTier(depth=64)
    with manager_of(tier, slabs=6, cached=0) as (manager, _):
        assert manager.put_many(encoded(manager, 4), wait=True) == 4
        thread, result = in_thread(lambda: manager.acquire_slabs(4, True, wait=True))
        until(lambda: manager.writes.room.waiting > 0)  # 2 free, then it waits
        tier.gate.set()
        thread.join(NEVER_S)
        (handles,) = result
        assert isinstance(handles, list) and len(handles) == 4
        assert manager.cpu_tier.stats.queue_drops == 0
        assert manager.cpu_tier.stats.queue_waits == 1
        for handle in handles:
            handle.release()


def test_a_sidecar_store_waits_on_the_loop_without_blocking_it() -> None:
    tier = SlowTier(depth=2)
    with manager_of(tier) as (manager, runtime):
        assert manager.put_many(encoded(manager, MANY)) < MANY  # the queue fills

        future = runtime.submit(manager.room_for_store())
        # It waits, unless the writer took the queue's writes first (then room is free).
        until(lambda: manager.writes.room.waiting > 0 or future.done())
        assert runtime.call(lambda: 7) == 7  # the loop still runs meanwhile
        tier.gate.set()
        assert future.result(NEVER_S) is True


def test_write_wait_s_0_never_waits() -> None:
    tier = SlowTier(depth=2)
    with manager_of(tier, write_wait_s=0.0) as (manager, _):
        stored = manager.put_many(encoded(manager, MANY), wait=True)
        assert stored < MANY and tier.stats.queue_drops == MANY - stored
        assert tier.stats.queue_waits == 0
