"""Pinned chunks: keys a tier keeps out of its LRU eviction, within a byte cap.

``lmtier warm --pin`` makes the KV of known prompts (system prompts, few-shot
examples) stay cached however much other traffic passes through. A pin is a promise
about eviction only: a purge, a delete or a corrupt read still removes a pinned
chunk (and its pin), since the cache must never serve what it was told to forget.

The cap is what keeps pins from starving the cache: a tier pins at most
``limit_bytes`` (a fraction of its capacity, from config), and a pin that would pass
it is refused and counted, never granted by evicting other pins. One :class:`Pins`
serves every tier that supports pinning (host memory, disk): the tier decides what a
chunk's size is and skips pinned keys when it evicts.

A tier whose chunks outlive its process (disk) persists its pins in a text file,
one hex key per line, rewritten atomically (temp file + rename) on every change, so
pins survive a restart, and another process opening the same directory sees them
when it opens. Processes that share a directory and pin concurrently: the last
writer's set wins.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterable

from lmtier.chunks.keys import KEY_BYTES, ChunkKey

__all__ = ["Pins"]

logger = logging.getLogger(__name__)


class Pins:
    """Pinned keys and their sizes, capped at ``limit_bytes``; thread-safe.

    ``path``: the file that persists the set (None: in memory only). Sizes are not
    persisted: a tier re-adds them from its index when it opens (:meth:`restore`).
    """

    __slots__ = ("_lock", "_nbytes", "_sizes", "limit_bytes", "mode", "path")

    def __init__(self, limit_bytes: int, path: str | None = None, mode: int = 0o600) -> None:
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.path = path
        self.mode = mode
        """Permissions of the file, whatever the umask (the keys name cached prompts)."""
        self._sizes: dict[ChunkKey, int] = {}
        self._nbytes = 0
        self._lock = threading.Lock()

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def nbytes(self) -> int:
        """Bytes pinned."""
        return self._nbytes

    def snapshot(self) -> list[ChunkKey]:
        """The pinned keys, as a list taken now."""
        with self._lock:
            return list(self._sizes)

    def add(self, key: ChunkKey, size: int) -> bool:
        """Pin ``key`` (``size`` bytes held by the tier). True if it is pinned now
        (already or newly); False past the cap (the tier counts the refusal in its
        ``stats.pins_refused``)."""
        with self._lock:
            if key in self._sizes:
                return True
            if self._nbytes + size > self.limit_bytes:
                return False
            self._sizes[key] = size
            self._nbytes += size
            return True

    def discard(self, key: ChunkKey) -> bool:
        """Unpin ``key``; whether it was pinned."""
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is None:
                return False
            self._nbytes -= size
            return True

    def discard_many(self, keys: Iterable[ChunkKey]) -> int:
        """Unpin each of ``keys``; how many were pinned."""
        return sum(self.discard(key) for key in keys)

    def clear(self) -> int:
        """Unpin everything; how many were pinned."""
        with self._lock:
            count = len(self._sizes)
            self._sizes.clear()
            self._nbytes = 0
            return count

    # ---- persistence -----------------------------------------------------------

    def stored_keys(self) -> list[ChunkKey]:
        """The keys in :attr:`path` (empty when there is no file). Lines that are not a
        key are skipped and logged: a damaged pin file costs pins, never the tier."""
        if self.path is None:
            return []
        try:
            with open(self.path, encoding="ascii", errors="replace") as stream:
                lines = stream.read().split()
        except FileNotFoundError:
            return []
        keys: list[ChunkKey] = []
        for line in lines:
            try:
                raw = bytes.fromhex(line)
            except ValueError:
                raw = b""
            if len(raw) != KEY_BYTES:
                logger.warning("%s: skipping %r, not a chunk key", self.path, line[:80])
                continue
            keys.append(ChunkKey(raw))
        return keys

    def restore(self, sizes: Iterable[tuple[ChunkKey, int]]) -> None:
        """Pin the stored keys the tier still holds (their sizes from its index); pins
        past the cap (a smaller cap than before) are dropped, as :meth:`add` does."""
        for key, size in sizes:
            self.add(key, size)

    def save(self) -> None:
        """Write the pinned keys to :attr:`path` atomically. Blocking: run it where the
        tier does its file I/O. Raises OSError."""
        if self.path is None:
            return
        temp = f"{self.path}.{os.getpid()}.tmp"
        data = "".join(f"{key.hex()}\n" for key in self.snapshot())
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(temp, flags, self.mode)
            with open(fd, "w", encoding="ascii") as stream:
                os.fchmod(fd, self.mode)  # the umask may have taken bits
                stream.write(data)
            os.replace(temp, self.path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
