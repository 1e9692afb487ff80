""":class:`SidecarClient`: the :class:`~lmtier.LMTier` interface, served by a sidecar.

``LMTier.connect("unix:///run/lmtier/sidecar.sock", kv=spec, model_id=...)`` gives an
engine the same methods as the embedded facade (lookup, load, store, the key-level
calls) over :mod:`.connection`. Hashing, argument checks and framing are the
facade's own code, run in this process; what differs is where chunks live:

* **Shared memory** (a unix socket, the sidecar's user): a load leases slabs of the
  sidecar's pool and this process reads them in place (zero copies until the caller
  copies the KV out); a store leases free slabs, writes the KV into them, and
  commits. The handles are :class:`RemoteSlab` leases: releasing one tells the
  sidecar (in the background), and using one after its lease's deadline raises.
* **Streaming** (TCP, another user, or ``shared_memory=False``): chunk bytes travel
  in gRPC messages, into and out of a small private pool of this process.

A sidecar that is down costs misses: lookups find nothing, loads load nothing, stores
store nothing (see :mod:`.connection` for the backoff and reconnects).
Evictions happen in the sidecar; this process's evict listeners are never called.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from lmtier.api import LMTier
from lmtier.chunks.keys import ChunkKey, Namespace
from lmtier.config import LMTierConfig, Secret
from lmtier.errors import CacheClosedError, HandleError, InvalidRequestError
from lmtier.kv_spec import KVSpec
from lmtier.results import HostMemory, LoadResult
from lmtier.sidecar.connection import ClientSession, Connection, SidecarUnavailable
from lmtier.storage.check import ChunkCheck
from lmtier.storage.lookup import LoadedChunk, Lookup, TierSpan
from lmtier.storage.manager import EvictListener
from lmtier.storage.memory import HostPool, SlabHandle
from lmtier.v1 import sidecar_pb2 as pb

__all__ = ["RemoteSlab", "SidecarClient"]

logger = logging.getLogger(__name__)

LEASE_MARGIN = 0.9
"""Part of a lease's life this client uses: it stops touching a slab well before the
sidecar may reclaim it."""
MAX_NAMESPACES = 1024


class RemoteSlab(SlabHandle):
    """A lease on a slab of the sidecar's shared pool (module docstring). One owner:
    :meth:`share` is refused; :meth:`release` queues the end of the lease."""

    __slots__ = ("_connection", "_deadline", "_lease", "_session")

    def __init__(
        self,
        pool: HostPool,
        index: int,
        *,
        lease: int,
        session: ClientSession,
        connection: Connection,
        deadline: float,
    ) -> None:
        super().__init__(pool, index)
        self._lease = lease
        self._session = session
        self._connection = connection
        self._deadline = deadline

    @property
    def lease(self) -> int:
        return self._lease

    @property
    def session(self) -> ClientSession:
        return self._session

    @property
    def refcount(self) -> int:
        return 0 if self._released else 1

    def share(self) -> SlabHandle:
        raise HandleError("a sidecar slab has one owner here: copy out of it instead")

    def release(self) -> None:
        if self._released:
            raise HandleError(f"slab {self._index}: lease released twice")
        self._released = True
        self._connection.release(self._session, self._lease)

    def handed_over(self) -> None:
        """The sidecar took the slab (a commit): this lease ends without a release."""
        self._released = True

    def _check_usable(self, what: str) -> None:
        super()._check_usable(what)
        if time.monotonic() >= self._deadline:
            raise HandleError(f"slab {self._index}: {what} used after its sidecar lease expired")


class SidecarClient(LMTier):
    """The LMTier interface over a sidecar at ``target`` (module docstring). Build it
    with :meth:`LMTier.connect`."""

    def __init__(
        self,
        target: str,
        config: LMTierConfig,
        kv: KVSpec,
        *,
        token: str | Secret | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        shared_memory: bool = True,
        timeout_s: float = 10.0,
        client_name: str = "",
        staging_bytes: int = 64 * 1024**2,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, kv, **kwargs)
        self.target = target
        self._token = Secret(token) if isinstance(token, str) else token
        self._credentials = credentials
        self._shared_memory = shared_memory
        self._timeout_s = timeout_s
        self._client_name = client_name
        self._staging_bytes = staging_bytes
        self._connection: Connection | None = None
        self._local: HostPool | None = None
        self._check = ChunkCheck(kv.geometry(self.chunk_size))
        self._digests: dict[bytes, Namespace] = {}

    def start(self) -> SidecarClient:
        """Connect and open the base namespace's session (a sidecar that is down is
        logged, not raised: calls miss until it is up)."""
        with self._lock:
            if self._closed:
                raise CacheClosedError("this client was closed; connect again")
            if self._connection is not None:
                return self
            self._connection = Connection(
                self.target,
                token=self._token,
                credentials=self._credentials,
                shared_memory=self._shared_memory,
                timeout_s=self._timeout_s,
                client_name=self._client_name,
            )
        try:
            self._connection.session(self.namespace())
        except SidecarUnavailable as exc:
            logger.warning(
                "sidecar %s not reachable yet (%s): misses until it is", self.target, exc
            )
        return self

    def close(self) -> None:
        """End every session (the sidecar gets every slab back) and the channel."""
        with self._lock:
            connection, local = self._connection, self._local
            self._connection = self._local = None
            self._closed = True
        if connection is not None:
            connection.close()
        if local is not None:
            local.close()

    def _check_open(self) -> None:
        if self._connection is None:
            state = "closed" if self._closed else "not started; use LMTier.connect(...)"
            raise CacheClosedError(f"this sidecar client is {state}")

    def _conn(self) -> Connection:
        self._check_open()
        assert self._connection is not None  # checked just above
        return self._connection

    def namespace(self, cache_salt: str = "") -> Namespace:
        found = super().namespace(cache_salt)
        digests = self._digests
        if found.digest not in digests:
            if len(digests) >= MAX_NAMESPACES:
                del digests[next(iter(digests))]
            digests[found.digest] = found
        return found

    def _namespace_of(self, digest: bytes) -> Namespace:
        namespace = self._digests.get(digest)
        if namespace is None:
            raise InvalidRequestError("these keys are of no namespace this client made")
        return namespace

    def _session_of(self, keys: Sequence[ChunkKey]) -> ClientSession:
        digest = keys[0][:16]
        if any(key[:16] != digest for key in keys):
            raise InvalidRequestError("one call's keys must all be of one namespace")
        return self._conn().session(self._namespace_of(digest))

    # ---- lookups -------------------------------------------------------------------

    def _lookup(self, keys: Sequence[ChunkKey], *, local_only: bool) -> Lookup:
        connection = self._conn()
        if not keys:
            return Lookup(0, ())
        try:
            session = self._session_of(keys)
            request = pb.LookupRequest(
                session_id=session.id, keys=b"".join(keys), local_only=local_only
            )
            reply = connection.call(connection.stub.Lookup, request)
        except SidecarUnavailable:
            return Lookup(0, ())
        spans = tuple(TierSpan(s.tier, s.start, s.stop) for s in reply.spans)
        return Lookup(min(reply.num_chunks, len(keys)), spans)

    # ---- loads ---------------------------------------------------------------------

    def _load(self, keys: Sequence[ChunkKey], lookup: Lookup | None, origin: str) -> LoadResult:
        connection = self._conn()
        chunks: list[LoadedChunk] = []
        if keys:
            try:
                session = self._session_of(keys)
                request = pb.LoadRequest(session_id=session.id, keys=b"".join(keys))
                if lookup is not None:
                    request.lookup.extend(
                        pb.TierSpan(tier=s.tier, start=s.start, stop=s.stop) for s in lookup.spans
                    )
                if session.pool is not None:
                    chunks = self._load_shared(connection, session, request, keys)
                else:
                    chunks = self._load_streamed(connection, request, keys)
            except SidecarUnavailable:
                chunks = []
        return LoadResult(chunks, self.chunk_size, self.kv_spec.token_axis, origin)

    def _load_shared(
        self,
        connection: Connection,
        session: ClientSession,
        request: pb.LoadRequest,
        keys: Sequence[ChunkKey],
    ) -> list[LoadedChunk]:
        pool = session.pool
        assert pool is not None  # the caller checked
        sent = time.monotonic()
        reply = connection.call(connection.stub.Load, request)
        deadline = sent + session.info.lease_ttl_s * LEASE_MARGIN
        handles: list[SlabHandle] = []
        for item in reply.chunks:
            if len(handles) == len(keys) or item.slab >= pool.num_slabs:
                connection.release(session, item.lease)  # not what was asked: give it back
                continue
            handles.append(
                RemoteSlab(
                    pool,
                    item.slab,
                    lease=item.lease,
                    session=session,
                    connection=connection,
                    deadline=deadline,
                )
            )
        return self._checked(keys, handles, [(c.length, c.tier) for c in reply.chunks])

    def _load_streamed(
        self, connection: Connection, request: pb.LoadRequest, keys: Sequence[ChunkKey]
    ) -> list[LoadedChunk]:
        pool = self._local_pool()
        handles: list[SlabHandle] = []
        meta: list[tuple[int, str]] = []
        filled: list[int] = []
        stream = connection.stub.LoadStream(
            request, timeout=connection.timeout_s, metadata=connection.metadata
        )
        try:
            for piece in stream:
                if piece.offset == 0:
                    if len(handles) == len(keys) or not 0 < piece.total_length <= pool.slab_bytes:
                        break
                    handle = pool.acquire()
                    if handle is None:
                        break  # the private pool is full: the rest is a miss
                    handles.append(handle)
                    meta.append((piece.total_length, piece.tier))
                    filled.append(0)
                end = piece.offset + len(piece.data)
                if not handles or piece.offset != filled[-1] or end > meta[-1][0]:
                    break
                handles[-1].view[piece.offset : end] = piece.data
                filled[-1] = end
        except grpc.RpcError as exc:
            connection.failed(exc)
        finally:
            stream.cancel()
        whole = next((i for i, f in enumerate(filled) if f != meta[i][0]), len(handles))
        for partial in handles[whole:]:
            partial.release()
        return self._checked(keys, handles[:whole], meta[:whole])

    def _checked(
        self, keys: Sequence[ChunkKey], handles: Sequence[SlabHandle], meta: Sequence[Any]
    ) -> list[LoadedChunk]:
        """Loaded chunks that are what was asked for (header, key, geometry), up to the
        first that is not; the rest are released."""
        chunks: list[LoadedChunk] = []
        for index, handle in enumerate(handles):
            length, tier = meta[index]
            chunk = (
                self._check.header(keys[index], handle.view[:length])
                if len(chunks) == index and length <= len(handle.view)
                else None
            )
            if chunk is None:
                handle.release()
                continue
            chunks.append(LoadedChunk(keys[index], tier, chunk, handle))
        return chunks

    def _local_pool(self) -> HostPool:
        with self._lock:
            if self._local is None:
                slab = self.kv_spec.encoded_chunk_bytes(self.chunk_size)
                self._local = HostPool.for_chunks(slab, max(self._staging_bytes, slab), align=64)
            return self._local

    # ---- stores --------------------------------------------------------------------

    def acquire_slabs(self, count: int) -> list[SlabHandle]:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InvalidRequestError(f"count must be an int >= 0, got {count!r}")
        connection = self._conn()
        if count == 0:
            return []
        try:
            session = connection.session(self.namespace())
        except SidecarUnavailable:
            return []
        if session.pool is None:
            pool = self._local_pool()
            return [h for h in (pool.acquire() for _ in range(count)) if h is not None]
        sent = time.monotonic()
        try:
            reply = connection.call(
                connection.stub.AcquireSlabs,
                pb.AcquireSlabsRequest(session_id=session.id, count=count),
            )
        except SidecarUnavailable:
            return []
        deadline = sent + session.info.lease_ttl_s * LEASE_MARGIN
        return [
            RemoteSlab(
                session.pool,
                grant.slab,
                lease=grant.lease,
                session=session,
                connection=connection,
                deadline=deadline,
            )
            for grant in reply.slabs
        ]

    def put_encoded(self, encoded: Sequence[tuple[ChunkKey, SlabHandle, int]]) -> int:
        connection = self._conn()
        if not encoded:
            return 0
        stored = 0
        try:
            for digest in {key[:16] for key, _, _ in encoded}:  # the sidecar must know each
                connection.session(self._namespace_of(digest))
            shared = [item for item in encoded if isinstance(item[1], RemoteSlab)]
            local = [item for item in encoded if not isinstance(item[1], RemoteSlab)]
            stored += self._commit(connection, shared)
            stored += self._stream_store(connection, local)
        except SidecarUnavailable:
            pass
        finally:
            for _, handle, _ in encoded:
                if not handle.released:
                    handle.release()
        return stored

    def _commit(
        self, connection: Connection, items: Sequence[tuple[ChunkKey, SlabHandle, int]]
    ) -> int:
        by_session: dict[ClientSession, list[tuple[ChunkKey, RemoteSlab, int]]] = {}
        for key, handle, length in items:
            assert isinstance(handle, RemoteSlab)
            by_session.setdefault(handle.session, []).append((key, handle, length))
        stored = 0
        for session, group in by_session.items():
            request = pb.CommitRequest(session_id=session.id)
            for key, handle, length in group:
                request.chunks.add(lease=handle.lease, key=key, length=length)
            reply = connection.call(connection.stub.Commit, request)
            for _, handle, _ in group:
                handle.handed_over()
            stored += reply.stored
        return stored

    def _stream_store(
        self, connection: Connection, items: Sequence[tuple[ChunkKey, SlabHandle, int]]
    ) -> int:
        if not items:
            return 0
        session = self._session_of([items[0][0]])
        piece = 1024**2

        def pieces() -> Iterator[pb.ChunkPiece]:
            first = True
            for key, handle, length in items:
                view = handle.view
                for offset in range(0, length, piece):
                    data = bytes(view[offset : min(offset + piece, length)])
                    message = pb.ChunkPiece(offset=offset, data=data)
                    if offset == 0:
                        message.key, message.total_length = key, length
                    if first:
                        message.session_id, first = session.id, False
                    yield message

        reply = connection.call(connection.stub.StoreStream, pieces())
        return int(reply.stored)

    # ---- the rest ------------------------------------------------------------------

    def host_memory(self) -> HostMemory:
        """This process's own host memory (the private streaming pool, if any); the
        sidecar's is in :meth:`stats` under ``sidecar``."""
        self._check_open()
        pool = self._local
        return HostMemory(
            total_bytes=pool.nbytes if pool else 0,
            slab_bytes=pool.slab_bytes if pool else 0,
            slabs=pool.num_slabs if pool else 0,
            slabs_in_use=pool.num_in_use if pool else 0,
            cached_chunks=0,
            cache_capacity_chunks=0,
        )

    def in_memory(self, key: ChunkKey) -> bool:
        """Always False: this process holds no CPU tier (the sidecar does)."""
        self._check_open()
        return False

    def add_evict_listener(self, callback: EvictListener) -> None:
        """Accepted and never called: evictions happen in the sidecar."""
        self._check_open()

    def remove_evict_listener(self, callback: EvictListener) -> None:
        """A no-op (see :meth:`add_evict_listener`)."""

    def flush(self) -> None:
        """Wait until the sidecar has attempted the background writes queued so far."""
        connection = self._conn()
        try:
            session = connection.session(self.namespace())
            connection.call(
                connection.stub.Flush,
                pb.FlushRequest(session_id=session.id),
                timeout_s=max(connection.timeout_s, 60.0),
            )
        except SidecarUnavailable:
            return

    def stats(self) -> dict[str, dict[str, object]]:
        """The sidecar's counters: each tier's, and ``sidecar`` (sessions, leases,
        slabs); empty while it is unreachable."""
        connection = self._conn()
        try:
            session = connection.session(self.namespace())
            reply = connection.call(connection.stub.Stats, pb.StatsRequest(session_id=session.id))
        except SidecarUnavailable:
            return {}
        out: dict[str, dict[str, object]] = {
            tier: dict(counters.values) for tier, counters in reply.tiers.items()
        }
        out["sidecar"] = dict(reply.sidecar.values)
        return out

    def purge(self, cache_salt: str = "") -> dict[str, int]:
        """:meth:`LMTier.purge`, done by the sidecar (tiers that failed or cannot list
        are left out); SidecarUnavailable while it is unreachable."""
        connection = self._conn()
        session = connection.session(self.namespace(cache_salt))
        reply = connection.call(connection.stub.Purge, pb.PurgeRequest(session_id=session.id))
        return dict(reply.deleted)
