"""The StorageManager: waterfall lookup, loads with promotion, background write-down.

Tiers are ordered fastest first: the CPU tier (host-pool slabs), then byte tiers
such as disk, Redis and S3. The manager never branches on a tier's name or class;
what differs between tiers is in their :class:`~lmtier.storage.tier.TierProperties`.

* **lookup** asks the CPU tier how many leading chunks it holds, asks the next tier
  only about the rest, and so on: one batched call per tier, and a tier that fails
  or times out answers 0 (a miss), never an error.
* **get** (:mod:`lmtier.storage.reads`) serves CPU hits zero-copy, reads lower hits
  straight into fresh pool slabs in paced batches, checks every chunk (the one asked
  for, the cache's geometry, a MAC from shared tiers), promotes what lower tiers
  served, and stops at the first chunk that cannot be served. A load given no lookup
  does not make one: it reads each tier for what the tiers above did not serve.
* **put** lands in the CPU tier synchronously and goes to each ``write_through``
  tier through a bounded queue (:mod:`lmtier.storage.writes`); ``write_back`` tiers
  get chunks the CPU tier evicts. A store that finds a queue full, or every slab held
  by pending writes, waits for room while writes keep landing, up to
  ``write_wait_s`` without one (:mod:`lmtier.storage.room`); then, or at once for a
  tier that is down, the write is dropped and counted. Promotions never wait.
* **events** (:attr:`StorageManager.events`): what every tier gains and loses, queued
  for subscribers (:mod:`lmtier.storage.events`); **evict listeners** are told at once,
  under the lock, of each chunk the CPU tier evicts or a purge drops (an engine
  integration announces removals with them).
* **purge** (:meth:`StorageManager.purge`) deletes one namespace's chunks from every
  tier, CPU first, and keeps writes and promotions begun before it from bringing them
  back (:mod:`lmtier.storage.purging`).
* **failures**: every call to a byte tier goes through its
  :class:`~lmtier.storage.guard.TierGuard`: a deadline that grows with the call's bytes
  and keys (:mod:`lmtier.storage.budget`), an exception
  turned into a miss and a counter, and a circuit breaker that turns a dead tier
  into a fast miss until a probe succeeds.
* **slabs in flight**: a call that times out (or whose caller is cancelled) is
  abandoned, not awaited, but its I/O may still be reading or writing the slabs it
  was given. Those slabs stay out of the pool until the call is really over: a read
  holds leases of its own, a write keeps its write leases, both released when the
  call's task finishes (:mod:`lmtier.storage.guard`). A late read therefore lands in a
  slab nobody else has, and is dropped with it.

Threads: everything runs on the runtime's event loop (see :mod:`lmtier.runtime`),
except what a store does: :meth:`StorageManager.acquire_slabs`, :meth:`StorageManager.put`
and :meth:`StorageManager.put_many` may be called from any thread, so that
``LMTier.store`` never waits for the loop (a hop to it cost 1-2 ms, not 20 us, while
torch's idle OpenMP workers spin on the other core of a busy machine). Host-memory
state (the CPU tier's index and write leases, the write queues' reservations) is
therefore guarded by one lock, :attr:`StorageManager.lock`, wherever it changes; evict
listeners run under it, in the thread that caused the eviction. Lookups read the CPU
tier's index without it (membership tests), as they did from any thread before.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from operator import attrgetter

from lmtier.chunks.keys import ChunkKey, check_namespace
from lmtier.errors import CacheClosedError, NotSupportedError
from lmtier.storage.barriers import PurgeBarriers
from lmtier.storage.breaker import CircuitBreaker
from lmtier.storage.check import ChunkCheck
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.events import TierEvents
from lmtier.storage.guard import TierGuard
from lmtier.storage.host_pool import SlabHandle
from lmtier.storage.lookup import LoadedChunk, Lookup, TierSpan, Walk
from lmtier.storage.pacing import MAX_CHUNKS
from lmtier.storage.purging import (
    PURGE_FAILED,
    PURGE_TIMEOUT_S,
    PURGE_UNSUPPORTED,
    purge_tier,
)
from lmtier.storage.reads import Reads
from lmtier.storage.room import take_slabs, take_slabs_async
from lmtier.storage.sealing import Sealer
from lmtier.storage.tier import Tier
from lmtier.storage.writes import CLOSE_FLUSH_S, BackgroundWrites

__all__ = [
    "PURGE_FAILED",
    "PURGE_UNSUPPORTED",
    "EvictListener",
    "LoadedChunk",
    "Lookup",
    "StorageManager",
    "TierSpan",
]

logger = logging.getLogger(__name__)

DEFAULT_CALL_TIMEOUT_S = 10.0
"""Timeout of a tier call when the tier declares none: even a local disk can hang."""
WRITE_WAIT_S = 5.0
"""Default of ``write_wait_s``: how long a store waits for room in a full write queue
(or for a slab pending writes hold) while no write lands (``LMTierConfig.write_wait_s``)."""
ABANDONED_WAIT_S = 2.0
"""How long :meth:`StorageManager.close` waits for abandoned calls to finish their I/O."""

EvictListener = Callable[[ChunkKey], None]
"""Told the key of a chunk the CPU tier evicted; runs inside the eviction, under the
manager's lock, in the thread that caused it (the loop's, or one storing), so it must
be quick, thread-safe, and must not call back into the manager."""


class StorageManager:
    """Ordered tiers behind one lookup/get/put interface. See the module docstring.

    ``check`` says what a served chunk must be (default: the chunk asked for, any
    geometry, no MAC). ``purge_timeout_s`` is the deadline of one tier's purge.
    ``write_wait_s``: how long a store waits for room with no write landing (0: never
    waits; :mod:`lmtier.storage.room`).
    """

    def __init__(
        self,
        cpu_tier: CPUTier,
        tiers: Sequence[Tier] = (),
        *,
        call_timeout_s: float | None = None,
        breaker_factory: Callable[[], CircuitBreaker] = CircuitBreaker,
        check: ChunkCheck | None = None,
        purge_timeout_s: float = PURGE_TIMEOUT_S,
        write_wait_s: float = WRITE_WAIT_S,
    ) -> None:
        names = [cpu_tier.name, *(tier.name for tier in tiers)]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self.cpu_tier = cpu_tier
        self.tiers = list(tiers)
        self.call_timeout_s = call_timeout_s or DEFAULT_CALL_TIMEOUT_S
        self.check = check or ChunkCheck()
        self.purge_timeout_s = purge_timeout_s
        self.write_wait_s = write_wait_s
        self.guards = {
            t.name: TierGuard(t, self._timeout(t), breaker_factory()) for t in self.tiers
        }
        sign = self.check.mac.sign if self.check.mac is not None else None
        self.lock = threading.RLock()
        """Guards host-memory state (module docstring); re-entrant, since an eviction
        inside a put queues a write-back."""
        self.barriers = PurgeBarriers()
        """Namespaces being purged, and since when (:mod:`lmtier.storage.barriers`)."""
        self.writes = BackgroundWrites(
            cpu_tier,
            [g for g in self.guards.values() if g.tier.properties.write_policy != "none"],
            Sealer(sign),
            lock=self.lock,
            barriers=self.barriers,
        )
        self.breakers = {name: guard.breaker for name, guard in self.guards.items()}
        self._write_back = [t for t in self.tiers if t.properties.write_policy == "write_back"]
        self._write_through = [
            t for t in self.tiers if t.properties.write_policy == "write_through"
        ]
        self._evict_listeners: list[EvictListener] = []
        cpu_tier.on_evict = self._on_evict
        self.events = TierEvents()  # what each tier gains and loses
        for tier in (cpu_tier, *self.tiers):
            tier.events = self.events
        self._closed = False
        self.reads = Reads(
            cpu_tier,
            self.tiers,
            self.guards,
            self.check,
            lock=self.lock,
            writes=self.writes,
            barriers=self.barriers,
            acquire=self.acquire_slabs,
        )

    async def start(self) -> None:
        """Start one background writer per byte tier. Call once, on the runtime's loop."""
        self.reads.start()
        self.writes.start()

    def _timeout(self, tier: Tier) -> float:
        return tier.properties.timeout_s or self.call_timeout_s

    @property
    def _chunk_bytes(self) -> int:
        return self.cpu_tier.pool.slab_bytes

    # ---- lookup -----------------------------------------------------------------

    async def lookup(self, keys: Sequence[ChunkKey]) -> Lookup:
        """How many leading chunks of ``keys`` some tier holds, and which tier serves each."""
        started = time.perf_counter()
        walk = Walk(keys, self.cpu_tier)
        for tier in self.tiers:
            if walk.done:
                break
            walk.add(tier.name, await self._contains(tier, walk.rest))
        self.cpu_tier.stats.lookup_latency.record(time.perf_counter() - started)
        return walk.result()

    def lookup_now(self, keys: Sequence[ChunkKey]) -> Lookup | None:
        """:meth:`lookup` from any thread without I/O, when every tier it must ask can
        answer from memory (``Tier.contains_now``); None when some tier cannot."""
        walk, complete = self._walk_now(keys)
        return walk.result() if complete else None

    def lookup_local(self, keys: Sequence[ChunkKey]) -> Lookup:
        """The leading chunks found without I/O, from any thread: the CPU tier, then the
        tiers that answer from memory, up to the first that would need I/O. For a store,
        which must never wait on a remote tier to learn what it may skip."""
        walk, _ = self._walk_now(keys)
        return walk.result()

    def _walk_now(self, keys: Sequence[ChunkKey]) -> tuple[Walk, bool]:
        walk = Walk(keys, self.cpu_tier)
        for tier in self.tiers:
            if walk.done:
                break
            started = time.perf_counter()
            count = tier.contains_now(walk.rest)
            if count is None:
                return walk, False
            tier.stats.lookup_latency.record(time.perf_counter() - started)
            walk.add(tier.name, count)
        return walk, True

    async def _contains(self, tier: Tier, keys: Sequence[ChunkKey]) -> int:
        started = time.perf_counter()
        count, _ = await self.guards[tier.name].call(
            "contains", lambda: tier.contains(keys), num_keys=len(keys)
        )
        tier.stats.lookup_latency.record(time.perf_counter() - started)
        return 0 if count is None else max(0, min(count, len(keys)))

    # ---- get --------------------------------------------------------------------

    async def get(
        self, keys: Sequence[ChunkKey], lookup: Lookup | None = None
    ) -> list[LoadedChunk]:
        """Load the leading chunks of ``keys`` that can be served, in order
        (:meth:`lmtier.storage.reads.Reads.get`)."""
        return await self.reads.get(keys, lookup)

    def acquire_slabs(
        self, count: int, count_drops: bool = False, *, wait: bool = False
    ) -> list[SlabHandle]:
        """Up to ``count`` free slabs, evicting idle cached chunks; fewer when readers
        and writes in flight hold the rest (with ``count_drops``, the shortfall is
        counted in the CPU tier's ``queue_drops``: chunks a store could not keep).
        With ``wait`` (a store, off the loop), a shortfall first waits for writes to
        give slabs back while they keep landing, up to ``write_wait_s`` without one.
        Any thread."""
        stall_s = self.write_wait_s if wait and self.writes.may_wait() else 0.0
        handles = take_slabs(self.cpu_tier, self.writes.room, count, stall_s)
        return self._counted(count, handles, count_drops)

    async def acquire_slabs_async(self, count: int) -> list[SlabHandle]:
        """:meth:`acquire_slabs` with ``wait`` and ``count_drops``, for a coroutine on
        the loop (the sidecar's stores): it waits without blocking the loop."""
        handles = await take_slabs_async(
            self.cpu_tier, self.writes.room, count, self.write_wait_s, lambda: self._closed
        )
        return self._counted(count, handles, True)

    def _counted(self, count: int, handles: list[SlabHandle], drops: bool) -> list[SlabHandle]:
        """``handles`` in address order (chunks a store writes into them load as one run:
        ``LoadResult.kv`` copies evenly spaced slabs in one piece); the shortfall counted."""
        if drops and len(handles) < count:
            with self.lock:
                self.cpu_tier.stats.queue_drops += count - len(handles)
        return sorted(handles, key=attrgetter("index"))

    async def room_for_store(self) -> bool:
        """On the loop: wait, without blocking it, until every write-through tier's queue
        has room for a store's chunk (:meth:`put` with ``wait``, for coroutines); False
        when it gave up (``write_wait_s`` with no write landing)."""
        return await self.writes.room_for(self._write_through, self.write_wait_s)

    # ---- put --------------------------------------------------------------------

    def put(self, key: ChunkKey, handle: SlabHandle, size: int, *, wait: bool = False) -> bool:
        """Store a chunk encoded in ``handle``'s slab; takes ownership of that lease.

        The CPU tier adopts it now; write-through tiers get it in the background.
        Returns whether every write-through tier's queue took it: False when a full
        queue dropped it for some tier (counted there in ``queue_drops``), so that a
        caller never reports as stored a chunk that a tier will not receive, and when a
        purge of its namespace is running (it is not stored at all). With ``wait`` (a
        store, off the loop), a full queue is first waited for while writes keep
        landing, up to ``write_wait_s`` without one (:mod:`lmtier.storage.room`).
        Any thread.
        """
        with self.lock:
            while True:  # the lock is let go while waiting: look again after each wait
                if self._closed:
                    handle.release()
                    raise CacheClosedError("put on a closed StorageManager")
                if self.barriers.purging(key):
                    handle.release()
                    return False
                if key in self.cpu_tier:  # stored before: its writes were queued then
                    return self.cpu_tier.adopt(key, handle, size)  # recency; the lease goes
                if not wait or not self.writes.blocking(self._write_through):
                    break
                # True: room appeared, look again; False: gave up (the full queues
                # drop it, and count it).
                wait = self.writes.wait_for_room(self._write_through, self.write_wait_s)
            queued = True
            for tier in self._write_through:
                queued = self.writes.enqueue(tier, key, handle, size) and queued
            self.cpu_tier.adopt(key, handle, size)
            return queued

    def put_many(
        self, encoded: Sequence[tuple[ChunkKey, SlabHandle, int]], *, wait: bool = False
    ) -> int:
        """:meth:`put` each ``(key, lease, encoded length)``; how many every tier took.
        Any thread; a lease not put (the manager closed meanwhile) is released."""
        stored = 0
        with self.lock:
            for at, (key, handle, size) in enumerate(encoded):
                try:
                    stored += self.put(key, handle, size, wait=wait)
                except CacheClosedError:
                    for _, rest, _ in encoded[at + 1 :]:
                        rest.release()
                    raise
        return stored

    def add_evict_listener(self, callback: EvictListener) -> None:
        """Call ``callback(key)`` for every chunk the CPU tier evicts from now on, in
        eviction order, under :attr:`lock`, in the thread that caused the eviction
        (see :data:`EvictListener`). Any thread.

        A listener that raises is logged and ignored: it never breaks an eviction.
        """
        with self.lock:
            self._evict_listeners.append(callback)

    def remove_evict_listener(self, callback: EvictListener) -> None:
        """Stop calling ``callback``; a callback never added is ignored. Any thread."""
        with self.lock:
            if callback in self._evict_listeners:
                self._evict_listeners.remove(callback)

    def _on_evict(self, key: ChunkKey, handle: SlabHandle, size: int) -> None:
        for tier in self._write_back:
            self.writes.enqueue(tier, key, handle, size)
        handle.release()
        self._tell_listeners(key)

    def _tell_listeners(self, key: ChunkKey) -> None:
        for listener in tuple(self._evict_listeners):
            try:
                listener(key)
            except Exception:
                logger.exception("evict listener %r failed on %s", listener, key)

    # ---- purge ------------------------------------------------------------------

    async def purge(self, namespace: bytes) -> dict[str, int]:
        """Delete every chunk of one namespace (keys starting with the 16-byte digest
        ``namespace``, e.g. ``Namespace.digest``) from every tier, fastest first; per
        tier name, how many chunks went, or :data:`PURGE_FAILED` (the tier failed,
        timed out or its breaker was open: it may have deleted some) or
        :data:`PURGE_UNSUPPORTED` (it cannot list its chunks; skipped). Never raises
        for a tier's failure. On the runtime's loop.

        The CPU tier drops the namespace's chunks at once (a reader's slab is freed when
        it lets go; evict listeners are told each key). Then each lower tier in order:
        a background write of the namespace already being sent to it is waited for
        (up to ``PURGE_SETTLE_S``), then the tier purges through its guard (breaker, a
        deadline of ``purge_timeout_s``, abandoned if it stalls). Writes queued before
        the purge are dropped, and while it runs the namespace's stores are refused and
        its chunks are not promoted (:mod:`lmtier.storage.purging`): when it returns,
        no chunk of the namespace stored before it is left in a tier that answered.
        InvalidRequestError unless ``namespace`` is 16 bytes; CacheClosedError after
        :meth:`close`.
        """
        namespace = check_namespace(namespace)
        with self.lock:
            if self._closed:
                raise CacheClosedError("purge on a closed StorageManager")
            self.barriers.begin(namespace)
        try:
            with self.lock:
                keys = self.cpu_tier.discard_namespace(namespace)
                self.cpu_tier.stats.purged += len(keys)
                for key in keys:
                    self._tell_listeners(key)
            purged = {self.cpu_tier.name: len(keys)}
            for tier in self.tiers:
                purged[tier.name] = await purge_tier(
                    self.guards[tier.name], self.writes, namespace, self.purge_timeout_s
                )
                if purged[tier.name] != PURGE_UNSUPPORTED:  # (a failure may delete some)
                    self.events.emit("cleared", tier.name, namespace=namespace)
        finally:
            with self.lock:
                self.barriers.end(namespace)
        logger.info("purged namespace %s: %s", namespace.hex(), purged)
        return purged

    async def count_namespace(self, namespace: bytes) -> dict[str, int]:
        """A purge's dry run: per tier name, how many chunks of ``namespace`` it holds,
        or :data:`PURGE_FAILED` / :data:`PURGE_UNSUPPORTED` as :meth:`purge` says."""
        namespace = check_namespace(namespace)
        with self.lock:
            counts = {self.cpu_tier.name: await self.cpu_tier.count_namespace(namespace)}
        for tier in self.tiers:

            async def call(tier: Tier = tier) -> int:
                try:
                    return await tier.count_namespace(namespace)
                except NotSupportedError:
                    return PURGE_UNSUPPORTED

            found, _ = await self.guards[tier.name].call(
                "count", call, deadline_s=self.purge_timeout_s
            )
            counts[tier.name] = PURGE_FAILED if found is None else found
        return counts

    # ---- pins -------------------------------------------------------------------

    async def pin(self, keys: Sequence[ChunkKey]) -> dict[str, int]:
        """Exempt the chunks of ``keys`` from eviction in every tier that pins (host
        memory, disk: :mod:`lmtier.storage.pins`), within each one's pin cap; per tier
        name, how many of ``keys`` it has pinned now, or :data:`PURGE_FAILED` when it
        failed. Pin after the background writes landed (:meth:`flush`). On the loop."""
        return await self._each_pinning(lambda tier: tier.pin(keys), len(keys))

    async def unpin(self, keys: Sequence[ChunkKey] | None = None) -> dict[str, int]:
        """Make these chunks (None: every pinned one) evictable again in every tier that
        pins; per tier name, how many were pinned (or :data:`PURGE_FAILED`)."""
        return await self._each_pinning(lambda tier: tier.unpin(keys), len(keys or ()))

    def pinned(self, namespace: bytes) -> list[ChunkKey]:
        """The keys of one namespace (16-byte digest) pinned in any tier."""
        tiers = [self.cpu_tier, *self.tiers]
        keys = {k for t in tiers if t.pins is not None for k in t.pins.snapshot()}
        return [key for key in keys if key.startswith(namespace)]

    async def _each_pinning(
        self, call: Callable[[Tier], Awaitable[int]], num_keys: int
    ) -> dict[str, int]:
        with self.lock:
            if self._closed:
                raise CacheClosedError("pin on a closed StorageManager")
            done = {self.cpu_tier.name: await call(self.cpu_tier)}  # in memory: no I/O
        for tier in self.tiers:
            if tier.pins is not None:
                run = functools.partial(call, tier)
                count, _ = await self.guards[tier.name].call("pin", run, num_keys=num_keys)
                done[tier.name] = PURGE_FAILED if count is None else count
        return done

    # ---- lifecycle --------------------------------------------------------------

    async def flush(self) -> None:
        """Wait until every queued background write has been attempted."""
        await self.writes.flush()

    async def close(self, flush_s: float = CLOSE_FLUSH_S) -> None:
        """Flush (up to ``flush_s``) and stop the background writes
        (:meth:`BackgroundWrites.close`), let abandoned calls finish their I/O (up to
        ``ABANDONED_WAIT_S``), close every tier. Idempotent."""
        if self._closed:
            return
        await self.writes.close(flush_s)
        with self.lock:
            self._closed = True
            self.cpu_tier.discard(list(self.cpu_tier.keys()))
        abandoned = {task for guard in self.guards.values() for task in guard.abandoned}
        if abandoned:
            await asyncio.wait(abandoned, timeout=ABANDONED_WAIT_S)
        for tier in [self.cpu_tier, *self.tiers]:
            try:
                await tier.close()
            except Exception:
                logger.exception("%s: close failed", tier.name)
        self.reads.close()

    def stats(self) -> dict[str, dict[str, object]]:
        """Per-tier counters, fastest tier first, plus queue depths and batch sizes."""
        out: dict[str, dict[str, object]] = {}
        for tier in [self.cpu_tier, *self.tiers]:
            entry: dict[str, object] = {**tier.usage(), **tier.stats.as_dict()}
            if (depth := self.writes.depth(tier)) is not None:
                entry["queue_depth"] = depth
            if (breaker := self.breakers.get(tier.name)) is not None:
                entry.update(breaker=breaker.state.value, breaker_opens=breaker.opens)
            if (pacer := self.reads.pacers.get(tier.name)) is not None:
                entry["read_batch"] = pacer.size(self._chunk_bytes, MAX_CHUNKS)
                entry["abandoned_in_flight"] = len(self.guards[tier.name].abandoned)
            out[tier.name] = entry
        return out
