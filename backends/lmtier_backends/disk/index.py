"""The disk tier's in-memory index: which chunk files exist, their sizes, LRU order.

The index is rebuilt at open from directory listings alone
(:func:`lmtier_backends.disk.layout.scan_chunk_dir`): a chunk file's name is its key and
``stat`` gives its size and mtime, so start-up never opens a file. A file that turns
out to be corrupt is found, counted and deleted when it is first read. The mtime
orders the index (oldest first, evicted first); the tier bumps it on every hit so
that recency survives a restart.

:class:`DiskIndex` also does the capacity bookkeeping. The event loop's thread does
all of it but one thing: :meth:`DiskIndex.adopt`, which indexes a file another process
wrote, is called from any thread that looks chunks up (``Tier.contains_now``). So every
change to the index, and :meth:`DiskIndex.reserve`'s walk over it, holds one lock
(uncontended: ~0.1 us); membership tests (:meth:`DiskIndex.leading`) take none, being
atomic under the GIL.

Sharing a directory (a vLLM scheduler and its workers, two engines, a warm-up job):
files other processes write after our open are found on demand. A lookup walks the
index to the first key it lacks, ``lstat``-s that key's file (~2 us) and, if it
exists, adopts it (indexed as most recently used, its size counted against capacity)
and walks on: one stat per lookup when nothing is new, plus one per new file, found
once. Reads and deletes try keys not indexed too, adopting the files they find.
Lookups on any thread (``contains_now``) adopt as well, since a scheduler process
only looks up and would otherwise re-stat the workers' files on every lookup; so index
changes take a lock (uncontended, ~0.1 us), and adopting never evicts (unlinking off
the loop would race its writes): the next put's reservation evicts down to capacity.
Capacity holds for the directory, not per process: every wave is counted in the
shared ledger before it is written, and its writer evicts its least recently used
files, adopting the others' by a rate-limited rescan when its own do not suffice
(:mod:`lmtier_backends.disk.sharing`, with the exact bound). Give every process
sharing a directory the same ``capacity_bytes``. Temp files carry their writer's
pid, so an opening process deletes only those of dead writers (or an hour old).

:class:`RecentKeys` remembers keys found unservable for a while, so a file that can
be neither read nor deleted is not adopted again at every lookup.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable, Sequence

from lmtier.chunks.keys import ChunkKey
from lmtier.storage.pins import Pins
from lmtier.storage.tier import Buffer

__all__ = ["WAVE_FRACTION", "WAVE_MAX_BYTES", "DiskIndex", "RecentKeys", "admit", "wave_length"]

WAVE_FRACTION = 32
"""A put writes its chunks in waves of at most this fraction of capacity ..."""
WAVE_MAX_BYTES = 64 << 20
"""... and at most this many bytes (one group commit each when ``fsync`` is on)."""


class RecentKeys:
    """Keys seen in the last ``ttl_s`` seconds, at most ``limit`` of them (oldest
    forgotten first). Loop thread and lookup threads: a lost race only re-adopts once."""

    __slots__ = ("_limit", "_seen", "ttl_s")

    def __init__(self, ttl_s: float, limit: int = 4096) -> None:
        self.ttl_s = ttl_s
        self._limit = limit
        self._seen: OrderedDict[ChunkKey, float] = OrderedDict()

    def add(self, key: ChunkKey) -> None:
        self._seen[key] = time.monotonic()
        self._seen.move_to_end(key)
        while len(self._seen) > self._limit:
            self._seen.popitem(last=False)

    def discard(self, key: ChunkKey) -> None:
        self._seen.pop(key, None)

    def __contains__(self, key: object) -> bool:
        since = self._seen.get(key)  # type: ignore[call-overload]
        if since is None:
            return False
        if time.monotonic() - since < self.ttl_s:
            return True
        self._seen.pop(key, None)  # type: ignore[call-overload]
        return False


def admit(
    items: Sequence[tuple[ChunkKey, Buffer]], capacity: int
) -> tuple[list[tuple[ChunkKey, memoryview]], list[int], int]:
    """The items of a put worth writing, oldest first: the last of each key, none too large.

    A batch larger than ``capacity`` keeps its newest chunks, as if written one by one
    under LRU. Returns (those items, the sizes of chunks larger than ``capacity``: they
    are refused, how many older chunks were left out: they count as evicted).
    """
    latest = {key: memoryview(data).cast("B") for key, data in items}
    budget = capacity
    admitted: list[tuple[ChunkKey, memoryview]] = []
    too_large: list[int] = []
    dropped = 0
    for key, view in reversed(latest.items()):
        if len(view) > capacity:
            too_large.append(len(view))
        elif len(view) > budget:
            dropped += 1
        else:
            budget -= len(view)
            admitted.append((key, view))
    admitted.reverse()
    return admitted, too_large, dropped


def wave_length(items: Sequence[tuple[ChunkKey, memoryview]], capacity: int) -> int:
    """How many of a put's ``items`` (admitted, oldest first) to write in its next wave:
    at least one. A wave reserves its room (evicting for it) only when it starts, so a
    backlog of 512 chunks no longer evicted a third of a small cache before its first
    byte landed, and each wave is found by lookups as soon as it is done."""
    budget = min(capacity // WAVE_FRACTION, WAVE_MAX_BYTES)
    total = 0
    for count, (_, view) in enumerate(items):
        total += len(view)
        if total > budget:
            return max(1, count)
    return len(items)


class DiskIndex:
    """Chunk key -> file size in LRU order, and the bytes the tier may not exceed.

    Invariant: ``used`` = bytes of indexed files + bytes reserved for writes in flight,
    and ``used <= capacity`` after every successful :meth:`reserve`. An overwritten
    file counts until its replacement lands (both exist on disk meanwhile). Evicted
    files leave ``used`` at once; the tier unlinks them before the write that evicted
    them starts, so a sequence of puts never has more than ``capacity`` bytes on
    disk (concurrent puts may briefly overlap one's unlink with another's write).

    Keys being written are never chosen for eviction: their new file is about to land
    as the most recent entry, and unlinking under a write could delete the new file.
    Nor are keys in :attr:`pinned` (the tier's :class:`~lmtier.storage.pins.Pins`,
    capped below capacity so that eviction always finds room).

    Files another process wrote join through :meth:`adopt` and count like any other;
    adopting never evicts (it may run outside the event loop), so ``used`` may exceed
    ``capacity`` until the next :meth:`reserve`, which evicts down to it.
    """

    __slots__ = ("_indexed", "_lock", "_reserved", "_sizes", "_writing", "capacity", "pinned")

    def __init__(self, capacity: int, pinned: Pins | None = None) -> None:
        self.capacity = capacity
        self.pinned = pinned if pinned is not None else Pins(0)
        self._sizes: OrderedDict[ChunkKey, int] = OrderedDict()
        self._writing: Counter[ChunkKey] = Counter()
        self._indexed = 0
        self._reserved = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    @property
    def used(self) -> int:
        """Bytes counted against capacity (see the class docstring)."""
        return self._indexed + self._reserved

    def load(self, entries: Iterable[tuple[ChunkKey, int]]) -> None:
        """Add scanned files, oldest first. Files beyond capacity stay until evicted."""
        with self._lock:
            for key, size in entries:
                self._sizes[key] = size
                self._indexed += size

    def size_of(self, key: ChunkKey) -> int | None:
        """The indexed file size of ``key``; None if it is not indexed."""
        return self._sizes.get(key)

    def keys(self) -> list[ChunkKey]:
        """Indexed keys, least recently used first."""
        with self._lock:
            return list(self._sizes)

    def leading(self, keys: Sequence[ChunkKey], start: int = 0) -> int:
        """Index of the first of ``keys[start:]`` not indexed; ``len(keys)`` if none.

        Lock-free, so any thread may call it: dict membership is atomic under the GIL.
        """
        sizes = self._sizes
        rest = itertools.islice(keys, start, None) if start else keys
        for count, key in enumerate(rest, start):
            if key not in sizes:
                return count
        return len(keys)

    def adopt(self, key: ChunkKey, size: int) -> bool:
        """Index a file found on disk (another process wrote it) as most recently used.

        Any thread may call it. False, and nothing changes, if ``key`` is indexed
        already. Never evicts: the next :meth:`reserve` brings ``used`` back down.
        """
        with self._lock:
            if key in self._sizes:
                return False
            self._sizes[key] = size
            self._indexed += size
            return True

    def adopt_oldest(self, entries: Iterable[tuple[ChunkKey, int]]) -> int:
        """Index files found by a rescan (oldest first) as the least recently used, ahead
        of every indexed file; keys indexed already keep their place. Returns how many
        were new. Never evicts."""
        new = 0
        with self._lock:
            for key, size in reversed(list(entries)):
                if key in self._sizes:
                    continue
                self._sizes[key] = size
                self._sizes.move_to_end(key, last=False)
                self._indexed += size
                new += 1
        return new

    def evict_excess(
        self, excess: int, keep: Collection[ChunkKey] = ()
    ) -> list[tuple[ChunkKey, int]]:
        """Remove least recently used files (never ones being written, nor ``keep``)
        until ``excess`` bytes are covered, or no file is left; returns them for the
        caller to unlink."""
        with self._lock:
            return self._evict(excess, keep)

    def touch(self, key: ChunkKey) -> None:
        """Mark a hit: move ``key`` to the most recently used end."""
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)

    def reserve(self, key: ChunkKey, size: int) -> list[tuple[ChunkKey, int]] | None:
        """Make room for a write of ``size`` bytes to ``key`` and count it as in flight.

        Returns the evicted (key, size) pairs, whose files the caller must unlink
        before writing; None when the write cannot fit even after evicting everything
        evictable (nothing is evicted then: the rest is held by writes in flight).
        """
        done, victims = self.reserve_prefix([(key, size)])
        return victims if done else None

    def reserve_prefix(
        self, items: Sequence[tuple[ChunkKey, int]]
    ) -> tuple[int, list[tuple[ChunkKey, int]]]:
        """:meth:`reserve` each (key, size) of ``items`` in turn until one does not fit.

        Returns how many were reserved, and the (key, size) of every file evicted.
        """
        victims: list[tuple[ChunkKey, int]] = []
        with self._lock:
            # Bytes of indexed files being rewritten, and pinned ones: not evictable.
            # Summed once per call and kept up to date, not per item (a batch of n
            # was O(n^2)).
            held = sum(self._sizes.get(k, 0) for k in self._writing) + self.pinned.nbytes
            for done, (key, size) in enumerate(items):
                if self._reserved + held + size > self.capacity:
                    return done, victims
                victims += self._evict(self.used + size - self.capacity)
                if key not in self._writing:
                    held += self._sizes.get(key, 0)
                self._writing[key] += 1
                self._reserved += size
        return len(items), victims

    def commit(self, key: ChunkKey, size: int) -> None:
        """A reserved write landed: index it as most recent, replacing any older file."""
        with self._lock:
            self._end_write(key, size)
            self._remove(key)
            self._sizes[key] = size
            self._indexed += size

    def abort(self, key: ChunkKey, size: int) -> None:
        """A reserved write failed: release its bytes."""
        with self._lock:
            self._end_write(key, size)

    def remove(self, key: ChunkKey) -> int | None:
        """Drop ``key`` from the index; its size, or None if absent."""
        with self._lock:
            return self._remove(key)

    def remove_namespace(self, namespace: bytes) -> list[ChunkKey]:
        """Drop every key that starts with ``namespace`` (a purge); the keys dropped.
        Keys being written stay counted as in flight until their write ends."""
        with self._lock:
            keys = [key for key in self._sizes if key.startswith(namespace)]
            for key in keys:
                self._remove(key)
        return keys

    def _evict(self, excess: int, keep: Collection[ChunkKey] = ()) -> list[tuple[ChunkKey, int]]:
        """Drop least recently used entries (not being written, not ``keep``, not
        pinned) from the index until ``excess`` bytes are covered; the (key, size) of
        each. Pinned keys walked past move to the recent end, so that every eviction
        does not walk past every pin again. Under the lock."""
        victims: list[tuple[ChunkKey, int]] = []
        passed: list[ChunkKey] = []
        for key, size in self._sizes.items():
            if excess <= 0:
                break
            if key in self.pinned:
                passed.append(key)
            elif key not in self._writing and key not in keep:
                victims.append((key, size))
                excess -= size
        for key in passed:
            self._sizes.move_to_end(key)
        for key, _ in victims:
            self._remove(key)
        return victims

    def _remove(self, key: ChunkKey) -> int | None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self._indexed -= size
        return size

    def _end_write(self, key: ChunkKey, size: int) -> None:
        self._reserved -= size
        self._writing[key] -= 1
        if self._writing[key] <= 0:
            del self._writing[key]
