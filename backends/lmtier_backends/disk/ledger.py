"""The bytes of chunk files in one disk-tier directory, counted by every process in it.

Several processes share one directory (vLLM's scheduler and workers, two engines, a
warm-up job). Each keeps its own index of the files it knows, so capacity counted
per process let three processes hold 2.6x ``capacity_bytes``. The ledger is one
8-byte counter in ``<root>/ledger`` that every process updates before it writes a
wave (+ its bytes, a reservation), when the wave has landed (- what did not land,
- the size of files it replaced) and when it unlinks a file (- its size), under
``flock`` (and a thread lock: flock does not exclude threads that
share a descriptor). A writer counts each wave here before writing it and evicts
until the directory holds it within capacity (:mod:`lmtier_backends.disk.sharing`,
which also says exactly what bound holds).

Apart from reservations, the counter only moves on operations that succeeded on the
filesystem, so two processes evicting the same file count it once (the second
unlink finds nothing). It is set from a full scan at every open, and when a process
recreates the directory after it was removed (every process then counts in the new
file). A process that crashed between a reservation and its correction leaves it
high by that wave until then; a scan while others write misses their waves in
flight, and leaves it short by those.

One update is an flock, a pread and a pwrite of 8 bytes: a few microseconds, next
to a chunk write's milliseconds.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
import time
from collections.abc import Callable

__all__ = ["LEDGER_NAME", "LOCK_WAIT_S", "Ledger"]

logger = logging.getLogger(__name__)

LEDGER_NAME = "ledger"
LOCK_WAIT_S = 0.5
"""Longest wait for the ledger's flock. Another process holds it for microseconds; one
stopped while holding it must not stop this one's writes: the update is skipped
(counted in ``missed``), a drift the next open corrects."""
_COUNTER = struct.Struct("<q")


class Ledger:
    """The shared byte counter of one directory (module docstring). Thread-safe."""

    __slots__ = ("_fd", "_lock", "missed", "path")

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, LEDGER_NAME)
        self._fd: int | None = None
        self._lock = threading.Lock()
        self.missed = 0
        """Updates skipped because the flock could not be had in ``LOCK_WAIT_S``."""

    def open(self, mode: int) -> None:
        """Open (creating it with ``mode``) the ledger file. Blocking. A descriptor
        already open is replaced and closed: its file was removed with the directory
        (:func:`~.layout.restore_dirs`), and counting in it would count in nothing."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
        try:
            os.fchmod(fd, mode)
        except OSError:
            os.close(fd)
            raise
        with self._lock:
            old, self._fd = self._fd, fd
        if old is not None:
            os.close(old)

    def total(self) -> int:
        """The bytes of chunk files in the directory, as counted: one lock-free pread
        of 8 bytes, so any thread (the event loop's too) may ask. -1 if closed."""
        fd = self._fd
        return -1 if fd is None else self._read(fd)

    def add(self, delta: int) -> int:
        """Count ``delta`` bytes more (less, if negative); the new total, or -1 if the
        update was skipped (closed, or the lock not had in time). Blocking, never raises."""
        return self._update(lambda total: total + delta)

    def reset(self, total: int) -> None:
        """Set the counter to ``total`` (a scan's result). Blocking."""
        self._update(lambda _: total)

    def _update(self, change: Callable[[int], int]) -> int:
        with self._lock:
            fd = self._follow()
            if fd is None or not self._flock(fd):
                self.missed += 1
                return -1
            try:
                total = max(0, change(self._read(fd)))
                os.pwrite(fd, _COUNTER.pack(total), 0)
            except OSError as exc:
                self.missed += 1
                logger.debug("disk ledger %s: update failed: %s", self.path, exc)
                return -1
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            return total

    def _follow(self) -> int | None:
        """The descriptor to count in (under ``_lock``): the one open, unless its file
        was removed and the directory recreated since (by another process sharing it:
        :func:`~.layout.restore_dirs`), then the new file's, opened in its place."""
        fd = self._fd
        if fd is None:
            return None
        try:
            if os.fstat(fd).st_nlink > 0:
                return fd
            new = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return fd  # not recreated yet: a write that finds it gone will
        os.close(fd)
        self._fd = new
        return new

    @staticmethod
    def _flock(fd: int) -> bool:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    return False
            time.sleep(0.001)

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    @staticmethod
    def _read(fd: int) -> int:
        data = os.pread(fd, _COUNTER.size, 0)
        return _COUNTER.unpack(data)[0] if len(data) == _COUNTER.size else 0
