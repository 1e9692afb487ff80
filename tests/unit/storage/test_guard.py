"""Deadlines of tier calls: budgets that grow with the bytes and keys a call carries,
stall detection from a tier's I/O progress, and pacers consistent with both.

No test here asserts a duration. A call that must survive runs several times longer
than ``timeout_s`` while ticking its meter more often than the guard looks (the
guard's checks and the ticks are timers on one event loop, run in the order they
fall due), under a deadline far longer than the test; a call that must be given up
on never finishes at all.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Sequence

import pytest

from lmtier.chunks.keys import ChunkKey
from lmtier.config import RedisTierConfig, S3TierConfig
from lmtier.storage.breaker import CircuitBreaker
from lmtier.storage.budget import CallBudget, Progress
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.guard import TierGuard
from lmtier.storage.host_pool import HostPool
from lmtier.storage.manager import StorageManager
from lmtier.storage.pacing import TARGET_FRACTION, BatchPacer
from lmtier.storage.reopening_tier import ReopeningTier
from lmtier.storage.tier import Buffer, Tier, TierProperties
from lmtier.testing import DictTier, FakeClock, make_chunk

STALL_S = 0.05
"""``timeout_s`` of the tiers below: how long a call may go without progress."""
NEVER_S = 60.0
"""A bound no test should come near; reaching it means a call was waited on forever."""
HUGE = 10**12
"""Bytes that give a call a deadline of hours at any floor rate used here."""


class MeteredTier(DictTier):
    """A tier that declares a budget and reports progress. ``busy_steps`` > 0: every
    call first moves bytes for that many ticks, one every ``STALL_S / 10``; ``stalled``:
    every call then waits forever without a tick (a hung server)."""

    def __init__(self, budget: CallBudget, *, metered: bool = True) -> None:
        super().__init__("metered", TierProperties(shared=True, timeout_s=budget.timeout_s))
        self.budget = budget
        if metered:
            self.io_progress = Progress()
        self.busy_steps = 0
        self.stalled = False

    async def _work(self) -> None:
        meter = getattr(self, "io_progress", None)
        for _ in range(self.busy_steps):
            if meter is not None:
                meter.tick()
            await asyncio.sleep(STALL_S / 10)
        if self.stalled:
            await asyncio.Event().wait()

    async def contains(self, keys: Sequence[ChunkKey]) -> int:
        await self._work()
        return await super().contains(keys)

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> int:
        await self._work()
        return await super().put(items)


def guarded(tier: DictTier) -> TierGuard:
    return TierGuard(tier, tier.properties.timeout_s or 1.0, CircuitBreaker())


def run(awaitable: Awaitable[tuple[object, bool]]) -> tuple[object, bool]:
    async def bounded() -> tuple[object, bool]:
        return await asyncio.wait_for(awaitable, NEVER_S)

    return asyncio.run(bounded())


def test_budget_grows_with_bytes_and_keys() -> None:
    budget = CallBudget(0.5, min_bytes_per_s=64 * 2**20, per_key_s=0.01)
    assert budget.seconds() == 0.5
    assert budget.seconds(num_bytes=512 * 2 * 2**20) == pytest.approx(0.5 + 16)
    assert budget.seconds(num_keys=512) == pytest.approx(0.5 + 5.12)
    assert CallBudget(2.0).seconds(num_bytes=HUGE, num_keys=HUGE) == 2.0  # declares nothing
    for bad in ({"timeout_s": 0}, {"timeout_s": 1, "min_bytes_per_s": 0}):
        with pytest.raises(ValueError, match="must be > 0"):
            CallBudget(**bad)
    with pytest.raises(ValueError, match="per_key_s"):
        CallBudget(1.0, per_key_s=-1)


def test_guard_takes_the_tiers_budget_and_meter_or_a_fixed_timeout() -> None:
    tier = MeteredTier(CallBudget(0.5, 1e6))
    guard = guarded(tier)
    assert guard.budget is tier.budget and guard.progress is tier.io_progress
    plain = TierGuard(DictTier("plain"), 3.0, CircuitBreaker())
    assert plain.budget == CallBudget(3.0) and plain.progress is None
    plain.timeout_s = 60  # what tests of slow calls do
    assert plain.budget.timeout_s == 60


def test_a_call_moving_bytes_outlives_timeout_s_within_its_byte_deadline() -> None:
    # Ten times timeout_s of steady progress: a large batch on a busy machine.
    tier = MeteredTier(CallBudget(STALL_S, min_bytes_per_s=1.0))
    tier.busy_steps = 100
    key, data = make_chunk()
    stored, timed_out = run(
        guarded(tier).call("put", lambda: tier.put([(key, data)]), num_bytes=HUGE)
    )
    assert (stored, timed_out) == (1, False)
    assert tier.stats.errors == 0


def test_a_hung_call_is_given_up_after_timeout_s_whatever_its_deadline() -> None:
    tier = MeteredTier(CallBudget(STALL_S, min_bytes_per_s=1.0))
    tier.busy_steps, tier.stalled = 3, True  # some bytes move, then the server stops
    guard = guarded(tier)
    key, data = make_chunk()
    stored, timed_out = run(guard.call("put", lambda: tier.put([(key, data)]), num_bytes=HUGE))
    assert (stored, timed_out) == (None, True)  # long before its deadline of hours
    assert tier.stats.errors == 1 and guard.breaker.failures == 1


class LateTier(MeteredTier):
    """A live server whose reply the process cannot read in time: while a call waits,
    something else holds the event loop (a starved process, a long stretch of other
    work) for many times ``timeout_s``; the reply, due during that stretch, is read
    after it, in the order timers fall due: after the guard's look at the call."""

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[None] = loop.create_future()
        loop.call_soon(time.sleep, STALL_S * 8)  # the loop cannot run meanwhile
        loop.call_later(STALL_S * 2, reply.set_result, None)
        await reply
        self.io_progress.tick()


def test_time_the_loop_could_not_run_does_not_count_against_a_call() -> None:
    # Before: the guard's stall check woke up late, saw no tick since it began waiting
    # and gave up on a server that had answered; and the deadline alone (no meter)
    # also lapsed while nothing could be read.
    key, data = make_chunk()
    for metered in (True, False):
        tier = LateTier(CallBudget(STALL_S, min_bytes_per_s=1.0))
        guard = guarded(tier)
        if not metered:
            guard.progress = None  # the deadline alone: timeout_s, given no bytes
        put = functools.partial(tier.put, [(key, data)])
        assert run(guard.call("put", put)) == (1, False), metered
        assert tier.stats.errors == 0


def test_without_a_meter_the_deadline_alone_bounds_a_call() -> None:
    tier = MeteredTier(CallBudget(STALL_S, min_bytes_per_s=1.0), metered=False)
    tier.busy_steps = 100
    guard = guarded(tier)
    key, data = make_chunk()
    assert run(guard.call("put", lambda: tier.put([(key, data)]), num_bytes=HUGE)) == (1, False)
    # The same call given no bytes gets timeout_s only.
    stored, timed_out = run(guard.call("put", lambda: tier.put([(key, data)])))
    assert (stored, timed_out) == (None, True)


def test_a_lookup_gets_time_per_key() -> None:
    tier = MeteredTier(CallBudget(STALL_S, per_key_s=1.0), metered=False)
    tier.busy_steps = 100
    keys = [make_chunk(seed=i)[0] for i in range(3)]
    tier.data.update(dict.fromkeys(keys, b""))
    guard = guarded(tier)
    assert run(guard.call("contains", lambda: tier.contains(keys), num_keys=3600)) == (3, False)
    assert run(guard.call("contains", lambda: tier.contains(keys))) == (None, True)


def test_pacer_plans_within_the_deadline_and_a_timeout_proves_a_rate() -> None:
    budget = CallBudget(0.5, min_bytes_per_s=64e6)
    pacer = BatchPacer(budget)
    chunk = 2 << 20
    pacer.succeeded(chunk, 0.001, 1)  # past the first, probing batch
    for rate in (1e5, 1e7, 1e9, 1e11):
        pacer.rate = rate
        count = pacer.size(chunk, 512)
        planned_s = count * chunk / rate
        if count > 1:  # one chunk is the least, however slow the tier
            assert planned_s <= TARGET_FRACTION * budget.seconds(num_bytes=count * chunk)
    pacer.rate = 1e9
    pacer.timed_out(200 * chunk, 200)
    # It moved less than 200 chunks within its deadline, which grew with them.
    assert pacer.rate == pytest.approx(200 * chunk / budget.seconds(num_bytes=200 * chunk))
    assert pacer.size(chunk, 512) <= 100
    assert BatchPacer(0.5).budget == CallBudget(0.5)


def test_background_writes_give_a_batch_its_byte_deadline() -> None:
    async def case() -> None:
        pool = HostPool(16 * 1024, 8)
        tier = MeteredTier(CallBudget(STALL_S, min_bytes_per_s=1.0))
        tier.busy_steps = 100  # every write batch outlasts timeout_s tenfold
        manager = StorageManager(CPUTier(pool, 4 * pool.slab_bytes), [tier])
        await manager.start()
        try:
            for seed in range(3):
                key, data = make_chunk(num_tokens=4, hidden=16, seed=seed)
                handle = manager.cpu_tier.acquire_slab()
                assert handle is not None
                handle.view[: len(data)] = data
                manager.put(key, handle, len(data))
            await asyncio.wait_for(manager.flush(), NEVER_S)
            assert (tier.stats.puts, tier.stats.errors) == (3, 0)
        finally:
            await manager.close()
        pool.close()

    asyncio.run(case())


def test_config_knobs_of_the_remote_tiers() -> None:
    redis, s3 = RedisTierConfig(), S3TierConfig()
    assert (redis.timeout_s, redis.min_bytes_per_s, redis.lookup_key_s) == (0.5, 64 << 20, 1e-4)
    assert (s3.timeout_s, s3.min_bytes_per_s, s3.lookup_key_s) == (2.0, 16 << 20, 0.01)
    assert RedisTierConfig(min_bytes_per_s="32MiB").min_bytes_per_s == 32 << 20
    assert S3TierConfig(min_bytes_per_s=0).min_bytes_per_s == 0  # bytes add nothing


def test_a_stand_in_for_a_remote_tier_down_at_start_keeps_its_budget_and_meter() -> None:
    real = MeteredTier(CallBudget(0.5, 1.0))  # its own budget and meter, replaced below
    section = RedisTierConfig(timeout_s=0.25, min_bytes_per_s=1000, lookup_key_s=0.5)

    async def opener() -> Tier:
        return real

    async def case() -> None:
        stand_in = ReopeningTier("redis", opener, section, retry_after_s=1.0, clock=clock)
        guard = guarded(stand_in)
        assert guard.budget == CallBudget(0.25, 1000.0, 0.5)  # from the config section
        assert guard.progress is stand_in.io_progress
        clock.now = 5.0  # past the backoff: the next call opens the real tier
        assert await stand_in.contains([make_chunk()[0]]) == 0
        assert real.io_progress is stand_in.io_progress  # the meter the guard watches
        await stand_in.close()

    clock = FakeClock()
    asyncio.run(case())
