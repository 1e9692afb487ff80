"""Blocking calls in worker threads, awaited so that no call outlives its coroutine.

Tiers that do I/O in threads (disk files, boto3) hand those threads views of pool
slabs. The interface contract of :mod:`lmtier.storage.tier` says a tier call returns, raises
or is cancelled only once none of its I/O can touch the buffers it was given any
more: the StorageManager keeps a slab out of the pool until then. ``await
loop.run_in_executor(...)`` breaks that contract when cancelled (by a timeout, or a
caller giving up): the awaiting coroutine ends at once while the thread goes on
writing into the slab. The helpers here keep it:

* :func:`run_blocking` submits calls to a pool; when cancelled, calls not started yet
  never start, and the coroutine waits for the running ones before it re-raises the
  cancellation.
* :func:`finish` awaits a future to its end through any number of cancellations,
  then re-raises the cancellation (a task whose work must land, like a disk write
  that will be indexed, or a batch of ``run_blocking`` calls).
* :func:`shutdown_pool` stops a pool within a bounded time even when one of its
  threads is stuck in the kernel (a hung NFS read, a FIFO opened by mistake):
  ``close()`` of a tier must return.

The rejected alternative, copying through a private bounce buffer per call, costs a
copy of every chunk and only moves the problem to the bounce buffer's reuse.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["finish", "run_blocking", "shutdown_pool"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def finish(future: asyncio.Future[T]) -> T:
    """The result of ``future`` once it is done, even if the caller is cancelled meanwhile
    (the cancellation is re-raised after the future is done; ``future`` itself is never
    cancelled from here)."""
    interrupted = False
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            interrupted = True
    if interrupted:
        if not future.cancelled():
            future.exception()  # retrieved: the caller is gone, asyncio must not warn
        raise asyncio.CancelledError
    return future.result()


async def run_blocking(
    pool: concurrent.futures.Executor, calls: Sequence[tuple[Callable[..., Any], tuple[Any, ...]]]
) -> list[Any]:
    """Run each ``(fn, args)`` in ``pool``; their results or exceptions, in order.

    Exceptions are returned, not raised (a batch sorts them per item). If this
    coroutine is cancelled, calls not yet started are cancelled and it returns (by
    raising CancelledError) only after every started call has finished.
    """
    submitted = [pool.submit(fn, *args) for fn, args in calls]
    waiters = [asyncio.wrap_future(call) for call in submitted]
    if not waiters:
        return []
    try:
        await asyncio.wait(waiters)
    except asyncio.CancelledError:
        for call in submitted:
            call.cancel()  # succeeds only for calls no thread has started
        await finish(asyncio.ensure_future(asyncio.wait(waiters)))
        for waiter in waiters:
            _outcome(waiter)  # retrieved: asyncio must not log them as forgotten
        raise
    return [_outcome(waiter) for waiter in waiters]


def _outcome(waiter: asyncio.Future[Any]) -> Any:
    if waiter.cancelled():
        return asyncio.CancelledError()
    error = waiter.exception()
    return error if error is not None else waiter.result()


async def shutdown_pool(
    pool: concurrent.futures.ThreadPoolExecutor, name: str, timeout_s: float
) -> bool:
    """Cancel queued calls and wait up to ``timeout_s`` for running ones; True if the pool
    stopped. A thread still stuck then is left behind (logged), never waited on forever."""
    pool.shutdown(wait=False, cancel_futures=True)
    done = threading.Event()

    def join() -> None:
        pool.shutdown(wait=True)
        done.set()

    # A plain daemon thread: the loop's default executor may itself be shutting down.
    threading.Thread(target=join, name=f"{name}-shutdown", daemon=True).start()
    loop = asyncio.get_running_loop()
    waited = await loop.run_in_executor(None, done.wait, timeout_s)
    if not waited:
        logger.warning(
            "%s: an I/O thread is still blocked after %.1f s; closing without it", name, timeout_s
        )
    return waited
