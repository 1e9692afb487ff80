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
store nothing (see :mod:`.connection` for the backoff and reconnects). A namespace
the token's scope does not cover (another cache salt or model) raises
PermissionDeniedError for the call that names it, and only for it.
Evictions happen in the sidecar; this process's evict listeners are never called.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from lmtier.api import LMTier
from lmtier.chunks.keys import NAMESPACE_BYTES, ChunkKey, Namespace
from lmtier.config import LMTierConfig, Secret
from lmtier.errors import CacheClosedError, InvalidRequestError, PermissionDeniedError
from lmtier.kv_spec import KVSpec
from lmtier.maintenance import checked_keys
from lmtier.remote.connection import ClientSession, Connection, SidecarUnavailable
from lmtier.remote.heap import reuses_freed_memory
from lmtier.remote.slabs import (
    LEASE_MARGIN,
    RemoteSlab,
    checked_chunks,
    commit_shared,
    granted_slabs,
    leased_chunks,
    reserve_shared,
)
from lmtier.remote.streaming import StoreStreams, in_messages, receive_chunks
from lmtier.results import HostMemory, LoadResult
from lmtier.storage.check import ChunkCheck
from lmtier.storage.lookup import LoadedChunk, Lookup, TierSpan
from lmtier.storage.manager import EvictListener
from lmtier.storage.memory import HostPool, SlabHandle
from lmtier.storing import Reserved
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.wire.address import default_listen, parse_listen

__all__ = ["SidecarClient", "sidecar_target"]

logger = logging.getLogger(__name__)

MAX_NAMESPACES = 1024
SUB_LOAD = 32
"""Chunks per Load when a long load is pipelined on the lane."""


def sidecar_target(config: LMTierConfig) -> str:
    """Where ``lmtier serve`` listens with ``config`` when no ``--listen`` is given: its
    ``sidecar.listen``, else the default socket (:func:`.listen.default_listen`, from
    this process's environment, as the server reads its own)."""
    return parse_listen(config.sidecar.listen or default_listen(os.environ)).grpc_target


class SidecarClient(LMTier):
    """The LMTier interface over a sidecar at ``target`` (module docstring). Build it
    with :meth:`LMTier.connect`."""

    store_batch = 8
    """Chunks per Commit (each in flight while the next batch is copied), or per
    hand-over to a store's StoreStream (:meth:`_local_pool`)."""

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
        self._sending = StoreStreams()

    def start(self) -> SidecarClient:
        """Connect and open the base namespace's session (a sidecar that is down is
        logged, not raised: calls miss until it is up; a token scoped to cache salts,
        which may not open the unsalted namespace, opens its sessions as calls name
        the salts)."""
        connection = self._connect()
        if connection is None:
            return self
        try:
            connection.session(self.namespace())
        except SidecarUnavailable as exc:
            logger.warning(
                "sidecar %s not reachable yet (%s): misses until it is", self.target, exc
            )
        except PermissionDeniedError as exc:
            logger.info("sidecar %s: no unsalted session for this token (%s)", self.target, exc)
        return self

    def check(self, cache_salt: str = "") -> SidecarClient:
        """Connect (as :meth:`start`, if not yet) and open a session of
        ``namespace(cache_salt)`` now, or raise why not, logging nothing:
        BackendUnavailable (the sidecar did not answer), AuthenticationError (it refused
        the token), PermissionDeniedError (the token does not cover that namespace).
        For tools that must not take "no sidecar" for "nothing cached"
        (:mod:`lmtier.ops.caches`); an engine just calls, and misses meanwhile."""
        self._connect()
        self._conn().check(self.namespace(cache_salt))
        return self

    def _connect(self) -> Connection | None:
        """The connection, made now (None: it was made before)."""
        with self._lock:
            if self._closed:
                raise CacheClosedError("this client was closed; connect again")
            if self._connection is not None:
                return None
            self._connection = Connection(
                self.target,
                token=self._token,
                credentials=self._credentials,
                shared_memory=self._shared_memory,
                timeout_s=self._timeout_s,
                client_name=self._client_name,
            )
            return self._connection

    def close(self) -> None:
        """End every session (the sidecar gets every slab back) and the channel."""
        with self._lock:
            connection, local = self._connection, self._local
            self._connection = self._local = None
            self._closed = True
        if connection is not None:
            connection.close()
        self._sending.wait_all()  # ended by the channel's close: their slabs come back
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

    def _lookup_now(self, keys: Sequence[ChunkKey]) -> Lookup | None:
        return None  # every answer is a call to the sidecar

    def _lookup(self, keys: Sequence[ChunkKey], *, local_only: bool) -> Lookup:
        connection = self._conn()
        if not keys:
            return Lookup(0, ())
        try:
            session = self._session_of(keys)
            request = pb.LookupRequest(
                session_id=session.id, keys=b"".join(keys), local_only=local_only
            )
            reply = connection.unary(session, "Lookup", request)
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
                    request.release.extend(connection.take_releases(session))
                    chunks = self._load_shared(connection, session, request, keys)
                else:
                    chunks = self._load_streamed(connection, request, keys)
            except SidecarUnavailable:
                chunks = []
        return LoadResult(chunks, self.chunk_size, self.kv_spec, origin)

    def _load_shared(
        self,
        connection: Connection,
        session: ClientSession,
        request: pb.LoadRequest,
        keys: Sequence[ChunkKey],
    ) -> list[LoadedChunk]:
        """A load through shared memory. On the lane, a long one is asked as several
        pipelined Loads (``SUB_LOAD`` chunks each), so this client checks one part's
        chunks while the sidecar serves the next."""
        parts = [(request, keys)]
        if session.lane is not None and len(keys) > SUB_LOAD and not request.lookup:
            parts = [
                (
                    pb.LoadRequest(session_id=session.id, keys=b"".join(keys[i : i + SUB_LOAD])),
                    keys[i : i + SUB_LOAD],
                )
                for i in range(0, len(keys), SUB_LOAD)
            ]
            parts[0][0].release.extend(request.release)
        sent = time.monotonic()
        answers = [connection.start(session, "Load", part) for part, _ in parts]
        deadline = sent + session.info.lease_ttl_s * LEASE_MARGIN
        chunks: list[LoadedChunk] = []
        complete = True
        for (_, part_keys), answer in zip(parts, answers, strict=True):
            try:
                reply = answer()
            except SidecarUnavailable:
                complete = False  # the rest (if any come) is given back below
                continue
            if not complete:  # past the first miss: not part of the prefix
                for item in reply.chunks:
                    connection.release(session, item.lease)
                continue
            got = leased_chunks(
                self._check, connection, session, part_keys, reply, deadline=deadline
            )
            chunks += got
            complete = len(got) == len(part_keys)
        return chunks

    def _load_streamed(
        self, connection: Connection, request: pb.LoadRequest, keys: Sequence[ChunkKey]
    ) -> list[LoadedChunk]:
        handles, meta = receive_chunks(connection, request, self._local_pool(), len(keys))
        return checked_chunks(self._check, keys, handles, meta)

    def _local_pool(self) -> HostPool:
        with self._lock:
            if self._local is None:
                slab = self.kv_spec.encoded_chunk_bytes(self.chunk_size)
                self._local = HostPool.for_chunks(slab, max(self._staging_bytes, slab), align=64)
                # A store is one StoreStream fed batch by batch (streaming.py), half
                # the pool a batch: one is sent while the next is copied. (Batches of
                # 8 ran slower here: 0.74-0.79x a raw stream against 0.84-0.88x.)
                self.store_batch = max(1, self._local.num_slabs // 2)
            return self._local

    # ---- stores --------------------------------------------------------------------

    def acquire_slabs(self, count: int) -> list[SlabHandle]:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InvalidRequestError(f"count must be an int >= 0, got {count!r}")
        connection = self._conn()
        if count == 0:
            return []
        try:
            session = connection.any_session(self.namespace())
            return self._acquire(connection, session, count)
        except SidecarUnavailable:
            return []

    def _reserve(
        self, keys: Sequence[ChunkKey], skip: int | None, count: int
    ) -> tuple[int, Reserved]:
        """What the sidecar already holds (``skip`` when given), and slabs for the rest."""
        if not keys or count == 0:
            return (0 if skip is None else skip), Reserved()
        connection = self._conn()
        try:
            session = self._session_of(keys)
            if session.pool is not None:
                step = self.store_batch
                return reserve_shared(connection, session, keys, skip=skip, count=count, step=step)
            present = skip if skip is not None else self._lookup(keys, local_only=True).num_chunks
            self._sending.begin()  # this store's chunks travel in one call
            try:
                slabs = self._acquire(connection, session, min(count, len(keys) - present))
            except BaseException:
                self._sending.end()
                raise
            return present, Reserved(slabs, done=self._sending.end)
        except SidecarUnavailable:
            return len(keys), Reserved()  # nothing can be stored now: skip it all

    def _acquire(
        self, connection: Connection, session: ClientSession, count: int
    ) -> list[SlabHandle]:
        """Slabs to fill: the shared pool's (one AcquireSlabs), or this process's when
        streaming."""
        if session.pool is None:
            pool = self._local_pool()
            slabs = self._sending.acquire(pool, count)
            if self._sending.storing and reuses_freed_memory():  # each chunk into its message
                slabs = in_messages(pool, slabs, session.id, self._framer.template.encoded_size)
            return slabs
        request = pb.AcquireSlabsRequest(
            session_id=session.id, count=count, release=connection.take_releases(session)
        )
        sent = time.monotonic()
        reply = connection.unary(session, "AcquireSlabs", request)
        return granted_slabs(connection, session, reply, sent)

    def put_encoded(self, encoded: Sequence[tuple[ChunkKey, SlabHandle, int]]) -> int:
        return self._hand_over(encoded)()

    def _hand_over(self, encoded: Sequence[tuple[ChunkKey, SlabHandle, int]]) -> Callable[[], int]:
        """Commit shared slabs and stream private ones (both in flight when this
        returns: :mod:`lmtier.storing` copies the next batch meanwhile); a function
        that waits for the sidecar's answers and says how many it stored."""
        connection = self._conn()
        waits: list[Callable[[], int]] = []
        shared = [item for item in encoded if isinstance(item[1], RemoteSlab)]
        local = [item for item in encoded if not isinstance(item[1], RemoteSlab)]
        try:
            for digest in {key[:16] for key, _, _ in encoded}:  # the sidecar must know each
                connection.session(self._namespace_of(digest))
            waits.extend(commit_shared(connection, shared))
            if local:
                waits.append(self._stream_store(connection, local))
                local = []  # the call in flight owns their slabs now
        except SidecarUnavailable:
            pass
        finally:
            for _, handle, _ in shared + local:
                if not handle.released:
                    handle.release()
        return lambda: sum(wait() for wait in waits)

    def _stream_store(
        self, connection: Connection, items: Sequence[tuple[ChunkKey, SlabHandle, int]]
    ) -> Callable[[], int]:
        session = self._session_of([items[0][0]])
        return self._sending.send(
            connection, session.id, items, max_chunks=self._local_pool().num_slabs
        )

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
        """Wait until the sidecar has attempted the background writes queued so far
        (nothing to wait for when its token has opened no session: no store was)."""
        connection = self._conn()
        try:
            session = connection.any_session(self.namespace())
            connection.call(
                connection.stub.Flush,
                pb.FlushRequest(session_id=session.id),
                timeout_s=max(connection.timeout_s, 60.0),
            )
        except (SidecarUnavailable, PermissionDeniedError):
            return

    def stats(self) -> dict[str, dict[str, object]]:
        """The sidecar's counters: each tier's, and ``sidecar`` (sessions, leases,
        slabs); empty while it is unreachable. Asked through any session of this
        client (PermissionDeniedError when its token covers none it has opened)."""
        connection = self._conn()
        try:
            session = connection.any_session(self.namespace())
            reply = connection.call(connection.stub.Stats, pb.StatsRequest(session_id=session.id))
        except SidecarUnavailable:
            return {}
        out: dict[str, dict[str, object]] = {
            tier: dict(counters.values) for tier, counters in reply.tiers.items()
        }
        out["sidecar"] = dict(reply.sidecar.values)
        return out

    def purge(self, cache_salt: str = "", *, dry_run: bool = False) -> dict[str, int]:
        """:meth:`LMTier.purge`, done by the sidecar (tiers that failed or cannot list
        are left out); SidecarUnavailable while it is unreachable, PermissionDeniedError
        for a salt the token does not cover."""
        connection = self._conn()
        session = connection.session(self.namespace(cache_salt))
        request = pb.PurgeRequest(session_id=session.id, dry_run=dry_run)
        reply = connection.call(connection.stub.Purge, request)
        return dict(reply.deleted)

    def pin_keys(self, keys: Sequence[ChunkKey]) -> dict[str, int]:
        """:meth:`LMTier.pin_keys`, in the sidecar's tiers (its host-memory pins last as
        long as the sidecar); SidecarUnavailable while it is unreachable."""
        return self._pin(checked_keys(keys), unpin=False) if keys else {}

    def unpin_keys(self, keys: Sequence[ChunkKey] | None = None) -> dict[str, int]:
        """:meth:`LMTier.unpin_keys` in the sidecar's tiers; ``keys`` None unpins every
        chunk of this client's namespace (no more: other tenants' pins are theirs)."""
        if keys is not None and not checked_keys(keys):
            return {}
        return self._pin(keys or [], unpin=True)

    def _pin(self, keys: Sequence[ChunkKey], *, unpin: bool) -> dict[str, int]:
        # One Pin per namespace the keys belong to (a session each: the sidecar checks
        # every key against its session's namespace); no keys: this model's own.
        connection = self._conn()
        groups: dict[bytes, list[ChunkKey]] = {self.namespace().digest: []} if not keys else {}
        for key in keys:
            groups.setdefault(key[:NAMESPACE_BYTES], []).append(key)
        counts: dict[str, int] = {}
        for digest, group in groups.items():
            session = connection.session(self._namespace_of(digest))
            request = pb.PinRequest(session_id=session.id, keys=b"".join(group), unpin=unpin)
            for tier, count in connection.call(connection.stub.Pin, request).pinned.items():
                counts[tier] = counts.get(tier, 0) + count
        return counts
