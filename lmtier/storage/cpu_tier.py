"""The CPU tier: an LRU cache of encoded chunks held in host-pool slabs.

It is the top of the host-side waterfall. Besides the byte-level :class:`Tier`
interface (which copies, and which the conformance suite checks), it offers the
StorageManager a zero-copy path: :meth:`CPUTier.share` hands out another lease on a
cached chunk's slab, and :meth:`CPUTier.adopt` takes ownership of a slab a lower tier
was just read into, so a promotion costs no copy.

Invariants, kept by every method here:

* each cached chunk owns exactly one lease on its slab; readers hold their own;
* a chunk a reader holds is never evicted: eviction skips it and moves on to the
  next least recently used;
* a pending background write (a lease taken with :meth:`CPUTier.share_for_write`)
  does not pin a chunk: it may be evicted from the index, and its slab returns to
  the pool when the write is done. Otherwise a slow lower tier would stop the CPU
  tier from caching anything new. Idle chunks are evicted before such ones, since
  only their eviction frees a slab at once;
* the bytes held never exceed ``capacity_bytes`` (counted in whole slabs);
* a pinned chunk (:mod:`lmtier.storage.pins`) is never evicted; pins take at most
  ``max_pinned_bytes`` (default: half the capacity), so eviction always has room.

Evicted chunks are handed with the tier's lease to ``on_evict`` when one is set (the
StorageManager writes them back to lower tiers), else the lease is released.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lmtier.chunks.keys import ChunkKey
from lmtier.storage.host_pool import HostPool, SlabHandle, open_host_pool
from lmtier.storage.pins import Pins
from lmtier.storage.stats import TierStats
from lmtier.storage.tier import UNSERVABLE, Buffer, Tier, TierProperties

__all__ = ["CPUTier", "EvictCallback", "open_cpu_tier"]

logger = logging.getLogger(__name__)

EvictCallback = Callable[[ChunkKey, SlabHandle, int], None]
"""Receives an evicted chunk's key, the tier's lease on its slab (now the callee's to
release) and its encoded length."""


@dataclass(slots=True)
class _Entry:
    handle: SlabHandle
    size: int


class CPUTier(Tier):
    """LRU chunk cache in pool slabs. See the module docstring for its invariants."""

    pins: Pins

    def __init__(
        self,
        pool: HostPool,
        capacity_bytes: int | None = None,
        *,
        name: str = "cpu",
        on_evict: EvictCallback | None = None,
        max_pinned_bytes: int | None = None,
    ) -> None:
        self.name = name
        self.properties = TierProperties(shared=False, verify_reads=False)
        self.stats = TierStats()
        self.pool = pool
        limit = pool.num_slabs if capacity_bytes is None else capacity_bytes // pool.slab_bytes
        self.max_chunks = min(pool.num_slabs, limit)
        capacity = self.max_chunks * pool.slab_bytes
        self.pins = Pins(capacity // 2 if max_pinned_bytes is None else max_pinned_bytes)
        self.on_evict = on_evict
        self._entries: OrderedDict[ChunkKey, _Entry] = OrderedDict()
        self._write_leases: dict[int, int] = {}
        """Slab index -> leases held by background writes (not readers)."""

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[ChunkKey]:
        """The cached keys, least recently used first (a snapshot)."""
        return list(self._entries)

    def keys_now(self) -> list[ChunkKey]:
        return self.keys()

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is cached (no stats, no recency change; any thread)."""
        return key in self._entries

    @property
    def nbytes(self) -> int:
        """Bytes held, in whole slabs."""
        return len(self._entries) * self.pool.slab_bytes

    def count_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """Synchronous ``contains``: how many leading keys are cached."""
        entries = self._entries
        count = 0
        for key in keys:
            if key not in entries:
                break
            count += 1
        self.stats.lookups += len(keys)
        return count

    def share(self, key: ChunkKey) -> tuple[SlabHandle, int] | None:
        """A new lease on a cached chunk's slab and its encoded length; refreshes recency."""
        entry = self._entries.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        self.stats.bytes_read += entry.size
        return entry.handle.share(), entry.size

    def adopt(self, key: ChunkKey, handle: SlabHandle, size: int) -> bool:
        """Cache a chunk already encoded in ``handle``'s slab, taking ownership of the lease.

        Returns False (and releases the lease) when the tier holds no chunks at all or
        every cached chunk is in use; a chunk already cached keeps its old slab.
        """
        if key in self._entries:
            handle.release()
            self._entries.move_to_end(key)
            return True
        while len(self._entries) >= self.max_chunks:
            if not self._evict_one():
                handle.release()
                return False
        self._entries[key] = _Entry(handle, size)
        if self.events is not None:
            self.events.emit("stored", self.name, (key,))
        self.stats.puts += 1
        self.stats.bytes_written += size
        return True

    def acquire_slab(self) -> SlabHandle | None:
        """A free pool slab, evicting least recently used idle chunks if needed."""
        handle = self.pool.acquire()
        while handle is None:
            if not self._evict_one():
                return None
            handle = self.pool.acquire()
        return handle

    def share_for_write(self, handle: SlabHandle) -> SlabHandle:
        """A lease for a background write: it keeps the slab alive, not the chunk cached."""
        lease = handle.share()
        self._write_leases[lease.index] = self._write_leases.get(lease.index, 0) + 1
        return lease

    def release_write(self, lease: SlabHandle) -> None:
        """Return a lease taken with :meth:`share_for_write`."""
        index = lease.index
        remaining = self._write_leases[index] - 1
        if remaining:
            self._write_leases[index] = remaining
        else:
            del self._write_leases[index]
        lease.release()

    def _evict_one(self) -> bool:
        victim = None
        pins = self.pins
        passed: list[ChunkKey] = []  # pinned keys the walk went by
        for key, entry in self._entries.items():
            if key in pins:
                passed.append(key)
                continue
            readers = entry.handle.refcount - 1 - self._write_leases.get(entry.handle.index, 0)
            if readers:
                continue
            if entry.handle.refcount == 1:  # nobody else holds the slab: it frees now
                victim = key
                break
            if victim is None:
                victim = key  # only background writes hold it: next best
        for key in passed:  # out of the next walk's way: each pin is walked past once
            self._entries.move_to_end(key)
        if victim is None:
            return False
        entry = self._entries.pop(victim)
        self.stats.evictions += 1
        self.announce_removed((victim,))
        if self.on_evict is not None:
            self.on_evict(victim, entry.handle, entry.size)
        else:
            entry.handle.release()
        return True

    async def contains(self, keys: Sequence[ChunkKey]) -> int:
        return self.count_prefix(keys)

    def contains_now(self, keys: Sequence[ChunkKey]) -> int:
        return self.count_prefix(keys)

    async def _read_into(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        sizes: list[int | None] = []
        for key, buffer in zip(keys, buffers, strict=True):
            entry = self._entries.get(key)
            if entry is None:
                sizes.append(None)
                continue
            if entry.size > len(buffer):
                sizes.append(UNSERVABLE)
                continue
            self._entries.move_to_end(key)
            buffer[: entry.size] = entry.handle.view[: entry.size]
            sizes.append(entry.size)
        return sizes

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> int:
        stored = 0
        for key, data in items:
            view = memoryview(data).cast("B")
            if len(view) > self.pool.slab_bytes:
                self.stats.errors += 1
                logger.debug("%s: chunk of %d bytes exceeds the slab size", self.name, len(view))
                continue
            if key in self._entries:
                self._entries.move_to_end(key)
                stored += 1
                continue
            handle = self.acquire_slab()
            if handle is None:
                self.stats.errors += 1
                continue
            handle.view[: len(view)] = view
            stored += self.adopt(key, handle, len(view))
        return stored

    def discard(self, keys: Sequence[ChunkKey]) -> int:
        """Drop these chunks now (synchronous :meth:`delete`); how many were cached."""
        gone: list[ChunkKey] = []
        for key in keys:
            entry = self._entries.pop(key, None)
            if entry is not None:
                entry.handle.release()
                self.pins.discard(key)
                gone.append(key)
        self.announce_removed(gone)
        return len(gone)

    async def delete(self, keys: Sequence[ChunkKey]) -> int:
        return self.discard(keys)

    def discard_namespace(self, namespace: bytes) -> list[ChunkKey]:
        """Drop every cached chunk whose key starts with ``namespace`` now (synchronous
        purge, one pass over the index); their keys. As with :meth:`discard`, only the
        tier's lease goes: a slab a reader or a pending write still holds returns to the
        pool when they let go, so nobody's bytes change under them."""
        keys = [key for key in self._entries if key.startswith(namespace)]
        self.discard(keys)
        return keys

    async def _purge(self, namespace: bytes) -> int:
        return len(self.discard_namespace(namespace))

    async def _count_namespace(self, namespace: bytes) -> int:
        return sum(key.startswith(namespace) for key in list(self._entries))

    def _held_size(self, key: ChunkKey) -> int | None:
        return self.pool.slab_bytes if key in self._entries else None

    def usage(self) -> dict[str, int]:
        return {
            "capacity_bytes": self.max_chunks * self.pool.slab_bytes,
            "used_bytes": self.nbytes,
            "chunks": len(self._entries),
            **self._pin_usage(),
        }

    async def close(self) -> None:
        self.discard(list(self._entries))


def open_cpu_tier(
    slab_bytes: int,
    *,
    cached_bytes: int,
    staging_bytes: int,
    max_pinned_fraction: float,
    direct_io: bool,
    region: Callable[[int], torch.Tensor] | None = None,
) -> CPUTier:
    """The CPU tier of a cache over a host pool allocated now
    (:func:`~lmtier.storage.host_pool.open_host_pool`: ``slab_bytes``, ``cached_bytes``,
    ``staging_bytes``, ``direct_io`` and ``region`` as there): its capacity is the
    pool's cached slabs and it pins at most ``max_pinned_fraction`` of them (the
    ``cpu`` section's numbers; storage takes numbers, not the configuration). Close
    its ``pool`` when done."""
    pool, cache_slabs = open_host_pool(
        slab_bytes,
        cached_bytes=cached_bytes,
        staging_bytes=staging_bytes,
        direct_io=direct_io,
        region=region,
    )
    capacity = cache_slabs * pool.slab_bytes
    pinned = int(capacity * max_pinned_fraction)
    return CPUTier(pool, capacity, max_pinned_bytes=pinned)
