"""Back-pressure on stores: waiting for room in the write queues and the host pool.

A store must not lose work the configuration can hold. Its chunks land in host memory
at once, and each write-through tier gets them through a bounded queue
(:mod:`lmtier.storage.writes`); when a tier falls behind, that queue fills, and the
queued writes keep their slabs out of the pool. Dropping then (what lmtier did) lost
37-129 of a 512-chunk prompt stored with Redis behind the CPU tier on a busy
machine, though the tier was healthy, only slower than the store.

So a store that finds a queue full (or no free slab, every one held by pending
writes) waits for room: back-pressure, as a bounded pipe applies it. The wait is
bounded by progress, not by the store's size: it gives up (and the chunk is dropped
and counted, as before) once ``write_wait_s`` passes with no write landing, or at
once when the tier it waits for is down (its breaker is open: a dead tier costs
misses, never a wait). A tier that keeps writing, however slowly, paces the store to
its speed; one that stops costs the store ``write_wait_s``.

:class:`RoomSignal` is how waiters learn that room may have appeared: the writers
call :meth:`RoomSignal.changed` (holding the StorageManager's lock) whenever they
take writes off a queue or release their slabs. Threads wait on a condition of that
lock; code on the event loop never blocks and waits asynchronously instead.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.host_pool import SlabHandle

__all__ = ["POLL_S", "Patience", "RoomSignal", "take_slabs", "take_slabs_async"]

POLL_S = 0.05
"""Longest a waiter sleeps before it looks again even without a signal: a slab a
reader gives back (outside the manager's lock) frees room no writer announces."""


class RoomSignal:
    """A generation count of "room may have appeared", waited on by threads (a condition
    of the manager's lock) and by coroutines (futures). See the module docstring."""

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self._condition = threading.Condition(lock)
        self.generation = 0
        """How many times room may have appeared; a waiter compares it to what it saw."""
        self.waiting = 0
        """Stores waiting for room now (threads and coroutines): back-pressure at work."""
        self.gave_up_at = -1
        """:attr:`generation` when a waiter last gave up: until room next appears, later
        waiters give up at once (a stalled tier costs ``write_wait_s`` once, not once
        per chunk or per store)."""
        self._futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def changed(self) -> None:
        """Room may have appeared: wake every waiter. Holding ``lock``."""
        self.generation += 1
        self._condition.notify_all()
        futures, self._futures = self._futures, []
        for loop, future in futures:
            loop.call_soon_threadsafe(_settle, future)

    def wait(self, seen: int, timeout_s: float) -> None:
        """Block until :attr:`generation` differs from ``seen``, at most ``timeout_s``
        (and at most :data:`POLL_S`). Holding ``lock``, which is released meanwhile,
        however often the thread has taken it."""
        if self.generation == seen:
            self.waiting += 1
            try:
                self._condition.wait(max(0.0, min(timeout_s, POLL_S)))
            finally:
                self.waiting -= 1

    async def wait_async(self, seen: int, timeout_s: float) -> None:
        """:meth:`wait` for a coroutine: it never blocks its loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self.lock:
            if self.generation != seen:
                return
            self._futures.append((loop, future))
            self.waiting += 1
        try:
            await asyncio.wait([future], timeout=max(0.0, min(timeout_s, POLL_S)))
        finally:
            with self.lock:
                self.waiting -= 1
                self._futures = [(lp, f) for lp, f in self._futures if f is not future]


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Patience:
    """How long a waiter may still wait: ``stall_s`` from its start or from the last
    progress it saw (a new :attr:`RoomSignal.generation`); nothing at all when a waiter
    gave up since room last appeared (:attr:`RoomSignal.gave_up_at`)."""

    __slots__ = ("_signal", "_since", "seen", "stall_s")

    def __init__(self, signal: RoomSignal, stall_s: float) -> None:
        self._signal = signal
        self.stall_s = stall_s
        self.seen = signal.generation
        self._since = time.monotonic()

    def left(self) -> float:
        """Seconds left before giving up (<= 0: give up); progress restarts the clock."""
        signal, now = self._signal, time.monotonic()
        if signal.generation != self.seen:
            self.seen = signal.generation
            self._since = now
        left = self.stall_s - (now - self._since)
        if signal.gave_up_at == self.seen:
            left = 0.0
        if left <= 0:
            signal.gave_up_at = self.seen
        return left


def take_slabs(cpu_tier: CPUTier, room: RoomSignal, count: int, stall_s: float) -> list[SlabHandle]:
    """Up to ``count`` free slabs of ``cpu_tier`` (evicting idle chunks); while none is
    free, wait for writes to give theirs back, up to ``stall_s`` with none landing (0:
    no wait). Any thread but the loop's, holding ``room.lock`` (let go meanwhile)."""
    handles: list[SlabHandle] = []
    with room.lock:
        patience: Patience | None = None
        while len(handles) < count:
            handle = cpu_tier.acquire_slab()
            if handle is not None:
                handles.append(handle)
                continue
            if stall_s <= 0:
                break
            if patience is None:
                patience = Patience(room, stall_s)
                cpu_tier.stats.queue_waits += 1
            left = patience.left()
            if left <= 0:
                break
            room.wait(patience.seen, left)
    return handles


async def take_slabs_async(
    cpu_tier: CPUTier, room: RoomSignal, count: int, stall_s: float, closed: Callable[[], bool]
) -> list[SlabHandle]:
    """:func:`take_slabs` for a coroutine on the loop: waits without blocking it (and
    stops waiting once ``closed()``)."""
    handles = take_slabs(cpu_tier, room, count, 0.0)
    patience = Patience(room, stall_s)
    if len(handles) < count and stall_s > 0:
        with room.lock:
            cpu_tier.stats.queue_waits += 1
    while len(handles) < count and not closed():
        left = patience.left()
        if left <= 0:
            break
        await room.wait_async(patience.seen, left)
        handles += take_slabs(cpu_tier, room, count - len(handles), 0.0)
    return handles
