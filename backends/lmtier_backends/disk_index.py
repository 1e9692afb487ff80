"""The disk tier's in-memory index: which chunk files exist, their sizes, LRU order.

The index is rebuilt at open from directory listings alone (:func:`scan_chunk_dir`):
a chunk file's name is its key and ``stat`` gives its size and mtime, so start-up
never opens a file. A file that turns out to be corrupt is found, counted and deleted
when it is first read. The mtime orders the index (oldest first, evicted first); the
tier bumps it on every hit so that recency survives a restart.

:class:`DiskIndex` also does the capacity bookkeeping. It runs on the event loop only
(worker threads never touch it), so it needs no lock.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from lmtier.keys import ChunkKey

__all__ = ["CHUNK_SUFFIX", "DiskIndex", "ScanResult", "scan_chunk_dir"]

logger = logging.getLogger(__name__)

CHUNK_SUFFIX = ".lmtc"
_CHUNK_NAME = re.compile(r"[0-9a-f]{64}\.lmtc")
_SHARD_NAMES = tuple(f"{i:02x}" for i in range(256))


@dataclass(slots=True)
class ScanResult:
    """What a start-up scan found: chunk files, oldest first, and what it left alone."""

    entries: list[tuple[ChunkKey, int]] = field(default_factory=list)
    """(key, file size), ordered by mtime, oldest first."""
    foreign: list[str] = field(default_factory=list)
    """Paths of entries that are not ours: left in place, never indexed."""
    removed_temps: int = 0


def scan_chunk_dir(root: str) -> ScanResult:
    """Create ``root``'s shard and tmp directories, delete temp files, list chunk files.

    Blocking; run it in a worker thread. Temp files are debris of writes that never
    reached ``os.replace`` (a crash): no reader can see them, so they go.
    """
    result = ScanResult()
    tmp_dir = os.path.join(root, "tmp")
    os.makedirs(tmp_dir, exist_ok=True)
    for shard in _SHARD_NAMES:
        os.makedirs(os.path.join(root, shard), exist_ok=True)
    with os.scandir(tmp_dir) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                result.foreign.append(entry.path)
            else:
                os.unlink(entry.path)
                result.removed_temps += 1
    shards = set(_SHARD_NAMES)
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.name not in shards and entry.name != "tmp":
                result.foreign.append(entry.path)
    found: list[tuple[int, ChunkKey, int]] = []
    sizes: dict[int, int] = {}  # share one int object per distinct size: chunks mostly agree
    for shard in _SHARD_NAMES:
        with os.scandir(os.path.join(root, shard)) as entries:
            for entry in entries:
                name = entry.name
                if (
                    name[32:34] == shard
                    and _CHUNK_NAME.fullmatch(name)
                    and entry.is_file(follow_symlinks=False)
                ):
                    st = entry.stat(follow_symlinks=False)
                    size = sizes.setdefault(st.st_size, st.st_size)
                    found.append((st.st_mtime_ns, ChunkKey(bytes.fromhex(name[:64])), size))
                else:
                    result.foreign.append(entry.path)
    found.sort(key=lambda item: item[0])
    result.entries = [(key, size) for _, key, size in found]
    return result


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
    """

    __slots__ = ("_indexed", "_reserved", "_sizes", "_writing", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._sizes: OrderedDict[ChunkKey, int] = OrderedDict()
        self._writing: Counter[ChunkKey] = Counter()
        self._indexed = 0
        self._reserved = 0

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
        for key, size in entries:
            self._sizes[key] = size
            self._indexed += size

    def keys(self) -> list[ChunkKey]:
        """Indexed keys, least recently used first."""
        return list(self._sizes)

    def leading(self, keys: Sequence[ChunkKey]) -> int:
        """How many of ``keys``, from the first, are indexed."""
        for count, key in enumerate(keys):
            if key not in self._sizes:
                return count
        return len(keys)

    def touch(self, key: ChunkKey) -> None:
        """Mark a hit: move ``key`` to the most recently used end."""
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def reserve(self, key: ChunkKey, size: int) -> list[tuple[ChunkKey, int]] | None:
        """Make room for a write of ``size`` bytes to ``key`` and count it as in flight.

        Returns the evicted (key, size) pairs, whose files the caller must unlink
        before writing; None when the write cannot fit even after evicting everything
        evictable (nothing is evicted then: the rest is held by writes in flight).
        """
        pinned = sum(self._sizes.get(k, 0) for k in self._writing)
        if self._reserved + pinned + size > self.capacity:
            return None
        victims: list[tuple[ChunkKey, int]] = []
        excess = self.used + size - self.capacity
        for victim, victim_size in self._sizes.items():  # least recently used first
            if excess <= 0:
                break
            if victim not in self._writing:
                victims.append((victim, victim_size))
                excess -= victim_size
        for victim, _ in victims:
            self.remove(victim)
        self._writing[key] += 1
        self._reserved += size
        return victims

    def commit(self, key: ChunkKey, size: int) -> None:
        """A reserved write landed: index it as most recent, replacing any older file."""
        self._end_write(key, size)
        self.remove(key)
        self._sizes[key] = size
        self._indexed += size

    def abort(self, key: ChunkKey, size: int) -> None:
        """A reserved write failed: release its bytes."""
        self._end_write(key, size)

    def remove(self, key: ChunkKey) -> int | None:
        """Drop ``key`` from the index; its size, or None if absent."""
        size = self._sizes.pop(key, None)
        if size is not None:
            self._indexed -= size
        return size

    def _end_write(self, key: ChunkKey, size: int) -> None:
        self._reserved -= size
        self._writing[key] -= 1
        if self._writing[key] <= 0:
            del self._writing[key]
