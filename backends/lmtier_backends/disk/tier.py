"""The local-disk tier: one file per chunk, holding the chunk format's bytes unchanged.

Layout, permissions and start-up: :mod:`lmtier_backends.disk.layout`.

Writes: each chunk goes to a temp file beside its chunk file, then is
``os.replace``-d into place: a reader sees the old file or the new one, never a
partial one. A put writes in waves of at most 1/32 of capacity, each evicting least
recently used files just before it starts. ``fsync`` (off by default: see the README
and benchmarks/bench_trace.py) makes each wave durable with one group commit. A crash
can leave temp files (deleted at the next open) and empty or zeroed chunk files
(checksum failures: misses, deleted when read). A chunk larger than the whole
capacity is refused and counted as an error.

Index: key -> size in LRU order, rebuilt at open from file names and ``stat``
(:mod:`lmtier_backends.disk.index`); a hit bumps the file's mtime, so LRU order
survives a restart. Pinned chunks (:mod:`lmtier.storage.pins`, listed in
``v1/pins``) are never evicted; a delete or purge unpins them.

Sharing a directory (a vLLM scheduler and its workers, two engines, a warm-up job):
other processes' files are found on demand and adopted into the index; capacity holds
for the directory, counted by every process in a shared ledger
(:mod:`lmtier_backends.disk.ledger`) before each wave is written
(:mod:`lmtier_backends.disk.sharing`). O_DIRECT (``o_direct=True``) is probed once at
open; a filesystem that refuses it falls back to buffered I/O with one warning.

Failures: any OSError is a miss (reads) or a chunk not stored (writes), counted in
``stats.errors`` and logged once per errno, never raised. A file deleted behind our
back is a miss and leaves the index. What can never be served in place of a chunk
file (a directory, FIFO, symlink, unreadable or oversized file) is
:data:`~lmtier.storage.tier.UNSERVABLE`: deleted where we can, counted, not adopted
again for ``UNSERVABLE_MEMORY_S``. Files open with ``O_NOFOLLOW | O_NONBLOCK``: a
FIFO cannot block a thread. Using a tier that is not open raises BackendUnavailable;
a ``path`` that is a file, read-only or not ours is a ConfigError at open.

All file I/O runs in one pool (:mod:`lmtier_backends.disk.batch`), each thread doing
a whole file at a time and checking what it read (faster than aiofiles:
benchmarks/bench_disk.py). A batch of writes runs on ``io_threads`` of its threads, a
batch of reads on :data:`READ_FAN_OUT` times as many: a cold read waits on the device,
not the CPU, and more reads in flight keep it busier (a cold load of 128 x 2 MiB
files in a new process: 100-110 ms on 4 threads, 90-92 on 8, 85-96 on 16, on 2
cores). A cancelled call returns only once its threads
are done with its buffers; ``close()`` returns within ``CLOSE_TIMEOUT_S`` whatever
the kernel does.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from lmtier.chunks.keys import ChunkKey
from lmtier.config.policy import WritePolicy
from lmtier.errors import BackendUnavailable, ConfigError
from lmtier.storage.blocking import finish, shutdown_pool
from lmtier.storage.failures import FailureLog
from lmtier.storage.pins import Pins
from lmtier.storage.stats import TierStats
from lmtier.storage.tier import (
    UNSERVABLE,
    Buffer,
    CheckedRead,
    Tier,
    TierProperties,
)
from lmtier_backends.disk.batch import fan_out, write_batch
from lmtier_backends.disk.index import DiskIndex, RecentKeys, admit, wave_length
from lmtier_backends.disk.io import (
    file_signature,
    probe_direct,
    read_file,
    unlink_all,
    unservable_error,
)
from lmtier_backends.disk.layout import (
    CHUNK_SUFFIX,
    PINS_NAME,
    explain_open_error,
    list_namespace,
    prepare,
    temp_name,
)
from lmtier_backends.disk.ledger import Ledger
from lmtier_backends.disk.sharing import SharedRoom

__all__ = ["CLOSE_TIMEOUT_S", "READ_FAN_OUT", "DiskTier"]

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 2.0
"""Longest :meth:`DiskTier.close` waits for writes and threads in flight."""
UNSERVABLE_MEMORY_S = 60.0
"""How long a key found unservable (and not deletable) is not adopted again."""
READ_FAN_OUT = 2
"""Threads a batch of reads runs on, per ``io_threads`` (module docstring)."""


class DiskTier(Tier):
    """Chunks as files under ``path``, LRU-evicted beyond ``capacity_bytes``.

    ``await DiskTier.open(path, capacity_bytes, ...)`` (or :func:`~lmtier_backends.disk.open_tier`
    from a config); the constructor only stores its arguments. See the module docstring.
    """

    pins: Pins

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        fsync: bool = False,
        o_direct: bool = False,
        io_threads: int = 4,
        file_mode: int = 0o600,
        write_policy: WritePolicy = "write_through",
        queue_depth: int = 256,
        name: str = "disk",
        max_pinned_fraction: float = 0.5,
    ) -> None:
        if not 0 <= file_mode <= 0o777 or file_mode & 0o600 != 0o600:
            raise ValueError(f"file_mode must let the owner read and write, got {file_mode:o}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        self.name = name
        self.properties = TierProperties(write_policy=write_policy, queue_depth=queue_depth)
        self.stats = TierStats()
        self._failures = FailureLog(name, self.stats)
        self.root = os.path.join(os.fspath(path), "v1")
        self._temp_dir = os.path.join(self.root, "tmp")
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.o_direct = o_direct
        self.direct_io = False
        """Whether O_DIRECT is in use: requested and supported by the filesystem."""
        self.io_threads = io_threads
        self.file_mode = file_mode
        self.foreign_files = 0
        """Entries under ``path`` found at open that are not ours (left alone)."""
        self.adopted_files = 0
        """Chunk files found after open (written by other processes) and indexed."""
        pinned_bytes = int(capacity_bytes * max_pinned_fraction)
        self.pins = Pins(pinned_bytes, f"{self.root}/{PINS_NAME}", file_mode)
        self._index = DiskIndex(capacity_bytes, self.pins)
        self._ledger = Ledger(self.root)
        self._unservable = RecentKeys(UNSERVABLE_MEMORY_S)
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._writes: set[asyncio.Task[int]] = set()
        self._unlinks: dict[ChunkKey, asyncio.Future[tuple[int, list[OSError]]]] = {}
        self._landed_watch: dict[int, set[ChunkKey]] = {}  # per read call in flight
        self._room = SharedRoom(
            name,
            self.root,
            capacity_bytes,
            self._index,
            self._ledger,
            stats=self.stats,
            failures=self._failures,
            unlink=self._unlink,
            unlinking=self._unlinks,
            on_adopted=self._count_adopted,
            on_evicted=self.announce_removed,
        )

    async def start(self) -> None:
        """Create the directories, delete crash debris, rebuild the index, start the pool.

        ConfigError if ``path`` cannot hold chunks (a file in the way, read-only, another
        user's); the message names the path and the setting to change.
        """
        loop = asyncio.get_running_loop()
        threads = self.io_threads * READ_FAN_OUT
        pool = ThreadPoolExecutor(threads, thread_name_prefix=f"lmtier-{self.name}")
        try:
            scan = await loop.run_in_executor(
                pool, prepare, self.root, self.file_mode, self._ledger
            )
            if self.o_direct:
                problem = await loop.run_in_executor(
                    pool, probe_direct, self._temp_dir, self.file_mode
                )
                self.direct_io = problem is None
                if problem is not None:
                    logger.warning("%s: no O_DIRECT here (%s); buffered I/O", self.name, problem)
        except BaseException as exc:
            pool.shutdown(wait=False)
            self._ledger.close()
            if isinstance(exc, OSError):
                where = os.path.dirname(self.root)
                raise ConfigError(explain_open_error(where, exc)) from exc
            raise
        self._pool = pool
        self._index.load(scan.entries)
        stored = await loop.run_in_executor(pool, self.pins.stored_keys)
        self.pins.restore((k, n) for k in stored if (n := self._index.size_of(k)) is not None)
        self.foreign_files = len(scan.foreign)
        if scan.foreign:
            msg = "%s: %d foreign file(s) left alone, not indexed, e.g. %s"
            logger.warning(msg, self.name, len(scan.foreign), scan.foreign[0])
        msg = "%s: %d chunk(s) of %d bytes in %s; %d temp file(s) removed"
        logger.info(
            msg, self.name, len(self._index), self.used_bytes, self.root, scan.removed_temps
        )

    @property
    def used_bytes(self) -> int:
        """Bytes of chunk files counted against capacity (including writes in flight)."""
        return self._index.used

    def __len__(self) -> int:
        return len(self._index)

    def usage(self) -> dict[str, int]:
        index = self._index
        held = {"capacity_bytes": self.capacity_bytes, "used_bytes": index.used}
        return {**held, "chunks": len(index), **self._pin_usage()}

    def _held_size(self, key: ChunkKey) -> int | None:
        return self._index.size_of(key) if key in self._index or self._discover(key) else None

    def path_of(self, key: ChunkKey) -> str:
        """The file that holds (or would hold) chunk ``key``."""
        name = key.hex()
        return f"{self.root}/{name[32:34]}/{name}{CHUNK_SUFFIX}"

    def _temp_path(self, key: ChunkKey) -> str:
        """A fresh temp file for a write of ``key``, beside its chunk file (layout)."""
        return f"{self.root}/{key.hex()[32:34]}/{temp_name(key)}"

    async def contains(self, keys: Sequence[ChunkKey]) -> int:
        return self.contains_now(keys)

    def keys_now(self) -> list[ChunkKey]:
        return self._index.keys()  # what this process knows of (not files it never saw)

    def contains_now(self, keys: Sequence[ChunkKey]) -> int:
        # Any thread may ask: membership tests are atomic under the GIL, and adopting
        # takes the index's lock. Where the index stops, one stat looks for a file
        # another process wrote (module docstring). Latencies are recorded by the
        # StorageManager, which wraps every tier call.
        self.stats.lookups += len(keys)
        if self._pool is None:
            return 0
        found = self._index.leading(keys)
        while found < len(keys) and self._discover(keys[found]):
            found = self._index.leading(keys, found + 1)
        return found

    def _discover(self, key: ChunkKey) -> bool:
        """Whether ``key``'s file exists (one ``lstat``); if so it is indexed (adopted
        unless it was already). Never raises: an OSError is a miss, counted."""
        try:
            found = file_signature(self.path_of(key))
        except OSError as exc:
            self._count_error("stat", exc)
            return False
        if found is None or key in self._unlinks or key in self._unservable:
            return False
        if self._index.adopt(key, found[0]):
            self.adopted_files += 1
        return True

    async def _read_checked(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview]
    ) -> list[int | CheckedRead | None]:
        # Each file is checked in the thread that read it, while the others still read.
        pool = self._require_pool()
        # Keys not indexed are read too: another process may have written them.
        known_before = [key in self._index for key in keys]
        items = [(key, buffer.cast("B")) for key, buffer in zip(keys, buffers, strict=True)]
        # Keys whose new file lands while we read: an ENOENT seen before it landed
        # must not drop the new entry from the index.
        landed: set[ChunkKey] = set()
        self._landed_watch[id(landed)] = landed
        try:
            results = await fan_out(pool, self.io_threads * READ_FAN_OUT, self._read_one, items)
        finally:
            del self._landed_watch[id(landed)]
        bugs = [r for r in results if isinstance(r, BaseException) and not isinstance(r, OSError)]
        if bugs:
            raise bugs[0]
        return [
            self._settle_read(key, result, known, key in landed)
            for key, result, known in zip(keys, results, known_before, strict=True)
        ]

    def _settle_read(
        self, key: ChunkKey, result: object, known: bool, landed: bool
    ) -> int | CheckedRead | None:
        """What one file's read means for the caller and for the index."""
        if isinstance(result, FileNotFoundError):  # deleted behind our back, or absent
            if known and not landed:
                self._index.remove(key)
            return None
        if isinstance(result, OSError):
            self._count_error("read", result)
            result = UNSERVABLE if unservable_error(result) else None
        if result == UNSERVABLE:
            self._unservable.add(key)
            return UNSERVABLE
        if not isinstance(result, CheckedRead):  # an error above, or never read (closing)
            return None
        if not known and key not in self._unlinks and self._index.adopt(key, result.size):
            self.adopted_files += 1
        else:
            self._index.touch(key)
        return result

    def _read_one(self, key: ChunkKey, buffer: memoryview) -> int | CheckedRead:
        """In a worker thread: read chunk ``key``'s file into ``buffer`` and check it."""
        size = read_file(self.path_of(key), buffer, self.direct_io)
        return UNSERVABLE if size == UNSERVABLE else self.check_read(key, buffer, size)

    async def _read_into(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        outcomes = await self._read_checked(keys, buffers)
        return [o.size if isinstance(o, CheckedRead) else o for o in outcomes]

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> int:
        waiting, too_large, dropped = admit(items, self.capacity_bytes)
        self.stats.evictions += dropped  # older chunks of a batch larger than capacity
        if too_large:
            self.stats.errors += len(too_large)
            msg = "%d-byte chunk exceeds capacity %d; refused"
            self._failures.warn_once("too-large", msg, too_large[0], self.capacity_bytes)
        stored = 0
        while waiting:
            pool = self._require_pool()
            wave = waiting[: wave_length(waiting, self.capacity_bytes)]
            done, victims = self._index.reserve_prefix([(k, len(v)) for k, v in wave])
            self.stats.evictions += len(victims)
            self.announce_removed([key for key, _ in victims])
            writes, waiting = waiting[:done], waiting[done:]
            if not writes:
                # In-flight writes hold the room we need; they always finish, and what
                # they leave becomes evictable. Back-pressure, not a drop: dropping is
                # the StorageManager's decision (its queues), not the tier's.
                if not self._writes:
                    raise RuntimeError("bug: no room for a put, yet no write in flight")
                await asyncio.wait(self._writes, return_when=asyncio.FIRST_COMPLETED)
                continue
            # If the caller is cancelled, the writes still land (or fail) and are
            # indexed (or released), and this call returns only after them: its
            # buffers are in use until then (the tier contract). close() waits too.
            task = asyncio.ensure_future(self._write(pool, writes, victims))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)
            stored += await finish(task)
        return stored

    async def _write(
        self,
        pool: ThreadPoolExecutor,
        writes: list[tuple[ChunkKey, memoryview]],
        victims: list[tuple[ChunkKey, int]],
    ) -> int:
        if victims:  # unlinked before any write starts, so disk usage stays within capacity
            await self._unlink(pool, [key for key, _ in victims])
        # A file of the same key still being unlinked (evicted or deleted by another
        # call) must be gone before our rename, or the unlink would take the new file.
        pending = {id(f): f for key, _ in writes if (f := self._unlinks.get(key))}
        if pending:
            await asyncio.wait(pending.values())
        # Counted in the shared ledger before a byte is written, so that processes
        # sharing the directory make room for each other's waves (disk/sharing.py).
        keys = {k for k, _ in writes}
        reserved = await self._room.make(pool, sum(len(v) for _, v in writes), keys)
        files = [(self.path_of(k), self._temp_path(k), v) for k, v in writes]
        try:
            done = await write_batch(
                pool,
                self.io_threads,
                files,
                root=self.root,
                direct=self.direct_io,
                mode=self.file_mode,
                durable=self.fsync,
                ledger=self._ledger,
                reserved=reserved,
            )
        except BaseException:
            self._room.release(reserved)  # the batch never reached its count
            raise
        if done.problem is not None:  # not durable as promised: not stored, and not kept
            self._count_error("sync", done.problem)
            self.stats.errors += sum(done.placed) - 1
            await self._unlink(
                pool, [k for (k, _), ok in zip(writes, done.placed, strict=True) if ok]
            )
            done.placed = [False] * len(writes)
        stored = 0
        bug: BaseException | None = None
        for (key, view), result, ok in zip(writes, done.outcomes, done.placed, strict=True):
            if ok:
                self._index.commit(key, len(view))
                self._unservable.discard(key)
                for watch in self._landed_watch.values():
                    watch.add(key)
                stored += 1
                self.stats.bytes_written += len(view)
                continue
            self._index.abort(key, len(view))
            if isinstance(result, OSError):
                self._count_error("write", result)
            elif isinstance(result, BaseException):
                bug = bug or result
        self.stats.puts += stored
        if done.total > self.capacity_bytes:
            await self._room.shrink(pool, done.total - self.capacity_bytes, keys)
        if bug is not None:
            raise bug
        return stored

    def _count_adopted(self, count: int) -> None:
        self.adopted_files += count

    async def delete(self, keys: Sequence[ChunkKey]) -> int:
        # A write of the same key already in flight may land before or after the
        # unlink; if before, the index keeps an entry without a file, which the next
        # read drops (a miss, never wrong bytes). Files other processes wrote go too.
        pool = self._require_pool()
        removed = [
            key
            for key in dict.fromkeys(keys)
            if (key in self._index or self._discover(key)) and self._index.remove(key) is not None
        ]
        if removed:
            await self._unlink(pool, removed)
        return len(removed)

    async def _purge(self, namespace: bytes) -> int:
        # The directory is listed, not just the index: other processes' files go too,
        # each uncounted in the ledger. Writes in flight land first (none lands after
        # the listing). Other processes' indexes drop the keys when they read them.
        pool = self._require_pool()
        if self._writes:
            await asyncio.wait(set(self._writes))
        listed = await self._list(namespace)
        keys = list(dict.fromkeys([*self._index.remove_namespace(namespace), *listed]))
        return await self._unlink(pool, keys) if keys else 0

    async def _count_namespace(self, namespace: bytes) -> int:
        return len(await self._list(namespace))

    async def _list(self, namespace: bytes) -> list[ChunkKey]:
        """Every chunk file of ``namespace`` in the directory (other processes' too)."""
        loop = asyncio.get_running_loop()
        run = loop.run_in_executor(self._require_pool(), list_namespace, self.root, namespace)
        return await finish(run)

    async def _unlink(self, pool: ThreadPoolExecutor, keys: list[ChunkKey]) -> int:
        """Unlink the files of keys already removed from the index, in one worker hop;
        how many files this call unlinked."""
        future = asyncio.get_running_loop().run_in_executor(
            pool, unlink_all, [self.path_of(key) for key in keys], self._ledger
        )
        for key in keys:
            self._unlinks[key] = future
        try:
            unlinked, failures = await finish(future)
        finally:
            for key in keys:
                if self._unlinks.get(key) is future:
                    del self._unlinks[key]
        for exc in failures:
            self._count_error("unlink", exc)
        if self.pins.discard_many(keys):  # deleted or purged: a pin never outlives its file
            await self._pins_changed()
        return unlinked

    async def close(self) -> None:
        """Wait for writes in flight, then stop the thread pool, within
        ``CLOSE_TIMEOUT_S`` whatever the filesystem does. Idempotent."""
        pool, self._pool = self._pool, None
        self._closed = True
        if pool is None:
            return
        self._room.close()
        if self._writes:
            await asyncio.wait(set(self._writes), timeout=CLOSE_TIMEOUT_S)
        await shutdown_pool(pool, f"{self.name} tier", CLOSE_TIMEOUT_S)
        self._ledger.close()

    def _require_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            state = "closed" if self._closed else "not open (use DiskTier.open)"
            raise BackendUnavailable(f"disk tier {self.name!r} at {self.root} is {state}")
        return self._pool

    def _count_error(self, op: str, exc: OSError) -> None:
        self._failures.record(op, exc, exc.errno)
