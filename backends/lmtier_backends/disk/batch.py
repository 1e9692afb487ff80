"""Batches of file operations on the disk tier's threads: one pool job per thread.

:func:`fan_out` runs one operation per item on a few threads; :func:`write_batch`
uses it to write a batch of chunk files, then counts them in the directory's ledger
and, when asked, makes them durable, all in one more hop.

A batch of 32 KiB chunk writes costs ~50 us of system calls per file; submitting one
executor job per file added as much again on the event loop's thread (a future, a
wrap into asyncio, a wake-up each), which a loaded machine could not spare. So a
batch runs as at most ``workers`` jobs, each taking the next item of the batch as it
finishes one (an ``itertools.count``: atomic under the GIL), which balances uneven
items (a cold read next to a cached one) as well as one job per item did.

Cancellation keeps the contract of :mod:`lmtier.storage.blocking`: when the awaiting
coroutine is cancelled, the jobs take no new item, and the coroutine returns (by
raising CancelledError) only once no thread is still working on its items' buffers.
Items never run keep :data:`NOT_RUN` (also when the pool shut down under the batch).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Final

from lmtier.storage.blocking import finish
from lmtier_backends.disk.io import commit_writes, write_file
from lmtier_backends.disk.layout import restore_dirs
from lmtier_backends.disk.ledger import Ledger

__all__ = ["NOT_RUN", "WrittenBatch", "fan_out", "write_batch"]


class _NotRun:
    """The outcome of an item whose job never took it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NOT_RUN"


NOT_RUN: Final = _NotRun()


async def fan_out(
    pool: Executor,
    workers: int,
    fn: Callable[..., Any],
    items: Sequence[tuple[Any, ...]],
) -> list[Any]:
    """``fn(*item)`` for each item, on up to ``workers`` threads of ``pool``; the results,
    in order, with an item's Exception in place of its result (a batch sorts its
    failures per item) and :data:`NOT_RUN` for items no thread took."""
    results: list[Any] = [NOT_RUN] * len(items)
    claim = itertools.count().__next__
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            index = claim()
            if index >= len(items):
                return
            try:
                results[index] = fn(*items[index])
            except Exception as exc:
                results[index] = exc

    jobs = [pool.submit(work) for _ in range(min(workers, len(items)))]
    waiters = [asyncio.wrap_future(job) for job in jobs]
    if not waiters:
        return results
    try:
        await asyncio.wait(waiters)
    except asyncio.CancelledError:
        stop.set()
        for job in jobs:
            job.cancel()  # succeeds only for jobs no thread has started
        await finish(asyncio.ensure_future(asyncio.wait(waiters)))
        _retrieve(waiters)
        raise
    _retrieve(waiters)
    return results


def _retrieve(waiters: list[asyncio.Future[Any]]) -> None:
    """Consume the jobs' own outcomes (a job fails only if the pool was shut down),
    so that asyncio does not log them as never retrieved."""
    for waiter in waiters:
        if not waiter.cancelled():
            waiter.exception()


@dataclass(slots=True)
class WrittenBatch:
    """What became of a :func:`write_batch`."""

    outcomes: list[Any]
    """Per file: the bytes the directory gained (an int: it is in place), or why not
    (an exception, or :data:`NOT_RUN`)."""
    placed: list[bool]
    """Per file: renamed into place (and durable, if asked, unless ``problem``)."""
    total: int
    """The directory's bytes after the batch, as the ledger counts them (-1: unknown)."""
    problem: OSError | None
    """Why the batch could not be made durable (its files are in place, but not kept)."""


async def write_batch(
    pool: Executor,
    workers: int,
    files: Sequence[tuple[str, str, memoryview]],
    *,
    root: str,
    direct: bool,
    mode: int,
    durable: bool,
    ledger: Ledger,
    reserved: int = 0,
) -> WrittenBatch:
    """Write each ``(final path, temp path, bytes)`` with :func:`~.io.write_file` on up to
    ``workers`` threads, then in one hop count the batch in ``ledger`` and, if
    ``durable``, flush it to stable storage (:func:`~.io.commit_writes`).

    A file whose directory was missing (FileNotFoundError) has ``root`` recreated and
    ``ledger`` reset from a scan, if part of it was removed (:func:`~.layout.restore_dirs`);
    the whole batch is then written again: files that landed before the removal are
    gone, or are replaced and counted as such, so the ledger gains exactly the bytes of
    what stands. ``reserved``: bytes of the batch the ledger counts already
    (:mod:`~.sharing`); it gains only the difference (none of it survives a reset)."""
    write = functools.partial(write_file, direct=direct, mode=mode)
    outcomes = await fan_out(pool, workers, write, files)
    if any(isinstance(outcome, FileNotFoundError) for outcome in outcomes):
        restore = functools.partial(restore_dirs, root, mode, ledger)
        try:
            restored = await finish(asyncio.get_running_loop().run_in_executor(pool, restore))
        except OSError:  # it cannot be recreated: the writes' own errors say why
            restored = False
        if restored:
            reserved = 0  # the ledger was reset from a scan: the reservation went with it
            outcomes = await fan_out(pool, workers, write, files)
    placed = [isinstance(outcome, int) for outcome in outcomes]
    paths = [final for (final, _, _), ok in zip(files, placed, strict=True) if ok]
    added = sum(outcome for outcome, ok in zip(outcomes, placed, strict=True) if ok)
    commit = functools.partial(
        commit_writes, root, paths, added - reserved, durable=durable, ledger=ledger
    )
    total, problem = await finish(asyncio.get_running_loop().run_in_executor(pool, commit))
    return WrittenBatch(outcomes, placed, total, problem)
