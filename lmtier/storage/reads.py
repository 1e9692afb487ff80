"""Loads for the StorageManager: host-memory hits shared, lower tiers read in paced
batches, every chunk checked, and what lower tiers served promoted.

* Host-memory hits are shared zero-copy (another lease on the cached slab) after a
  header check (key, geometry).
* A load given no lookup does not make one (:meth:`Reads.get`): it reads each tier
  directly for the keys the tiers above did not serve (a miss answers as a lookup
  would), so a remote tier costs one round trip per batch, not a lookup's and then a
  read's. A tier with an in-memory index is read only for what it says it holds.
* Reads go to a tier in batches sized by :mod:`lmtier.storage.pacing`, one after
  another, so that a slow but healthy tier serves a long prompt batch by batch
  instead of timing out whole; each batch's deadline grows with its bytes
  (:mod:`lmtier.storage.budget`). A load stops at the first chunk that cannot be
  served: the result never has a gap.
* Checks (:class:`~lmtier.storage.check.ChunkCheck`): every chunk served must be the
  chunk asked for, of the cache's geometry, and authentic when it comes from a shared
  tier and an integrity key is set; one that is not is deleted from its tier, counted
  in ``corrupt``, and the load stops there.
* Promotion: the CPU tier adopts the slab a lower tier was read into (no copy), and
  the byte tiers above the one that served it get the chunk in the background; not
  when a purge of its namespace began since the read did (:mod:`lmtier.storage.purging`):
  the chunk is served, not cached again.
* A read that times out is abandoned, not awaited; the slabs it was given stay out of
  the pool (its own leases) until its task ends (:mod:`lmtier.storage.guard`).

Loop-only, like the rest of the StorageManager, but for a store (see its module)
and a load that host memory serves whole (:meth:`Reads.get_now`: any thread).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from lmtier.chunks.format import DecodedChunk
from lmtier.chunks.keys import ChunkKey
from lmtier.storage.blocking import run_blocking
from lmtier.storage.host_pool import SlabHandle
from lmtier.storage.lookup import LoadedChunk, Lookup
from lmtier.storage.pacing import BatchPacer
from lmtier.storage.tier import Tier

if TYPE_CHECKING:
    import threading

    from lmtier.storage.barriers import PurgeBarriers
    from lmtier.storage.check import ChunkCheck
    from lmtier.storage.cpu_tier import CPUTier
    from lmtier.storage.guard import TierGuard
    from lmtier.storage.writes import BackgroundWrites

__all__ = ["SPECULATIVE_FIRST", "Reads"]

logger = logging.getLogger(__name__)

SPECULATIVE_FIRST = 1
"""Chunks in the first read of a tier asked without a lookup (see ``_get_walking``)."""


def _release_all(handles: Sequence[SlabHandle]) -> None:
    for handle in handles:
        handle.release()


class Reads:
    """The read side of one :class:`~lmtier.storage.manager.StorageManager` (module
    docstring). The manager hands over what it shares with it: its CPU tier, its
    lower tiers and their guards, the chunk checks, its lock, its background writes
    (promotions), its purge barriers and how to acquire slabs (``acquire(n)``: the
    manager's, which evicts for room)."""

    def __init__(
        self,
        cpu_tier: CPUTier,
        tiers: Sequence[Tier],
        guards: Mapping[str, TierGuard],
        check: ChunkCheck,
        *,
        lock: threading.RLock,
        writes: BackgroundWrites,
        barriers: PurgeBarriers,
        acquire: Callable[[int], list[SlabHandle]],
    ) -> None:
        self.cpu_tier = cpu_tier
        self.tiers = tiers
        self.guards = guards
        self.check = check
        self.lock = lock
        self.writes = writes
        self.barriers = barriers
        self._acquire = acquire
        self.pacers = {t.name: BatchPacer(self.guards[t.name].budget) for t in self.tiers}
        self._verifier: ThreadPoolExecutor | None = None

    def start(self) -> None:
        """Start the MAC-checking threads when chunks from shared tiers need them."""
        if self.check.mac is not None and any(t.properties.shared for t in self.tiers):
            self._verifier = ThreadPoolExecutor(2, thread_name_prefix="lmtier-verify")

    def close(self) -> None:
        """Stop the MAC-checking threads."""
        if self._verifier is not None:
            self._verifier.shutdown(wait=False, cancel_futures=True)

    @property
    def _chunk_bytes(self) -> int:
        return self.cpu_tier.pool.slab_bytes

    def _tier(self, name: str) -> Tier:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(name)

    async def get(
        self, keys: Sequence[ChunkKey], lookup: Lookup | None = None
    ) -> list[LoadedChunk]:
        """Load the leading chunks of ``keys`` that can be served, in order.

        With the ``lookup`` just made for these keys, each span is read from the tier
        it names. Without one, the load is its own walk (:meth:`_get_walking`): no
        lookup round trips before the reads. The result may be shorter than a lookup
        said when a chunk vanished, failed a check, or its tier was too slow since;
        it never has a gap.
        """
        loaded: list[LoadedChunk] = []
        try:
            if lookup is None:
                await self._get_walking(keys, loaded)
                return loaded
            for span in lookup.spans:
                span_keys = keys[span.start : span.stop]
                if span.tier == self.cpu_tier.name:
                    chunks = await self._get_from_memory(span_keys)
                else:
                    chunks = await self._get_from_tier(self._tier(span.tier), span_keys)
                loaded.extend(chunks)
                if len(chunks) < len(span_keys):
                    break
        except BaseException:
            for chunk in loaded:
                chunk.release()
            raise
        return loaded

    async def _get_walking(self, keys: Sequence[ChunkKey], loaded: list[LoadedChunk]) -> None:
        """The waterfall as reads: each tier serves what it can of the keys the tiers
        above did not, from the first on; the next tier gets the rest.

        A tier with an in-memory index (``contains_now``) is read only for the keys it
        says it holds, and skipped without I/O when it holds none. Any other tier is
        read directly, a miss answering as a lookup would (a GET costs what a HEAD or
        EXISTS does, and a hit needs the GET anyway): one round trip per batch instead
        of a lookup's plus the read's. Its first batch is small
        (``SPECULATIVE_FIRST``), so a tier that holds none of the keys costs one
        request and one slab, not a batch of them.
        """
        loaded.extend(await self._get_from_memory(keys))
        for tier in self.tiers:
            rest = keys[len(loaded) :]
            if not rest:
                return
            known = tier.contains_now(rest)
            if known == 0:
                continue
            if known is not None:
                chunks = await self._get_from_tier(tier, rest[:known])
            else:
                chunks = await self._get_from_tier(tier, rest, first=SPECULATIVE_FIRST)
            loaded.extend(chunks)

    def get_now(
        self, keys: Sequence[ChunkKey], lookup: Lookup | None = None
    ) -> list[LoadedChunk] | None:
        """:meth:`get` in the caller's thread, when host memory holds every chunk it
        would serve (all of ``keys``, or every span of ``lookup``); else None, and
        nothing leased: the loop's :meth:`get` must walk the tiers.

        Host-memory hits need no I/O and the CPU tier changes under :attr:`lock`
        only, so such a load need not cost two thread hops to the loop and back (a
        wake-up each: ~0.1 ms here, and a busy machine schedules the loop's thread
        late)."""
        if lookup is not None:
            if any(span.tier != self.cpu_tier.name for span in lookup.spans):
                return None
            keys = keys[: lookup.num_chunks]
        with self.lock:
            if not all(key in self.cpu_tier for key in keys):
                return None
            return self._memory_hits(keys)

    async def _get_from_memory(self, keys: Sequence[ChunkKey]) -> list[LoadedChunk]:
        return self._memory_hits(keys)

    def _memory_hits(self, keys: Sequence[ChunkKey]) -> list[LoadedChunk]:
        """The leading chunks of ``keys`` in host memory, each a new lease, header
        checked (any thread: under :attr:`lock`)."""
        chunks: list[LoadedChunk] = []
        with self.lock:
            for key in keys:
                shared = self.cpu_tier.share(key)
                if shared is None:
                    break
                handle, size = shared
                chunk = self.check.header(key, handle.view[:size])
                if chunk is None:  # never expected: a bug elsewhere, caught before it is served
                    handle.release()
                    self.cpu_tier.stats.corrupt += 1
                    logger.error(
                        "%s: cached chunk %s failed its check", self.cpu_tier.name, key.hex()
                    )
                    self._forget([key])
                    break
                chunks.append(LoadedChunk(key, self.cpu_tier.name, chunk, handle))
        return chunks

    def _forget(self, keys: Sequence[ChunkKey]) -> None:
        """Drop chunks from the CPU tier."""
        with self.lock:
            self.cpu_tier.discard(keys)

    async def _get_from_tier(
        self, tier: Tier, keys: Sequence[ChunkKey], *, first: int | None = None
    ) -> list[LoadedChunk]:
        """The leading chunks of ``keys`` that ``tier`` serves, read in paced batches
        (the first of at most ``first`` chunks when given)."""
        pacer = self.pacers[tier.name]
        chunks: list[LoadedChunk] = []
        while len(chunks) < len(keys):
            count = pacer.size(self._chunk_bytes, len(keys) - len(chunks))
            if first is not None and not chunks:
                count = min(count, first)
            # In address order (the StorageManager hands slabs out so), like a
            # store's: a load copies evenly spaced slabs out in one piece per run.
            handles = self._acquire(count)
            if not handles:
                break  # every slab is in use by readers: serve what fits
            batch = keys[len(chunks) : len(chunks) + len(handles)]
            served = await self._read_batch(tier, pacer, batch, handles)
            chunks.extend(served)
            if len(served) < len(batch):
                break
        return chunks

    async def _read_batch(
        self, tier: Tier, pacer: BatchPacer, keys: Sequence[ChunkKey], handles: list[SlabHandle]
    ) -> list[LoadedChunk]:
        """Read one batch into ``handles`` (taking ownership of them); the leading chunks
        that arrived and passed every check, promoted."""
        chunks: list[LoadedChunk] = []
        try:
            io_leases = [handle.share() for handle in handles]  # the call's own (docstring)
            views = [handle.view for handle in handles]
            stamp = self.barriers.epoch  # a purge begun after this: no promotion
            started = time.perf_counter()
            read, timed_out = await self.guards[tier.name].call(
                "get",
                lambda: tier.read_chunks(keys, views),
                lambda: _release_all(io_leases),
                num_bytes=len(keys) * self._chunk_bytes,
            )
            elapsed = time.perf_counter() - started
            tier.stats.read_latency.record(elapsed)
            if read is None:
                if timed_out:
                    pacer.timed_out(len(keys) * self._chunk_bytes, len(keys))
                return chunks
            sizes = [c.payload_offset + c.meta.nbytes for c in read if c is not None]
            pacer.succeeded(sum(sizes), elapsed, len(keys))
            decoded: list[DecodedChunk] = []
            for key, chunk in zip(keys, read, strict=True):
                if chunk is None or not self.check.fits(chunk):
                    if chunk is not None:
                        await self._reject(tier, [key])
                    break
                decoded.append(chunk)
            decoded = await self._authentic(tier, keys, decoded)
            for key, handle, chunk in zip(keys, handles, decoded, strict=False):
                chunks.append(LoadedChunk(key, tier.name, chunk, handle))
                size = chunk.payload_offset + chunk.meta.nbytes
                self._promote(tier, key, handle, size, stamp)
            return chunks
        finally:
            _release_all(handles[len(chunks) :])

    async def _authentic(
        self, tier: Tier, keys: Sequence[ChunkKey], decoded: list[DecodedChunk]
    ) -> list[DecodedChunk]:
        """The leading chunks of ``decoded`` with a valid MAC, where ``tier`` needs one."""
        if not decoded or not self.check.needs_mac(tier) or self._verifier is None:
            return decoded
        verdicts = await run_blocking(
            self._verifier, [(self.check.authentic, (chunk,)) for chunk in decoded]
        )
        for index, verdict in enumerate(verdicts):
            if verdict is not True:
                logger.warning("%s: chunk %s has no valid MAC", tier.name, keys[index].hex())
                await self._reject(tier, [keys[index]])
                return decoded[:index]
        return decoded

    async def _reject(self, tier: Tier, keys: Sequence[ChunkKey]) -> None:
        """Chunks that passed the tier's checks but not ours: delete and count them."""
        tier.stats.corrupt += len(keys)
        await self.guards[tier.name].call("delete", lambda: tier.delete(keys), num_keys=len(keys))

    def _promote(
        self, source: Tier, key: ChunkKey, handle: SlabHandle, size: int, stamp: int
    ) -> None:
        with self.lock:
            if self.barriers.stale(key, stamp):
                return
            self.cpu_tier.adopt(key, handle.share(), size)
            for tier in self.tiers:
                if tier is source:
                    break
                if tier.properties.write_policy != "none":
                    self.writes.enqueue(tier, key, handle, size)
