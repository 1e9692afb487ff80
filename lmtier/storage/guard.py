"""One guarded call to a tier: circuit breaker, timeout, and calls abandoned safely.

The StorageManager calls a byte tier only through :meth:`TierGuard.call`. A failing
tier must cost a request a miss, never an error or an unbounded wait, so:

* the tier's :class:`~lmtier.storage.breaker.CircuitBreaker` turns a dead tier into a fast
  miss (``stats.skipped``) until a probe succeeds;
* the call runs as its own task under a deadline that grows with what it carries
  (:class:`~lmtier.storage.budget.CallBudget`: the caller says how many bytes or keys),
  and, when the tier reports :class:`~lmtier.storage.budget.Progress`, it is given up
  on as soon as the tier's I/O has not moved for ``timeout_s``: a hung server costs a
  large call ``timeout_s``, not its whole deadline. An exception or a timeout is a
  miss, counted in ``stats.errors`` and fed to the breaker;
* both clocks run only while this process can watch: the guard looks a few times per
  ``timeout_s``, and the time a look came late by (the event loop starved of CPU by
  other processes, or busy with other work) is not counted. With every core of the
  machine busy, a batch's replies waited in the socket while the loop could not run,
  and a stall check that woke up late then gave up on a live server (Redis loads at
  the default 0.5 s lost two thirds of a 512-chunk prompt). A hung server still costs
  a call ``timeout_s`` of watched time, plus one look;
* a call that times out, or whose caller is cancelled, is *abandoned*: cancelled and
  tracked, never awaited. It may still be moving bytes in and out of the slabs it was
  given, so ``on_settled`` (which gives those slabs back) runs only when its task has
  finished, and by the tier contract (:mod:`lmtier.storage.tier`) a tier's task finishes only
  once its I/O is over. Releasing the slabs at the timeout instead let a late S3
  read overwrite a slab already reused for another tenant's chunk.

A tier declares its budget and meter as the attributes ``budget``
(:class:`~lmtier.storage.budget.CallBudget`) and ``io_progress``
(:class:`~lmtier.storage.budget.Progress`); one that declares no budget gets
``CallBudget(timeout_s)``: one fixed timeout per call, as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

from lmtier.storage.breaker import CircuitBreaker
from lmtier.storage.budget import CallBudget, Progress
from lmtier.storage.tier import Tier

__all__ = ["LOOKS_PER_TIMEOUT", "TierGuard"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

LOOKS_PER_TIMEOUT = 4
"""How often per ``timeout_s`` the guard looks at a call in flight: a hang is caught
between ``timeout_s`` and ``timeout_s * (1 + 1 / LOOKS_PER_TIMEOUT)`` after the last
byte moved, counted in time the process could watch."""


class TierGuard:
    """Breaker, deadlines and abandoned calls of one tier (module docstring). Loop-only."""

    __slots__ = ("abandoned", "breaker", "budget", "progress", "tier")

    def __init__(self, tier: Tier, timeout_s: float, breaker: CircuitBreaker) -> None:
        self.tier = tier
        declared = getattr(tier, "budget", None)
        self.budget = declared if isinstance(declared, CallBudget) else CallBudget(timeout_s)
        """What a call may take; the tier's own when it declares one."""
        meter = getattr(tier, "io_progress", None)
        self.progress = meter if isinstance(meter, Progress) else None
        """The tier's I/O progress, None if it reports none (deadlines only)."""
        self.breaker = breaker
        self.abandoned: set[asyncio.Future[Any]] = set()
        """Calls given up on whose I/O has not finished yet."""

    @property
    def timeout_s(self) -> float:
        """The fixed part of every call's deadline (``budget.timeout_s``)."""
        return self.budget.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self.budget = replace(self.budget, timeout_s=value)

    async def call(
        self,
        what: str,
        call: Callable[[], Awaitable[T]],
        on_settled: Callable[[], None] | None = None,
        *,
        num_bytes: int = 0,
        num_keys: int = 0,
        deadline_s: float | None = None,
    ) -> tuple[T | None, bool]:
        """Run ``call()``: ``(result, timed_out)``, the result None for "count it a miss".

        ``num_bytes`` (the most the call may move) and ``num_keys`` (keys a lookup asks
        about) extend its deadline as the tier's budget says; with neither, the call
        gets ``budget.timeout_s``. A call whose work is not known in advance (a purge)
        names its own ``deadline_s`` instead; a stall of the tier's I/O still ends it.
        ``on_settled`` runs once the call is really over: at once if it is never made
        (breaker open), else when its task finishes (module docstring).
        """
        tier, breaker = self.tier, self.breaker
        if not breaker.allow():
            tier.stats.skipped += 1
            if on_settled is not None:
                on_settled()
            return None, False
        task: asyncio.Future[T] = asyncio.ensure_future(call())
        if on_settled is not None:
            task.add_done_callback(lambda _: on_settled())
        try:
            if deadline_s is None:
                deadline_s = self.budget.seconds(num_bytes=num_bytes, num_keys=num_keys)
            late = await self._wait(task, deadline_s)
        except asyncio.CancelledError:
            self._abandon(task)
            raise
        if late is not None:
            self._abandon(task)
            self._failed(what, TimeoutError(late))
            return None, True
        if task.cancelled():  # cancelled from inside the tier: a failure like any other
            self._failed(what, asyncio.CancelledError())
            return None, False
        error = task.exception()
        if error is not None:
            if not isinstance(error, Exception):
                raise error  # KeyboardInterrupt, SystemExit: not a tier failure
            self._failed(what, error)  # a failing tier is a miss, never a failed request
            return None, False
        breaker.record_success()
        return task.result(), False

    async def _wait(self, task: asyncio.Future[Any], limit_s: float) -> str | None:
        """Wait for ``task`` up to ``limit_s``, or until the tier's I/O has stalled for
        ``timeout_s``: None once it is done, else why it was given up on.

        Both clocks count only the time this process could watch (module docstring):
        the guard looks every ``timeout_s / LOOKS_PER_TIMEOUT``, and a look that comes
        late (the loop was starved of CPU, or busy with other work) adds only the time
        it planned to wait, so a starved process never blames the tier for bytes it
        could not read."""
        loop = asyncio.get_running_loop()
        stall_s, meter = self.budget.timeout_s, self.progress
        step = stall_s / LOOKS_PER_TIMEOUT
        waited = stalled = 0.0
        seen = meter.count if meter is not None else 0
        while True:
            planned = max(0.0, min(step, limit_s - waited))
            started = loop.time()
            done, _ = await asyncio.wait({task}, timeout=planned)
            if done:
                return None
            counted = min(loop.time() - started, planned)
            waited += counted
            if waited >= limit_s:
                return f"not done within its deadline of {limit_s:.3g} s"
            if meter is None:
                continue
            if meter.count != seen:
                seen, stalled = meter.count, 0.0
                continue
            stalled += counted
            if stalled >= stall_s:
                return f"no I/O moved for {stall_s:.3g} s (deadline {limit_s:.3g} s)"

    def _failed(self, what: str, error: BaseException) -> None:
        self.breaker.record_failure()
        self.tier.stats.errors += 1
        logger.debug("%s: %s failed: %r", self.tier.name, what, error)

    def _abandon(self, task: asyncio.Future[Any]) -> None:
        task.cancel()
        self.abandoned.add(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Future[Any]) -> None:
        self.abandoned.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: nobody awaits an abandoned call
