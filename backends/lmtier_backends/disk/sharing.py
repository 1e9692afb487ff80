"""Holding a disk directory that several processes share to its capacity.

Each process indexes the files it knows (:mod:`lmtier_backends.disk.index`); the
directory's bytes are counted by all of them in one ledger
(:mod:`lmtier_backends.disk.ledger`). Counting a wave of writes in the ledger only
once it had landed let each process write a whole wave into a full directory
before it evicted anything: processes sharing a directory peaked at 1.10x its
capacity. So a wave is counted *before* it is written (:meth:`SharedRoom.make`):

1. its bytes are added to the ledger, a reservation every other process sees;
2. while the directory, with them, is over capacity, the writer evicts its least
   recently used files (its own and those it adopted), never one being written;
3. when those do not cover it, it rescans the directory to adopt the other
   processes' files (at most once per ``RESCAN_INTERVAL_S``, waited for up to
   ``ROOM_WAIT_S`` from its start) and evicts those;
4. only then is the wave written; when it has landed, the reservation is corrected
   to the bytes the directory gained (``added - reserved``: files that failed,
   files replaced), in the update the ledger took anyway.

No new lock: a reservation is one more ledger update per wave (an flock of a few
microseconds, in an I/O thread), not a lock held across the writes.

Exactly what holds: the bytes of chunk and temp files stay within
``capacity_bytes`` whenever each writer finds enough to evict. One that does not
(every file it may evict is pinned or being written, and its rescan found no more)
writes its wave anyway, with one warning: the directory then exceeds capacity by at
most one wave (``min(capacity / 32, 64 MiB)``) per process writing at that moment,
until the next writes evict. The ledger itself can drift from the files: a process
that died with a reservation counts high (space unused), and an open (which resets
the ledger from a scan) while others write counts their waves in flight short;
every open corrects both. The writer also evicts once more after a wave lands if
the ledger then says the directory is over capacity (a missed update, that drift).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Container
from concurrent.futures import ThreadPoolExecutor

from lmtier.chunks.keys import ChunkKey
from lmtier.storage.blocking import finish
from lmtier.storage.failures import FailureLog
from lmtier.storage.stats import TierStats
from lmtier_backends.disk.index import DiskIndex
from lmtier_backends.disk.layout import scan_chunk_dir
from lmtier_backends.disk.ledger import Ledger

__all__ = ["RESCAN_INTERVAL_S", "ROOM_WAIT_S", "SharedRoom"]

logger = logging.getLogger(__name__)

RESCAN_INTERVAL_S = 30.0
"""Least time between two rescans that adopt other processes' files for eviction."""
ROOM_WAIT_S = 30.0
"""Longest waves wait for a rescan (from its start) to find files to evict before
they are written anyway: a hung filesystem must not stop the writer for good."""

Unlink = Callable[[ThreadPoolExecutor, list[ChunkKey]], Awaitable[int]]


class SharedRoom:
    """Room in the shared directory for a tier's writes (module docstring). Loop-only.

    ``unlink`` unlinks files of keys already removed from ``index`` (the tier's, which
    also drops their pins); ``unlinking`` holds the keys being unlinked, which a
    rescan must not adopt; ``on_adopted`` is told how many files a rescan adopted.
    """

    def __init__(
        self,
        name: str,
        root: str,
        capacity: int,
        index: DiskIndex,
        ledger: Ledger,
        *,
        stats: TierStats,
        failures: FailureLog,
        unlink: Unlink,
        unlinking: Container[ChunkKey],
        on_adopted: Callable[[int], None],
        on_evicted: Callable[[list[ChunkKey]], None],
    ) -> None:
        self.name = name
        self.root = root
        self.capacity = capacity
        self.index = index
        self.ledger = ledger
        self.stats = stats
        self.failures = failures
        self._unlink = unlink
        self._unlinking = unlinking
        self._on_adopted = on_adopted
        self._on_evicted = on_evicted
        self._rescan: asyncio.Task[None] | None = None
        self._last_rescan = -RESCAN_INTERVAL_S
        self._adopted = 0
        """Files adopted by every rescan so far."""

    async def make(
        self, pool: ThreadPoolExecutor, nbytes: int, writing: Collection[ChunkKey]
    ) -> int:
        """Reserve ``nbytes`` in the ledger for a wave writing ``writing`` and evict until
        the directory holds them within capacity (steps 1-3 of the module docstring).
        Returns the bytes reserved (0 if the ledger could not count them now: the wave
        is then counted when it lands), for :meth:`release` or the landing's correction."""
        loop = asyncio.get_running_loop()
        total = await finish(loop.run_in_executor(pool, self.ledger.add, nbytes))
        if total < 0:
            return 0
        try:
            excess = total - self.capacity
            while excess > 0:
                if not await self._evict(pool, excess, writing) and not await self._adopt(pool):
                    msg = (
                        "the shared directory is %d bytes over capacity and nothing here may "
                        "be evicted (pinned, or being written): writing beyond it"
                    )
                    self.failures.warn_once("over-capacity", msg, excess)
                    break
                excess = self.ledger.total() - self.capacity
        except BaseException:
            self.release(nbytes)
            raise
        return nbytes

    def release(self, reserved: int) -> None:
        """Uncount a reservation whose wave was never written. Blocking (one ledger
        update): only on the way out of a failed or cancelled wave."""
        if reserved:
            self.ledger.add(-reserved)

    async def shrink(
        self, pool: ThreadPoolExecutor, excess: int, keep: Collection[ChunkKey]
    ) -> None:
        """After a wave landed, the ledger says the directory is ``excess`` bytes over
        capacity (module docstring): evict for it, never ``keep`` (just written), and
        start a rescan for the next wave if that is not enough."""
        if not await self._evict(pool, excess, keep) and self._rescan_due():
            self._start_rescan(pool)

    async def _evict(
        self, pool: ThreadPoolExecutor, excess: int, keep: Collection[ChunkKey]
    ) -> bool:
        """Evict least recently used files worth ``excess`` bytes (fewer if the index
        has no more); whether any were chosen."""
        victims = self.index.evict_excess(excess, keep=keep)
        if not victims:
            return False
        self.stats.evictions += len(victims)
        keys = [key for key, _ in victims]
        self._on_evicted(keys)
        await self._unlink(pool, keys)
        return True

    async def _adopt(self, pool: ThreadPoolExecutor) -> bool:
        """Rescan (unless one ran within ``RESCAN_INTERVAL_S``) and wait for it, up to
        ``ROOM_WAIT_S`` after it started; whether it adopted files."""
        if self._rescan is None:
            if not self._rescan_due():
                return False
            self._start_rescan(pool)
        rescan = self._rescan
        assert rescan is not None
        adopted = self._adopted
        left = self._last_rescan + ROOM_WAIT_S - time.monotonic()
        if left > 0:
            await asyncio.wait([rescan], timeout=left)  # never cancels the rescan
        return self._adopted > adopted

    def _rescan_due(self) -> bool:
        return self._rescan is None and time.monotonic() - self._last_rescan > RESCAN_INTERVAL_S

    def _start_rescan(self, pool: ThreadPoolExecutor) -> None:
        self._last_rescan = time.monotonic()
        self._rescan = asyncio.ensure_future(self._adopt_directory(pool))

    async def _adopt_directory(self, pool: ThreadPoolExecutor) -> None:
        try:
            scan = await asyncio.get_running_loop().run_in_executor(pool, scan_chunk_dir, self.root)
            adopted = self.index.adopt_oldest(
                (key, size) for key, size in scan.entries if key not in self._unlinking
            )
            self._adopted += adopted
            self._on_adopted(adopted)
            logger.info("%s: over capacity; adopted %d other processes' files", self.name, adopted)
        except (OSError, RuntimeError) as exc:  # RuntimeError: the pool shut down meanwhile
            error = exc if isinstance(exc, OSError) else OSError(str(exc))
            self.failures.record("rescan", error, error.errno)
        finally:
            self._rescan = None

    def close(self) -> None:
        """Stop a rescan in progress."""
        if self._rescan is not None:
            self._rescan.cancel()
