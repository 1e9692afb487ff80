"""A circuit breaker: stop calling a tier that keeps failing, probe it back later.

A dead Redis or S3 must cost a request nothing: after ``failure_threshold``
consecutive failures (errors or timeouts) the breaker *opens* and every call is a
fast miss, without touching the network. After ``reset_after_s`` one call is let
through as a probe (*half-open*); success closes the breaker, failure opens it
again with the wait doubled, up to ``max_reset_after_s``, so a long outage is
probed rarely and a short one recovers quickly.

The StorageManager keeps one breaker per tier and wraps every call to it; tiers
themselves know nothing about it. All methods run on the runtime's loop thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum

__all__ = ["BreakerState", "CircuitBreaker"]


class BreakerState(Enum):
    """Where a breaker stands."""

    CLOSED = "closed"
    """Calls go through."""
    OPEN = "open"
    """Calls are fast misses until the reset time passes."""
    HALF_OPEN = "half_open"
    """One probe call is in flight; the others are fast misses."""


class CircuitBreaker:
    """Consecutive-failure breaker with exponential probe backoff (module docstring)."""

    def __init__(
        self,
        *,
        failure_threshold: int = 3,
        reset_after_s: float = 0.5,
        max_reset_after_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if not 0 < reset_after_s <= max_reset_after_s:
            raise ValueError("need 0 < reset_after_s <= max_reset_after_s")
        self.failure_threshold = failure_threshold
        self.base_reset_after_s = reset_after_s
        self.max_reset_after_s = max_reset_after_s
        self._clock = clock
        self.state = BreakerState.CLOSED
        self.failures = 0
        """Consecutive failures since the last success."""
        self.opens = 0
        """Times the breaker opened."""
        self._reset_after_s = reset_after_s
        self._retry_at = 0.0

    def allow(self) -> bool:
        """Whether a call may go to the tier now (False: treat it as a miss)."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN and self._clock() >= self._retry_at:
            self.state = BreakerState.HALF_OPEN
            return True  # this call is the probe
        return False

    def record_success(self) -> None:
        """The call answered: close, and forget past failures."""
        self.state = BreakerState.CLOSED
        self.failures = 0
        self._reset_after_s = self.base_reset_after_s

    def record_failure(self) -> None:
        """The call failed or timed out: open after enough of them, or after a failed probe."""
        self.failures += 1
        if self.state is BreakerState.HALF_OPEN:
            self._reset_after_s = min(self._reset_after_s * 2, self.max_reset_after_s)
            self._open()
        elif self.state is BreakerState.CLOSED and self.failures >= self.failure_threshold:
            self._open()

    def _open(self) -> None:
        self.state = BreakerState.OPEN
        self.opens += 1
        self._retry_at = self._clock() + self._reset_after_s
