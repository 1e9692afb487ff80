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

__all__ = ["TierGuard"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
        ``timeout_s``: None once it is done, else why it was given up on."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        stall_s, meter = self.budget.timeout_s, self.progress
        if meter is None or limit_s <= stall_s:
            done, _ = await asyncio.wait({task}, timeout=limit_s)
            return None if done else f"no answer in {limit_s:.3g} s"
        seen = meter.count
        while True:
            left = deadline - loop.time()
            done, _ = await asyncio.wait({task}, timeout=max(0.0, min(stall_s, left)))
            if done:
                return None
            if loop.time() >= deadline:
                return f"not done within its deadline of {limit_s:.3g} s"
            if meter.count == seen:
                return f"no I/O moved for {stall_s:.3g} s (deadline {limit_s:.3g} s)"
            seen = meter.count

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
