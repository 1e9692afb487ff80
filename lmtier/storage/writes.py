"""Background writes below the CPU tier: one bounded queue and one writer per tier.

A chunk stored (or promoted, or evicted toward a write-back tier) is queued for each
tier that should receive it, holding a *write lease* on its slab
(:meth:`~lmtier.storage.cpu_tier.CPUTier.share_for_write`: it keeps the slab alive, not
the chunk cached). A full queue drops the write and counts it (``queue_drops``),
unless its caller waits for room (:mod:`lmtier.storage.room`: stores do, for as long
as writes keep landing, up to ``write_wait_s`` without one). Each tier's writer
hands it batches sized by a :class:`~lmtier.storage.pacing.BatchPacer` (so a slow
tier still takes writes), through the tier's
:class:`~lmtier.storage.guard.TierGuard`, whose deadline for a batch grows with its
bytes (:mod:`lmtier.storage.budget`). Each chunk stored unsealed is sealed
first (:mod:`lmtier.storage.sealing`: its checksum and MAC are computed here, off
the storing thread), so no tier below host memory sees unsealed bytes. A write that
fails, is skipped by the breaker or times out is dropped and counted; the chunk stays
in the tiers above.
Its write leases go back only when its I/O is over (an abandoned write may still be
reading the slab).

Fewer hops per chunk: writes queued from other threads reach the loop together (one
wake-up for all that arrived since the last one, not one per chunk, so the writer
sees a store's chunks as one batch), and a writer seals its next batch while up to
:data:`PUTS_IN_FLIGHT` batches are being written, so neither the sealing thread nor
the tier's threads wait for the other between batches. A batch holds at most
:data:`SEAL_STEP_BYTES` of chunks, so that this overlap exists for one large store
too: sealing a 256 MiB prompt as one batch took 20-27 ms during which its tier wrote
nothing (a quarter of a disk store + flush, measured on 2 cores).

A purge of a namespace (:mod:`lmtier.storage.purging`) must not be undone by a write
queued before it: writers drop writes its :class:`~lmtier.storage.barriers.PurgeBarriers`
call stale, right before sending a batch, and :meth:`BackgroundWrites.settled` lets
the purge wait for a batch of the namespace already being sent.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from lmtier.chunks.keys import NAMESPACE_BYTES, ChunkKey
from lmtier.storage.barriers import PurgeBarriers
from lmtier.storage.breaker import BreakerState
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.guard import TierGuard
from lmtier.storage.host_pool import SlabHandle
from lmtier.storage.pacing import MAX_CHUNKS, BatchPacer
from lmtier.storage.room import Patience, RoomSignal
from lmtier.storage.sealing import Sealer
from lmtier.storage.tier import Tier

__all__ = ["CLOSE_FLUSH_S", "PUTS_IN_FLIGHT", "SEAL_STEP_BYTES", "BackgroundWrites"]

logger = logging.getLogger(__name__)

CLOSE_FLUSH_S = 30.0
"""How long :meth:`BackgroundWrites.close` waits for queued writes by default (the
facade passes ``close_flush_s`` from its config); what is still queued then is
dropped (and counted). Call ``flush()`` first to wait for all."""
PUTS_IN_FLIGHT = 2
"""Batches one tier's writer may have in its tier's hands at once (the next one is
sealed meanwhile)."""
SEAL_STEP_BYTES = 32 << 20
"""Most bytes in one write batch (at least one chunk): small enough that the tier
writes one batch while the next is sealed (~3 ms to hash 32 MiB), large enough that
a batch's fixed costs (a guard call, a hop to the tier's threads) stay small."""


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


@dataclass(slots=True)
class _Write:
    key: ChunkKey
    handle: SlabHandle
    size: int
    stamp: int
    """:attr:`PurgeBarriers.epoch` when it was queued."""


class _Flight:
    """A batch being sent: its namespaces, and a future done once its call is over."""

    __slots__ = ("done", "namespaces")

    def __init__(self, batch: Sequence[_Write]) -> None:
        self.namespaces = frozenset(w.key[:NAMESPACE_BYTES] for w in batch)
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class BackgroundWrites:
    """The write queues and writers of a StorageManager's byte tiers.

    Loop-only, except :meth:`enqueue`, which any thread may call holding ``lock`` (the
    StorageManager's): a write queued off the loop reserves its place at once (so the
    caller learns at once whether it was dropped) and reaches its queue through the
    loop's thread-safe callback, in the order it was queued.
    """

    def __init__(
        self,
        cpu_tier: CPUTier,
        guards: Sequence[TierGuard],
        sealer: Sealer | None = None,
        *,
        lock: threading.RLock | None = None,
        barriers: PurgeBarriers | None = None,
    ) -> None:
        self.cpu_tier = cpu_tier
        self.sealer = sealer or Sealer()
        self.lock = lock or threading.RLock()
        self.barriers = barriers or PurgeBarriers()
        self.guards = {guard.tier.name: guard for guard in guards}
        self.pacers = {name: BatchPacer(guard.budget) for name, guard in self.guards.items()}
        self._queues: dict[str, asyncio.Queue[_Write]] = {}
        self._depths: dict[str, int] = {}
        self._waiting: dict[str, int] = {}
        """Writes queued or on their way to the queue, per tier (under ``lock``)."""
        self._writers: list[asyncio.Task[None]] = []
        self._sends: set[asyncio.Task[None]] = set()
        """Batches being written, every tier's (loop only)."""
        self._inbox: list[tuple[asyncio.Queue[_Write], _Write]] = []
        """Writes queued off the loop, not delivered to their queue yet (under ``lock``)."""
        self.room = RoomSignal(self.lock)
        """Signalled whenever a queue place or a slab may have come free."""
        self._flights: dict[str, set[_Flight]] = {}
        """Batches being sent, per tier (loop only)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def start(self) -> None:
        """Start one writer per tier. Call once, on the runtime's loop."""
        self._loop = asyncio.get_running_loop()
        # A queue's writes hold slabs; half the pool stays for caching and loads.
        most = max(1, self.cpu_tier.pool.num_slabs // 2)
        for name, guard in self.guards.items():
            self._depths[name] = min(guard.tier.properties.queue_depth, most)
            self._waiting[name] = 0
            self._flights[name] = set()
            queue: asyncio.Queue[_Write] = asyncio.Queue()  # bounded by the reservations
            self._queues[name] = queue
            task = self._writer(guard, queue, self.pacers[name])
            self._writers.append(asyncio.create_task(task, name=f"lmtier-writer-{name}"))

    def enqueue(self, tier: Tier, key: ChunkKey, handle: SlabHandle, size: int) -> bool:
        """Queue a write of the chunk in ``handle``'s slab to ``tier`` (a write lease of
        its own: the caller keeps its lease). False when it was not queued: the queue is
        full (counted in ``queue_drops``), the writes are closed, or a purge of the
        chunk's namespace is running. Any thread, holding ``lock``."""
        with self.lock:
            queue, loop = self._queues.get(tier.name), self._loop
            if queue is None or loop is None or self._closed or self.barriers.purging(key):
                return False
            if self._waiting[tier.name] >= self._depths[tier.name]:
                tier.stats.queue_drops += 1
                return False
            self._waiting[tier.name] += 1
            lease = self.cpu_tier.share_for_write(handle)
            write = _Write(key, lease, size, self.barriers.epoch)
            if _on_loop(loop) and not self._inbox:
                queue.put_nowait(write)
                return True
            self._inbox.append((queue, write))
            if len(self._inbox) > 1:
                return True  # a delivery is on its way already: it takes this one too
        if _on_loop(loop):
            self._deliver()
        else:
            loop.call_soon_threadsafe(self._deliver)
        return True

    def _deliver(self) -> None:
        """On the loop: hand every write queued off the loop to its queue, in order."""
        with self.lock:
            inbox, self._inbox = self._inbox, []
        for queue, write in inbox:
            queue.put_nowait(write)

    def has_room(self, tier: Tier) -> bool:
        """Whether a write to ``tier`` would be queued now (no queue: True). Holding
        ``lock``."""
        depth = self._depths.get(tier.name)
        return depth is None or self._closed or self._waiting[tier.name] < depth

    def blocking(self, tiers: Sequence[Tier]) -> list[Tier]:
        """The tiers of ``tiers`` whose queue is full and whose breaker is closed (a
        tier that is down, or being probed, is never waited for). Holding ``lock``."""
        closed = BreakerState.CLOSED
        return [
            t for t in tiers if not self.has_room(t) and self.guards[t.name].breaker.state is closed
        ]

    def may_wait(self) -> bool:
        """Whether this thread may block for room: not the loop's (its writers make the
        room), and the writes are running."""
        loop = self._loop
        return loop is not None and not self._closed and not _on_loop(loop)

    def wait_for_room(self, tiers: Sequence[Tier], stall_s: float) -> bool:
        """Block until no tier of ``tiers`` is :meth:`blocking` (True: look again, the
        lock was let go), or give up (False) once ``stall_s`` passes with no write
        landing anywhere, or at once where :meth:`may_wait` says no. Holding ``lock``
        (released while waiting, however often this thread has taken it)."""
        with self.lock:
            blocking = self.blocking(tiers)
            if not blocking:
                return True
            if stall_s <= 0 or not self.may_wait():
                return False
            _count_waits(blocking)
            patience = Patience(self.room, stall_s)
            while self.blocking(tiers):
                left = patience.left()
                if left <= 0 or self._closed:
                    return False
                self.room.wait(patience.seen, left)
            return True

    async def room_for(self, tiers: Sequence[Tier], stall_s: float) -> bool:
        """:meth:`wait_for_room` for a coroutine on the loop (the sidecar's stores):
        waits without blocking the loop."""
        patience, counted = Patience(self.room, stall_s), False
        while True:
            with self.lock:
                blocking = self.blocking(tiers)
                if not blocking:
                    return True
                if not counted:
                    _count_waits(blocking)
                    counted = True
            left = patience.left()
            if left <= 0:
                return False
            await self.room.wait_async(patience.seen, left)

    def depth(self, tier: Tier) -> int | None:
        """Writes waiting for ``tier`` (None: it has no queue)."""
        return self._waiting.get(tier.name)

    async def _writer(
        self, guard: TierGuard, queue: asyncio.Queue[_Write], pacer: BatchPacer
    ) -> None:
        tier, chunk_bytes = guard.tier, self.cpu_tier.pool.slab_bytes
        most = max(1, SEAL_STEP_BYTES // max(1, chunk_bytes))
        sends: set[asyncio.Task[None]] = set()
        while True:
            batch = [await queue.get()]
            limit = min(most, pacer.size(chunk_bytes, MAX_CHUNKS))
            while len(batch) < limit and not queue.empty():
                batch.append(queue.get_nowait())
            taken = len(batch)
            with self.lock:
                self._waiting[tier.name] -= taken
                self.room.changed()
            try:
                batch = await self._sealed(tier, batch)
                while len(sends) >= PUTS_IN_FLIGHT:
                    await asyncio.wait(sends, return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                tier.stats.queue_drops += len(batch)  # taken, never sent: closing
                self._release(batch)
                for _ in range(taken):
                    queue.task_done()
                raise
            batch = self._unpurged(batch)  # no await from here to the flight's start
            for _ in range(taken - len(batch)):
                queue.task_done()
            if not batch:
                continue
            flight = _Flight(batch)
            self._flights[tier.name].add(flight)
            send = asyncio.create_task(self._send(guard, queue, pacer, batch, flight))
            for tasks in (sends, self._sends):
                tasks.add(send)
                send.add_done_callback(tasks.discard)

    async def _send(
        self,
        guard: TierGuard,
        queue: asyncio.Queue[_Write],
        pacer: BatchPacer,
        batch: list[_Write],
        flight: _Flight,
    ) -> None:
        """Write one sealed batch through the tier's guard; count, pace, and mark it
        done in its queue (the slabs go back when its I/O is over: :meth:`_landed`)."""
        tier = guard.tier
        items = [(w.key, w.handle.view[: w.size]) for w in batch]
        num_bytes = sum(w.size for w in batch)
        started = time.perf_counter()
        try:
            # Bound now, not looked up when called: an abandoned write settles
            # after this loop has moved on to the next batch.
            stored, timed_out = await guard.call(
                "put",
                functools.partial(tier.put, items),
                functools.partial(self._landed, tier.name, batch, flight),
                num_bytes=num_bytes,
            )
        finally:
            for _ in batch:
                queue.task_done()
        elapsed = time.perf_counter() - started
        tier.stats.write_latency.record(elapsed)
        if stored is not None:
            pacer.succeeded(num_bytes, elapsed, len(batch))
            events = tier.events  # told only when all landed: which, if only some did?
            if stored == len(items) and events is not None and events.active:
                events.emit("stored", tier.name, [key for key, _ in items])
        elif timed_out:
            pacer.timed_out(num_bytes, len(batch))

    async def _sealed(self, tier: Tier, batch: list[_Write]) -> list[_Write]:
        """``batch`` with every chunk sealed (:mod:`lmtier.storage.sealing`); a write whose
        chunk cannot be sealed is released and counted as an error of ``tier``."""
        ok = await self.sealer.seal([(w.handle, w.size) for w in batch])
        if all(ok):
            return batch
        dropped = [w for w, good in zip(batch, ok, strict=True) if not good]
        self._release(dropped)
        tier.stats.errors += len(dropped)
        return [w for w, good in zip(batch, ok, strict=True) if good]

    def _unpurged(self, batch: list[_Write]) -> list[_Write]:
        """``batch`` without the writes a purge made stale (released, not counted: the
        chunk is deleted, not lost)."""
        kept: list[_Write] = []
        stale: list[_Write] = []
        for write in batch:
            (stale if self.barriers.stale(write.key, write.stamp) else kept).append(write)
        if stale:
            self._release(stale)
        return kept

    def _landed(self, name: str, batch: list[_Write], flight: _Flight) -> None:
        """A batch's call is over (its I/O too): release its leases, end its flight."""
        self._release(batch)
        self._flights[name].discard(flight)
        if not flight.done.done():
            flight.done.set_result(None)

    async def settled(self, tier: Tier, namespace: bytes, timeout_s: float) -> bool:
        """Wait until no batch holding a chunk of ``namespace`` is being sent to ``tier``
        (up to ``timeout_s``); False if one still is. Batches taken from the queue
        later drop such chunks themselves while a purge runs (:meth:`_unpurged`)."""
        waits = [f.done for f in self._flights.get(tier.name, ()) if namespace in f.namespaces]
        if not waits:
            return True
        _, pending = await asyncio.wait(waits, timeout=timeout_s)
        return not pending

    def _release(self, batch: list[_Write]) -> None:
        with self.lock:
            for write in batch:
                self.cpu_tier.release_write(write.handle)
            self.room.changed()

    async def flush(self) -> None:
        """Wait until every queued write has been attempted."""
        self._deliver()
        await asyncio.gather(*(queue.join() for queue in self._queues.values()))

    async def close(self, flush_s: float = CLOSE_FLUSH_S) -> None:
        """Flush (up to ``flush_s``: a hung tier must not hold the process), stop the
        writers, drop (and count) what is still queued, with one warning. Idempotent."""
        if self._closed:
            return
        try:
            await asyncio.wait_for(self.flush(), flush_s)
            gave_up = False
        except asyncio.TimeoutError:
            gave_up = True
        with self.lock:
            self._closed = True
        await asyncio.sleep(0)  # writes queued from other threads before now land first
        self._deliver()
        tiers = [guard.tier for guard in self.guards.values()]
        before = sum(tier.stats.queue_drops for tier in tiers)
        tasks = [*self._writers, *self._sends]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._writers.clear()
        self.sealer.close()
        with self.lock:
            for name, queue in self._queues.items():
                while not queue.empty():
                    self.cpu_tier.release_write(queue.get_nowait().handle)
                    self.guards[name].tier.stats.queue_drops += 1
                self._waiting[name] = 0
            self.room.changed()
        dropped = sum(tier.stats.queue_drops for tier in tiers) - before
        if gave_up:
            logger.warning(
                "close: writes not done after %g s (close_flush_s): %d queued write(s) "
                "dropped (counted in queue_drops), the batches being sent abandoned",
                flush_s,
                dropped,
            )


def _count_waits(tiers: Sequence[Tier]) -> None:
    """One store waits for room in these tiers' queues: count it in each one's stats."""
    for tier in tiers:
        tier.stats.queue_waits += 1
