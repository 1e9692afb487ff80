"""The StorageManager: waterfall lookup, loads with promotion, background write-down.

Tiers are ordered fastest first: the CPU tier (host-pool slabs), then byte tiers
such as disk, Redis and S3. The manager never branches on a tier's name or class;
what differs between tiers is in their :class:`~lmtier.tier.TierProperties`.

* **lookup** asks the CPU tier how many leading chunks it holds, asks the next tier
  only about the rest, and so on: one batched call per tier, and a tier that fails
  or times out answers 0 (a miss), never an error.
* **get** serves CPU hits zero-copy (another lease on the cached slab), reads lower
  hits straight into fresh pool slabs, and promotes them: the CPU tier adopts the
  slab (no copy) and the byte tiers above the one that served it get the chunk in
  the background. It stops at the first chunk that cannot be served.
* **put** lands in the CPU tier synchronously and goes to each ``write_through``
  tier through a bounded queue; ``write_back`` tiers get chunks the CPU tier evicts.
  A full queue drops the write and counts it: inference never waits on storage.
* **evict listeners** (:meth:`StorageManager.add_evict_listener`) are told the key of
  every chunk the CPU tier evicts, after the write-back is queued (the chunk may still
  be in a lower tier); an engine integration uses it to announce removals.
* **failures**: every call to a byte tier goes through :meth:`StorageManager._guarded`:
  a timeout (the tier's ``timeout_s``, else the manager's default), an exception
  turned into a miss and a counter, and a per-tier :class:`~lmtier.breaker.CircuitBreaker`
  that turns a dead tier into a fast miss until a probe succeeds.

All methods run on the runtime's event loop (see :mod:`lmtier.runtime`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from lmtier.breaker import CircuitBreaker
from lmtier.chunk_format import DecodedChunk, decode
from lmtier.cpu_tier import CPUTier
from lmtier.errors import HandleError
from lmtier.keys import ChunkKey
from lmtier.memory import SlabHandle
from lmtier.tier import Tier

__all__ = ["EvictListener", "LoadedChunk", "Lookup", "StorageManager", "TierSpan"]

logger = logging.getLogger(__name__)

_WRITE_BATCH = 16
"""Queued chunks a writer hands its tier per call: batches amortise round trips."""

DEFAULT_CALL_TIMEOUT_S = 10.0
"""Timeout of a tier call when the tier declares none: even a local disk can hang."""

T = TypeVar("T")

EvictListener = Callable[[ChunkKey], None]
"""Told the key of a chunk the CPU tier evicted; runs on the runtime's loop thread,
inside the eviction, so it must be quick and must not call back into the manager."""


@dataclass(frozen=True, slots=True)
class TierSpan:
    """Chunks ``[start, stop)`` of a lookup are served by the tier ``tier``."""

    tier: str
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Lookup:
    """Result of a waterfall lookup: how many leading chunks hit, and who serves them."""

    num_chunks: int
    spans: tuple[TierSpan, ...]

    def tier_of(self, index: int) -> str | None:
        """Name of the tier that serves chunk ``index``, or None past the hit prefix."""
        for span in self.spans:
            if span.start <= index < span.stop:
                return span.tier
        return None


@dataclass(slots=True)
class LoadedChunk:
    """A loaded chunk: a lease on the pool slab holding it, decoded in place.

    Release it (or use it as a context manager) once its payload has been copied
    where it is needed; until then its slab is never reused or evicted.
    """

    key: ChunkKey
    tier: str
    chunk: DecodedChunk
    handle: SlabHandle = field(repr=False)

    def release(self) -> None:
        """Give the slab back. Releasing twice raises HandleError."""
        self.handle.release()

    def __enter__(self) -> LoadedChunk:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self.handle.released:
            self.release()


class _Walk:
    """One waterfall walk: the CPU tier's leading hits, then each tier's on the rest."""

    __slots__ = ("found", "keys", "spans")

    def __init__(self, keys: Sequence[ChunkKey], memory: CPUTier) -> None:
        self.keys = keys
        self.found = memory.count_prefix(keys)
        self.spans = [TierSpan(memory.name, 0, self.found)] if self.found else []

    @property
    def done(self) -> bool:
        return self.found == len(self.keys)

    @property
    def rest(self) -> Sequence[ChunkKey]:
        """The keys no tier asked so far holds: the next tier is asked about these only."""
        return self.keys[self.found :]

    def add(self, tier: str, count: int) -> None:
        if count:
            self.spans.append(TierSpan(tier, self.found, self.found + count))
            self.found += count

    def result(self) -> Lookup:
        return Lookup(self.found, tuple(self.spans))


@dataclass(slots=True)
class _Write:
    key: ChunkKey
    handle: SlabHandle
    size: int


class StorageManager:
    """Ordered tiers behind one lookup/get/put interface. See the module docstring."""

    def __init__(
        self,
        memory: CPUTier,
        tiers: Sequence[Tier] = (),
        *,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        breaker_factory: Callable[[], CircuitBreaker] = CircuitBreaker,
    ) -> None:
        names = [memory.name, *(tier.name for tier in tiers)]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self.memory = memory
        self.tiers = list(tiers)
        self.call_timeout_s = call_timeout_s
        self.breakers = {tier.name: breaker_factory() for tier in self.tiers}
        self._queues: dict[str, asyncio.Queue[_Write]] = {}
        self._writers: list[asyncio.Task[None]] = []
        self._write_back = [t for t in self.tiers if t.properties.write_policy == "write_back"]
        self._evict_listeners: list[EvictListener] = []
        memory.on_evict = self._on_evict
        self._closed = False

    async def start(self) -> None:
        """Start one background writer per byte tier. Call once, on the runtime's loop."""
        for tier in self.tiers:
            queue: asyncio.Queue[_Write] = asyncio.Queue(maxsize=tier.properties.queue_depth)
            self._queues[tier.name] = queue
            self._writers.append(
                asyncio.create_task(self._writer(tier, queue), name=f"lmtier-writer-{tier.name}")
            )

    # ---- lookup -----------------------------------------------------------------

    async def lookup(self, keys: Sequence[ChunkKey]) -> Lookup:
        """How many leading chunks of ``keys`` some tier holds, and which tier serves each."""
        started = time.perf_counter()
        walk = _Walk(keys, self.memory)
        for tier in self.tiers:
            if walk.done:
                break
            walk.add(tier.name, await self._contains(tier, walk.rest))
        self.memory.stats.lookup_latency.record(time.perf_counter() - started)
        return walk.result()

    def lookup_now(self, keys: Sequence[ChunkKey]) -> Lookup | None:
        """:meth:`lookup` from any thread without I/O, when every tier it must ask can
        answer from memory (``Tier.contains_now``); None when some tier cannot."""
        walk = _Walk(keys, self.memory)
        for tier in self.tiers:
            if walk.done:
                break
            started = time.perf_counter()
            count = tier.contains_now(walk.rest)
            if count is None:
                return None
            tier.stats.lookup_latency.record(time.perf_counter() - started)
            walk.add(tier.name, count)
        return walk.result()

    async def _contains(self, tier: Tier, keys: Sequence[ChunkKey]) -> int:
        started = time.perf_counter()
        count = await self._guarded(tier, "contains", lambda: tier.contains(keys))
        tier.stats.lookup_latency.record(time.perf_counter() - started)
        return 0 if count is None else max(0, min(count, len(keys)))

    async def _guarded(self, tier: Tier, what: str, call: Callable[[], Awaitable[T]]) -> T | None:
        """Run one tier call under its breaker and timeout; None means "count it a miss"."""
        breaker = self.breakers[tier.name]
        if not breaker.allow():
            tier.stats.skipped += 1
            return None
        timeout = tier.properties.timeout_s or self.call_timeout_s
        try:
            result = await asyncio.wait_for(call(), timeout)
        except Exception as exc:  # a failing tier is a miss, never a failed request
            breaker.record_failure()
            tier.stats.errors += 1
            logger.debug("%s: %s failed: %r", tier.name, what, exc)
            return None
        breaker.record_success()
        return result

    # ---- get --------------------------------------------------------------------

    async def get(
        self, keys: Sequence[ChunkKey], lookup: Lookup | None = None
    ) -> list[LoadedChunk]:
        """Load the leading chunks of ``keys`` that can be served, in order.

        The result may be shorter than ``lookup.num_chunks`` when a chunk vanished or
        failed validation since the lookup; it never has a gap.
        """
        lookup = lookup if lookup is not None else await self.lookup(keys)
        loaded: list[LoadedChunk] = []
        for span in lookup.spans:
            span_keys = keys[span.start : span.stop]
            if span.tier == self.memory.name:
                chunks = self._get_from_memory(span_keys)
            else:
                chunks = await self._get_from_tier(self._tier(span.tier), span_keys)
            loaded.extend(chunks)
            if len(chunks) < len(span_keys):
                break
        return loaded

    def _get_from_memory(self, keys: Sequence[ChunkKey]) -> list[LoadedChunk]:
        chunks: list[LoadedChunk] = []
        for key in keys:
            shared = self.memory.share(key)
            if shared is None:
                break
            handle, size = shared
            chunks.append(
                LoadedChunk(key, self.memory.name, decode(handle.view[:size], verify=False), handle)
            )
        return chunks

    async def _get_from_tier(self, tier: Tier, keys: Sequence[ChunkKey]) -> list[LoadedChunk]:
        handles: list[SlabHandle] = []
        for _ in keys:
            handle = self.memory.acquire_slab()
            if handle is None:
                break  # every slab is in use by readers: serve what fits
            handles.append(handle)
        started = time.perf_counter()
        got = await self._guarded(
            tier, "get", lambda: tier.get_into(keys[: len(handles)], [h.view for h in handles])
        )
        sizes: list[int | None] = [None] * len(handles) if got is None else got
        tier.stats.read_latency.record(time.perf_counter() - started)
        chunks: list[LoadedChunk] = []
        missed = False
        for key, handle, size in zip(keys[: len(handles)], handles, sizes, strict=True):
            if missed or size is None:
                missed = True  # no gaps: everything after a miss is dropped too
                handle.release()
                continue
            chunk = LoadedChunk(key, tier.name, decode(handle.view[:size], verify=False), handle)
            chunks.append(chunk)
            self._promote(tier, key, handle, size)
        return chunks

    def _promote(self, source: Tier, key: ChunkKey, handle: SlabHandle, size: int) -> None:
        self.memory.adopt(key, handle.share(), size)
        for tier in self.tiers:
            if tier is source:
                break
            self._enqueue(tier, key, handle, size)

    # ---- put --------------------------------------------------------------------

    def put(self, key: ChunkKey, handle: SlabHandle, size: int) -> None:
        """Store a chunk encoded in ``handle``'s slab; takes ownership of that lease.

        The CPU tier adopts it now; write-through tiers get it in the background.
        """
        if self._closed:
            handle.release()
            raise HandleError("put on a closed StorageManager")
        for tier in self.tiers:
            if tier.properties.write_policy == "write_through":
                self._enqueue(tier, key, handle, size)
        self.memory.adopt(key, handle, size)

    def add_evict_listener(self, callback: EvictListener) -> None:
        """Call ``callback(key)`` for every chunk the CPU tier evicts from now on, in
        eviction order, on the runtime's loop thread (see :data:`EvictListener`).

        A listener that raises is logged and ignored: it never breaks an eviction.
        Call on the loop thread (:meth:`lmtier.api.LMTier.add_evict_listener` does).
        """
        self._evict_listeners.append(callback)

    def remove_evict_listener(self, callback: EvictListener) -> None:
        """Stop calling ``callback``; a callback never added is ignored."""
        if callback in self._evict_listeners:
            self._evict_listeners.remove(callback)

    def _on_evict(self, key: ChunkKey, handle: SlabHandle, size: int) -> None:
        for tier in self._write_back:
            self._enqueue(tier, key, handle, size)
        handle.release()
        for listener in tuple(self._evict_listeners):
            try:
                listener(key)
            except Exception:
                logger.exception("evict listener %r failed on %s", listener, key)

    def _enqueue(self, tier: Tier, key: ChunkKey, handle: SlabHandle, size: int) -> None:
        queue = self._queues.get(tier.name)
        if queue is None or self._closed:
            return
        if queue.full():
            tier.stats.queue_drops += 1
            return
        queue.put_nowait(_Write(key, self.memory.share_for_write(handle), size))

    async def _writer(self, tier: Tier, queue: asyncio.Queue[_Write]) -> None:
        while True:
            batch = [await queue.get()]
            while len(batch) < _WRITE_BATCH and not queue.empty():
                batch.append(queue.get_nowait())
            started = time.perf_counter()
            items = [(w.key, w.handle.view[: w.size]) for w in batch]
            try:
                # A failed or skipped write is dropped and counted by _guarded; the
                # chunk stays in the tiers above.
                await self._guarded(tier, "put", lambda: tier.put(items))  # noqa: B023
            finally:
                tier.stats.write_latency.record(time.perf_counter() - started)
                for write in batch:
                    self.memory.release_write(write.handle)
                    queue.task_done()

    # ---- lifecycle --------------------------------------------------------------

    async def flush(self) -> None:
        """Wait until every queued background write has been attempted."""
        await asyncio.gather(*(queue.join() for queue in self._queues.values()))

    async def close(self) -> None:
        """Flush queued writes, stop the writers, close every tier. Idempotent."""
        if self._closed:
            return
        await self.flush()
        self._closed = True
        for task in self._writers:
            task.cancel()
        await asyncio.gather(*self._writers, return_exceptions=True)
        self._writers.clear()
        for tier in [self.memory, *self.tiers]:
            try:
                await tier.close()
            except Exception:
                logger.exception("%s: close failed", tier.name)

    def _tier(self, name: str) -> Tier:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(name)

    def stats(self) -> dict[str, dict[str, object]]:
        """Per-tier counters, fastest tier first, plus queue depths."""
        out: dict[str, dict[str, object]] = {}
        for tier in [self.memory, *self.tiers]:
            entry: dict[str, object] = dict(tier.stats.as_dict())
            queue = self._queues.get(tier.name)
            if queue is not None:
                entry["queue_depth"] = queue.qsize()
            breaker = self.breakers.get(tier.name)
            if breaker is not None:
                entry["breaker"] = breaker.state.value
                entry["breaker_opens"] = breaker.opens
            out[tier.name] = entry
        return out
