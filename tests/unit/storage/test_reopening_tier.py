"""A remote tier unreachable at start-up is retried with backoff, then used."""

from __future__ import annotations

import asyncio

import pytest

from lmtier.errors import BackendUnavailable
from lmtier.storage.reopening_tier import ReopeningTier
from lmtier.storage.tier import Tier
from lmtier.testing import DictTier, FakeClock, make_chunk


def test_retries_with_backoff_then_delegates() -> None:
    clock = FakeClock()
    real = DictTier("redis")
    attempts: list[float] = []
    down = True

    async def opener() -> Tier:
        attempts.append(clock.now)
        if down:
            raise BackendUnavailable("connection refused")
        return real

    async def case() -> None:
        nonlocal down
        tier = ReopeningTier("redis", opener, retry_after_s=1.0, clock=clock)
        key, data = make_chunk()
        with pytest.raises(BackendUnavailable, match="not reachable yet"):
            await tier.contains([key])
        assert attempts == []  # the first open just failed: wait before retrying
        clock.now = 1.0
        with pytest.raises(BackendUnavailable, match="still not reachable"):
            await tier.put([(key, data)])
        clock.now = 2.0
        with pytest.raises(BackendUnavailable, match="not reachable yet"):
            await tier.contains([key])  # backoff doubled to 2 s
        down = False
        clock.now = 3.0
        assert await tier.put([(key, data)]) == 1
        assert await tier.contains([key]) == 1
        assert await tier.get_into([key], [memoryview(bytearray(len(data)))]) == [len(data)]
        assert real.stats is tier.stats  # one history of counters
        assert tier.stats.hits == 1
        assert attempts == [1.0, 3.0]
        await tier.close()
        never_opened = ReopeningTier("s3", opener, clock=clock)
        await never_opened.close()
        clock.now += 100
        with pytest.raises(BackendUnavailable, match="closed"):
            await never_opened.contains([key])

    asyncio.run(case())
