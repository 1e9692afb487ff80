"""The tier interface: an async, batch-first store of encoded chunks (bytes only).

Every storage tier (host memory, disk, Redis, S3) implements :class:`Tier`. The
interface is modelled on a remote store, because that is the expensive case: every
call takes many keys so a backend can answer in one round trip, ``contains`` answers
how many *leading* keys are present (a lookup stops at the first miss anyway), and
``get_into`` reads into buffers the caller owns (pool slabs), so there is exactly one
copy from the medium into memory.

Buffers belong to the tier call that was given them until that call is over: a
tier call returns, raises or is cancelled only once none of the I/O it started can
touch its buffers any more (threads use :mod:`lmtier.storage.blocking`; I/O on the event
loop aborts its transport when cancelled). The StorageManager relies on it to keep
a slab out of the pool while a timed-out call may still be writing into it.

Failures come in three kinds. A chunk that is absent or vanished is a miss: None
or a shorter prefix. A chunk that is there but can never be served (larger than
any buffer, a Redis key of another type, a directory, FIFO or unreadable file in
place of a chunk file) is reported as :data:`UNSERVABLE` by the backend; the shared
code deletes it, counts it in ``stats.unservable`` and reports a miss, so that a
lookup stops saying "hit" for it. A problem with the tier itself (refused
connection, timeout, server down) raises :class:`~lmtier.errors.BackendError` (or
simply takes too long): the StorageManager counts it, feeds the tier's circuit
breaker, and answers the request with a miss. The interface is for the manager;
engine code never sees either kind.

Tiers move the chunk format's bytes unchanged and never touch torch. Validation is
shared, not per backend: :meth:`Tier.read_chunks` (and :meth:`Tier.get_into`) call
the backend's ``_read_into``, then decode every chunk once (magic, version, header
and payload checksums, and that the chunk is the one asked for); a chunk that fails
is counted, deleted, and reported as a miss. A backend that reads in worker threads
may check each chunk there, right after its read (:meth:`Tier.check_read`, returned
as a :class:`CheckedRead` from ``_read_checked``), so that the checksums of a batch
overlap its other reads instead of following them all on the event loop's thread.
Backends translate their own exceptions (OSError, redis, botocore) at their edge,
through one table each (:mod:`lmtier.storage.failures`), into misses for one chunk
or BackendError for the whole tier.

Purging a namespace (:meth:`Tier.purge`) deletes every chunk whose key starts with
one 16-byte namespace digest, which the key layout makes a prefix in every backend (a
file name, a Redis key, an S3 object key). A tier that can list its chunks by that
prefix implements ``_purge``; one that cannot keeps the default, which raises
:class:`~lmtier.errors.NotSupportedError`: the StorageManager skips such a tier and
reports it as :data:`~lmtier.storage.purging.PURGE_UNSUPPORTED`, where a failing one is
``PURGE_FAILED``.

Pinning (:meth:`Tier.pin`, :meth:`Tier.unpin`) exempts chunks from a tier's LRU
eviction within a byte cap (:mod:`lmtier.storage.pins`). A tier that evicts by LRU
(host memory, disk) sets :attr:`Tier.pins` and answers :meth:`Tier._held_size`;
the others keep the default, and ``pin`` raises NotSupportedError.

What makes tiers behave differently lives in :class:`TierProperties`, so the
StorageManager never branches on a tier's name or class.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

from lmtier.chunks.format import DecodedChunk, decode_as
from lmtier.chunks.keys import ChunkKey, check_namespace
from lmtier.config.policy import DEFAULT_QUEUE_DEPTH, WritePolicy
from lmtier.errors import CorruptChunk, NotSupportedError
from lmtier.storage.events import TierEvents
from lmtier.storage.pins import Pins
from lmtier.storage.stats import TierStats

__all__ = [
    "UNSERVABLE",
    "Buffer",
    "CheckedRead",
    "Tier",
    "TierProperties",
]

logger = logging.getLogger(__name__)

Buffer: TypeAlias = bytes | bytearray | memoryview
"""Encoded chunk bytes handed to ``put``."""

_T = TypeVar("_T", bound="Tier")

UNSERVABLE = -1
"""What ``Tier._read_into`` returns for a chunk that is present but can never be
served (see the module docstring): it is deleted and counted, and the read is a miss."""


@dataclass(frozen=True, slots=True)
class CheckedRead:
    """A chunk its backend has read and already decoded (:meth:`Tier.check_read`)."""

    size: int
    """Bytes read (the encoded length)."""
    chunk: DecodedChunk | None
    """The decoded chunk, a view into the read buffer; None if it failed validation."""
    problem: CorruptChunk | None = None
    """Why it failed validation."""


@dataclass(frozen=True, slots=True)
class TierProperties:
    """Declared behaviour of a tier, read by the StorageManager instead of its type.

    ``shared``: other processes or machines can write its chunks (chunks read from it
    must carry a valid MAC when an integrity key is set). ``write_policy``:
    ``write_through`` receives every new chunk in the background; ``write_back``
    receives a chunk only when the memory tier evicts it; ``none`` is only read (the
    peer tier: what it serves is other nodes' memory). ``queue_depth``: chunks that
    may wait for a background write before new ones are dropped (and counted) rather
    than blocking inference (capped at half the host pool's slabs).
    ``verify_reads``: validate every chunk read (checksums); only a tier holding
    memory this process wrote and validated on entry may turn it off.
    ``timeout_s``: how long one call may take before it counts as a failure (None:
    the StorageManager's default).
    """

    shared: bool = False
    write_policy: WritePolicy = "write_through"
    queue_depth: int = DEFAULT_QUEUE_DEPTH
    verify_reads: bool = True
    timeout_s: float | None = None


class Tier(ABC):
    """An async, batch-first store of encoded chunks. See the module docstring.

    Every backend is built the same way: its constructor stores its settings (no I/O,
    no threads), :meth:`start` does the I/O of opening (connect, scan a directory),
    and ``await Backend.open(...)`` does both with the constructor's arguments.
    """

    name: str
    properties: TierProperties
    stats: TierStats
    pins: Pins | None = None
    """Chunks exempt from eviction; None: this tier does not pin (module docstring)."""
    events: TierEvents | None = None
    """Where the tier tells of chunks it drops on its own (its evictions, deletes of
    corrupt chunks): set by the StorageManager (:mod:`lmtier.storage.events`)."""

    def keys_now(self) -> list[ChunkKey] | None:
        """Every key the tier holds, from in-process state (a snapshot), or None (the
        default) when it cannot list them without I/O. What rebuilds a view of the
        tier that lost events (:mod:`lmtier.storage.events`)."""
        return None

    def announce_removed(self, keys: Sequence[ChunkKey]) -> None:
        """Tell the event feed that this tier no longer holds ``keys`` (a backend calls
        it for chunks it evicts by itself). Any thread; cheap when nobody listens."""
        if self.events is not None:
            self.events.emit("removed", self.name, keys)

    @classmethod
    async def open(cls: type[_T], *args: Any, **kwargs: Any) -> _T:
        """Build the tier with these arguments and :meth:`start` it."""
        tier = cls(*args, **kwargs)
        await tier.start()
        return tier

    async def start(self) -> None:  # noqa: B027 - nothing to open by default
        """Open what the tier needs (connections, files, threads). Raises BackendError
        when a server cannot be reached, ConfigError when the settings cannot work."""

    @abstractmethod
    async def contains(self, keys: Sequence[ChunkKey]) -> int:
        """How many of ``keys``, from the first, this tier holds (stops at the first miss).

        Raises BackendError when the tier itself cannot answer (see module docstring).
        """

    def contains_now(self, keys: Sequence[ChunkKey]) -> int | None:
        """``contains`` answered from in-process state, without I/O, from any thread.

        Tiers with an in-memory index (CPU, disk) answer here, so a lookup that only
        touches them costs no hop to the event loop; None (the default) means "ask me
        asynchronously". Must not block and must tolerate concurrent mutation by the
        loop thread (plain dict membership tests do, under the GIL).
        """
        return None

    async def get_into(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        """Read each chunk into its buffer; the encoded length per key, or None for a miss.

        Buffers are the cache's slabs, sized for its chunks: a chunk larger than its
        buffer can never be served and is removed like any unservable one. Chunks are
        validated as :meth:`read_chunks` says.
        """
        sizes, _ = await self._read_validated(keys, buffers, decode=self.properties.verify_reads)
        return sizes

    async def read_chunks(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview]
    ) -> list[DecodedChunk | None]:
        """Read each chunk into its buffer and decode it there (zero-copy), or None.

        Chunks are validated here, once for every backend and once per read: the header
        always (its checksum, and that it is the chunk asked for), the payload checksum
        when the tier ``verify_reads``. A corrupt, truncated or misplaced chunk is
        deleted, counted in ``stats.corrupt`` and returned as None.
        """
        _, chunks = await self._read_validated(keys, buffers, decode=True)
        return chunks

    def check_read(self, key: ChunkKey, buffer: memoryview, size: int) -> CheckedRead:
        """Decode and check chunk ``key``, just read into ``buffer[:size]``, as
        :meth:`read_chunks` does. Any thread may call it: a backend reading in worker
        threads calls it there, where it overlaps the other threads' reads (xxhash
        holds the GIL while it hashes, ~0.1 ms a 2 MiB chunk: checks do not overlap
        each other)."""
        try:
            chunk = decode_as(key, buffer[:size], verify=self.properties.verify_reads)
        except CorruptChunk as exc:
            return CheckedRead(size, None, exc)
        return CheckedRead(size, chunk)

    async def _read_validated(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview], *, decode: bool
    ) -> tuple[list[int | None], list[DecodedChunk | None]]:
        """Read; decode (and check) each chunk when ``decode`` or the tier verifies,
        unless the backend already did (a :class:`CheckedRead`)."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        outcomes = await self._read_checked(keys, buffers)
        sizes: list[int | None] = [None] * len(keys)
        chunks: list[DecodedChunk | None] = [None] * len(keys)
        bad: list[ChunkKey] = []
        for index, (key, outcome) in enumerate(zip(keys, outcomes, strict=True)):
            checked, size = (
                (outcome, outcome.size) if isinstance(outcome, CheckedRead) else (None, outcome)
            )
            sizes[index] = size
            if size is None:
                continue
            if size < 0:
                self.stats.unservable += 1
            elif not decode and checked is None:
                continue  # memory this process wrote and checked (get_into, no checks asked)
            else:
                checked = checked or self.check_read(key, buffers[index], size)
                if checked.chunk is not None:
                    chunks[index] = checked.chunk
                    continue
                logger.debug("chunk %s failed validation: %s", key.hex(), checked.problem)
                self.stats.corrupt += 1
            bad.append(key)
            sizes[index] = None
        if bad:
            logger.warning("%s: %d corrupt or unservable chunk(s) deleted", self.name, len(bad))
            await self.delete(bad)
            self.announce_removed(bad)
        hits = sum(size is not None for size in sizes)
        self.stats.hits += hits
        self.stats.misses += len(keys) - hits
        self.stats.bytes_read += sum(size for size in sizes if size is not None)
        return sizes, chunks

    async def _read_checked(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview]
    ) -> Sequence[int | CheckedRead | None]:
        """What :meth:`_read_validated` reads with: ``_read_into`` unless a backend
        overrides it to check chunks as it reads them (a :class:`CheckedRead` each)."""
        return await self._read_into(keys, buffers)

    @abstractmethod
    async def _read_into(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        """Backend read: raw bytes of each chunk into its buffer; its length, None (absent
        or failed) or :data:`UNSERVABLE` (present, never servable: larger than the buffer,
        of the wrong type). Validation and hit/miss counting are the caller's."""

    @abstractmethod
    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> int:
        """Store encoded chunks (atomically each: a reader sees all of a chunk or none).

        Returns how many were stored; failures are counted, never raised.
        """

    @abstractmethod
    async def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Remove chunks; returns how many were present."""

    async def purge(self, namespace: bytes) -> int:
        """Delete every chunk of one namespace: every key that starts with the 16-byte
        digest ``namespace``. Returns how many were deleted (counted in ``stats.purged``).

        InvalidRequestError unless ``namespace`` is 16 bytes (a shorter prefix would take
        other namespaces with it); NotSupportedError from a tier that cannot list its
        chunks; BackendError when the tier fails, possibly after deleting some. A chunk
        written by a call that runs concurrently with the purge may survive it (the
        StorageManager keeps its own writes from doing so).
        """
        deleted = await self._purge(check_namespace(namespace))
        self.stats.purged += deleted
        return deleted

    async def _purge(self, namespace: bytes) -> int:
        """Backend purge of the checked 16-byte ``namespace`` (:meth:`purge`). The default
        raises NotSupportedError: a tier that cannot list its chunks cannot find them."""
        raise NotSupportedError(f"{self.name}: this tier cannot list its chunks to purge them")

    async def count_namespace(self, namespace: bytes) -> int:
        """How many chunks of one namespace the tier holds: what :meth:`purge` would
        delete now (a purge's dry run). Errors as :meth:`purge` raises them."""
        return await self._count_namespace(check_namespace(namespace))

    async def _count_namespace(self, namespace: bytes) -> int:
        """Backend count for :meth:`count_namespace`; the default, NotSupportedError."""
        raise NotSupportedError(f"{self.name}: this tier cannot list its chunks to count them")

    async def pin(self, keys: Sequence[ChunkKey]) -> int:
        """Exempt the chunks of ``keys`` that this tier holds from eviction, as long as
        its pin cap allows; how many of ``keys`` are pinned now. Absent chunks are
        skipped (pin after the chunks were written: ``flush`` first). NotSupportedError
        from a tier that does not evict by LRU."""
        pins = self._require_pins()
        pinned = 0
        for key in keys:
            size = self._held_size(key)
            if size is None:
                continue
            if pins.add(key, size):
                pinned += 1
            else:
                self.stats.pins_refused += 1
        await self._pins_changed()
        return pinned

    async def unpin(self, keys: Sequence[ChunkKey] | None = None) -> int:
        """Make these chunks (None: every pinned chunk) evictable again; how many were
        pinned. NotSupportedError from a tier that does not pin."""
        pins = self._require_pins()
        count = pins.clear() if keys is None else pins.discard_many(keys)
        if count:
            await self._pins_changed()
        return count

    def _require_pins(self) -> Pins:
        if self.pins is None:
            raise NotSupportedError(f"{self.name}: this tier does not pin chunks")
        return self.pins

    def _held_size(self, key: ChunkKey) -> int | None:
        """Bytes chunk ``key`` takes in this tier, if it holds it (for :meth:`pin`)."""
        return None

    async def _pins_changed(self) -> None:
        """Persist :attr:`pins` after a change, where they have a file (a tier whose
        chunks outlive its process); a failure is counted and logged, never raised."""
        pins = self.pins
        if pins is None or pins.path is None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(None, pins.save)
        except OSError as exc:
            self.stats.errors += 1
            logger.warning("%s: cannot save its pins to %s: %s", self.name, pins.path, exc)

    def usage(self) -> dict[str, int]:
        """What the tier holds, for ``stats``: ``capacity_bytes``, ``used_bytes``,
        ``chunks``, and ``pinned_bytes``/``pinned_chunks`` where it pins (refusals are
        counted in ``stats.pins_refused``). Empty (the default) for a tier that cannot
        tell cheaply (Redis, S3)."""
        return {}

    def _pin_usage(self) -> dict[str, int]:
        pins = self.pins
        if pins is None:
            return {}
        return {"pinned_bytes": pins.nbytes, "pinned_chunks": len(pins)}

    async def close(self) -> None:  # noqa: B027 - a no-op is the right default
        """Release connections, threads and files. Idempotent."""
