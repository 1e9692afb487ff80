"""One guarded call to a tier: circuit breaker, timeout, and calls abandoned safely.

The StorageManager calls a byte tier only through :meth:`TierGuard.call`. A failing
tier must cost a request a miss, never an error or an unbounded wait, so:

* the tier's :class:`~lmtier.storage.breaker.CircuitBreaker` turns a dead tier into a fast
  miss (``stats.skipped``) until a probe succeeds;
* the call runs as its own task under the tier's timeout; an exception or a timeout
  is a miss, counted in ``stats.errors`` and fed to the breaker;
* a call that times out, or whose caller is cancelled, is *abandoned*: cancelled and
  tracked, never awaited. It may still be moving bytes in and out of the slabs it was
  given, so ``on_settled`` (which gives those slabs back) runs only when its task has
  finished, and by the tier contract (:mod:`lmtier.storage.tier`) a tier's task finishes only
  once its I/O is over. Releasing the slabs at the timeout instead let a late S3
  read overwrite a slab already reused for another tenant's chunk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from lmtier.storage.breaker import CircuitBreaker
from lmtier.storage.tier import Tier

__all__ = ["TierGuard"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class TierGuard:
    """Breaker, timeout and abandoned calls of one tier (module docstring). Loop-only."""

    __slots__ = ("abandoned", "breaker", "tier", "timeout_s")

    def __init__(self, tier: Tier, timeout_s: float, breaker: CircuitBreaker) -> None:
        self.tier = tier
        self.timeout_s = timeout_s
        self.breaker = breaker
        self.abandoned: set[asyncio.Future[Any]] = set()
        """Calls given up on whose I/O has not finished yet."""

    async def call(
        self,
        what: str,
        call: Callable[[], Awaitable[T]],
        on_settled: Callable[[], None] | None = None,
    ) -> tuple[T | None, bool]:
        """Run ``call()``: ``(result, timed_out)``, the result None for "count it a miss".

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
            done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
        except asyncio.CancelledError:
            self._abandon(task)
            raise
        if not done:
            self._abandon(task)
            self._failed(what, TimeoutError(f"no answer in {self.timeout_s} s"))
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
