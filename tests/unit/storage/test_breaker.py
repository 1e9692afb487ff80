"""Circuit breaker: opens after consecutive failures, probes back with backoff."""

from __future__ import annotations

import asyncio

import pytest

from lmtier.storage.breaker import BreakerState, CircuitBreaker
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.host_pool import HostPool
from lmtier.storage.manager import StorageManager
from lmtier.testing import DictTier, FakeClock, make_chunk


def test_opens_after_threshold_and_probes_back() -> None:
    clock = FakeClock(100.0)
    breaker = CircuitBreaker(failure_threshold=3, reset_after_s=1.0, clock=clock)
    for _ in range(2):
        assert breaker.allow()
        breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    assert breaker.opens == 1
    assert not breaker.allow()
    clock.now += 1.0
    assert breaker.allow()  # the probe
    assert breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allow()  # only one probe at a time
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.allow()


def test_failed_probes_back_off_exponentially_up_to_a_cap() -> None:
    clock = FakeClock(100.0)
    breaker = CircuitBreaker(
        failure_threshold=1, reset_after_s=1.0, max_reset_after_s=4.0, clock=clock
    )
    breaker.record_failure()
    waits = []
    for _ in range(4):
        start = clock.now
        while not breaker.allow():
            clock.now += 0.25
        waits.append(clock.now - start)
        breaker.record_failure()
    assert waits == [1.0, 2.0, 4.0, 4.0]
    breaker.record_success()
    breaker.record_failure()
    clock.now += 1.0
    assert breaker.allow()  # backoff reset by the success


def test_success_resets_the_failure_count() -> None:
    breaker = CircuitBreaker(failure_threshold=2)
    breaker.record_failure()
    breaker.record_success()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED


def test_bad_settings_are_rejected() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError):
        CircuitBreaker(reset_after_s=5, max_reset_after_s=1)


def test_manager_stops_calling_a_dead_tier_and_recovers() -> None:
    clock = FakeClock(100.0)

    async def case() -> None:
        pool = HostPool(16 * 1024, 8)
        remote = DictTier("remote")
        manager = StorageManager(
            CPUTier(pool),
            [remote],
            breaker_factory=lambda: CircuitBreaker(
                failure_threshold=2, reset_after_s=1, clock=clock
            ),
        )
        await manager.start()
        key, data = make_chunk()
        remote.data[key] = data
        remote.fail = True
        for _ in range(5):
            assert (await manager.lookup([key])).num_chunks == 0
        assert remote.calls["contains"] == 2  # then the breaker opened: fast misses
        assert remote.stats.skipped == 3
        assert manager.stats()["remote"]["breaker"] == "open"
        remote.fail = False
        assert (await manager.lookup([key])).num_chunks == 0  # still open
        clock.now += 1
        assert (await manager.lookup([key])).num_chunks == 1  # the probe succeeds
        assert manager.stats()["remote"]["breaker"] == "closed"
        await manager.close()
        pool.close()

    asyncio.run(case())
