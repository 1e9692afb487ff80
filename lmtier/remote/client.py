""":class:`SidecarStore`: a :class:`~lmtier.store.ChunkStore` whose chunks live in a
sidecar, and :func:`connect`, the facade over it.

``lmtier.connect("unix:///run/lmtier/sidecar.sock", kv=spec, model_id=...)`` gives an
engine an :class:`~lmtier.LMTier` with every method of the embedded one (lookup,
load, store, the key-level calls); hashing, argument checks and framing are the
facade's own code, run in this process, and each store call is one or two RPCs
over :mod:`.connection`. A reservation runs one way: this store asks
:mod:`.slabs` (shared memory: the lease protocol's one owner) or :mod:`.streaming`
(private slabs), and they call the connection. Where chunks travel:

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
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from lmtier.api import LMTier
from lmtier.chunks.keys import NAMESPACE_BYTES, ChunkKey, Namespace
from lmtier.config import LMTierConfig, Secret, load_config
from lmtier.errors import CacheClosedError, InvalidRequestError, PermissionDeniedError
from lmtier.kv_spec import KVSpec
from lmtier.remote.connection import ClientSession, Connection, SidecarUnavailable
from lmtier.remote.heap import reuses_freed_memory
from lmtier.remote.slabs import (
    RemoteSlab,
    acquire_shared,
    checked_chunks,
    commit_shared,
    load_shared,
    reserve_shared,
)
from lmtier.remote.streaming import StoreStreams, in_messages, receive_chunks
from lmtier.results import HostMemory
from lmtier.storage.check import ChunkCheck
from lmtier.storage.host_pool import HostPool, SlabHandle
from lmtier.storage.lookup import LoadedChunk, Lookup, TierSpan
from lmtier.store import Encoded, Reserved, StoreLayout
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.wire.address import default_listen, parse_listen
from lmtier.wire.keepalive import DEFAULT_KEEPALIVE_S

if TYPE_CHECKING:
    from lmtier.storage.events import ChunkName
    from lmtier.storage.manager import EvictListener

__all__ = ["SidecarStore", "connect", "sidecar_target"]

logger = logging.getLogger(__name__)

STORE_BATCH = 16
"""Chunks per Commit (each in flight while the next batch is copied). 16, not 8:
fewer hand-offs between the copying threads (64 SGLang pages of 2 MiB into the
sidecar's shared slabs: 17.5 ms, against 19.5 ms in batches of 8; 32: the same)."""


def sidecar_target(config: LMTierConfig) -> str:
    """Where ``lmtier serve`` listens with ``config`` when no ``--listen`` is given: its
    ``sidecar.listen``, else the default socket (:func:`.listen.default_listen`, from
    this process's environment, as the server reads its own)."""
    return parse_listen(config.sidecar.listen or default_listen(os.environ)).grpc_target


def connect(
    target: str | None = None,
    config: LMTierConfig | None = None,
    *,
    kv: KVSpec,
    token: str | Secret | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    shared_memory: bool = True,
    timeout_s: float = 10.0,
    client_name: str = "",
    staging_bytes: int = 64 * 1024**2,
    **model: Any,
) -> LMTier:
    """A started :class:`~lmtier.LMTier` whose chunks live in the sidecar at ``target``
    (``unix:///path.sock`` or ``host:port``; None: where ``lmtier serve`` listens with
    this config, its ``sidecar.listen`` or else its default socket in
    ``$XDG_RUNTIME_DIR/lmtier``). ``model``: the model's keywords, as
    :meth:`LMTier.open` takes them; the rest are :class:`SidecarStore`'s. A sidecar
    that is down is logged, not raised: calls miss until it is up."""
    config = config if config is not None else load_config()
    store = SidecarStore(
        target if target is not None else sidecar_target(config),
        token=token,
        credentials=credentials,
        shared_memory=shared_memory,
        timeout_s=timeout_s,
        client_name=client_name,
        staging_bytes=staging_bytes,
        keepalive_s=config.sidecar.keepalive_s,
    )
    return LMTier(config, kv, store=store, **model).start()


class SidecarStore:
    """The chunks of a sidecar at ``target`` (module docstring): ``token`` (or
    ``credentials``) is what it asks for; ``shared_memory`` False streams even where
    the pool could be mapped; ``timeout_s`` bounds each call; ``client_name`` names
    this process in the sidecar's logs; ``staging_bytes`` sizes the private pool that
    streamed chunks pass through; ``open_session`` False skips opening the base
    namespace's session at start (a tool that checks its own namespace first);
    ``keepalive_s`` is ``sidecar.keepalive_s``, which must match the sidecar's: it
    refuses pings more often than every half of its own."""

    holds_writes = False  # a stored chunk is the sidecar's once its answer came
    seal_on_copy = False  # the sidecar seals what its tiers take (and may MAC it)

    def __init__(
        self,
        target: str,
        *,
        token: str | Secret | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        shared_memory: bool = True,
        timeout_s: float = 10.0,
        client_name: str = "",
        staging_bytes: int = 64 * 1024**2,
        open_session: bool = True,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
    ) -> None:
        self.target = target
        self._open_session = open_session
        self.store_batch = STORE_BATCH
        """Chunks per Commit, or per hand-over to a store's StoreStream
        (:meth:`_local_pool`)."""
        self._token = Secret(token) if isinstance(token, str) else token
        self._credentials = credentials
        self._shared_memory = shared_memory
        self._timeout_s = timeout_s
        self._client_name = client_name
        self._staging_bytes = staging_bytes
        self._keepalive_s = keepalive_s
        self._layout: StoreLayout | None = None
        self._check: ChunkCheck | None = None
        self._connection: Connection | None = None
        self._local: HostPool | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._sending = StoreStreams()

    def start(self, layout: StoreLayout) -> None:
        """Connect and open the base namespace's session (a sidecar that is down is
        logged, not raised: calls miss until it is up; a token scoped to cache salts,
        which may not open the unsalted namespace, opens its sessions as calls name
        the salts)."""
        self._layout = layout
        self._check = ChunkCheck(layout.kv_spec.geometry(layout.chunk_size))
        connection = self._connect()
        if not self._open_session:
            return
        try:
            connection.session(layout.base)
        except SidecarUnavailable as exc:
            logger.warning(
                "sidecar %s not reachable yet (%s): misses until it is", self.target, exc
            )
        except PermissionDeniedError as exc:
            logger.info("sidecar %s: no unsalted session for this token (%s)", self.target, exc)

    def _connect(self) -> Connection:
        with self._lock:
            if self._closed:
                raise CacheClosedError("this sidecar store was closed; connect again")
            if self._connection is None:
                self._connection = Connection(
                    self.target,
                    token=self._token,
                    credentials=self._credentials,
                    shared_memory=self._shared_memory,
                    timeout_s=self._timeout_s,
                    client_name=self._client_name,
                    keepalive_s=self._keepalive_s,
                )
            return self._connection

    def check(self, namespace: Namespace) -> None:
        """Open ``namespace``'s session now, or raise why not, logging nothing:
        BackendUnavailable (the sidecar did not answer), AuthenticationError (it
        refused the token), PermissionDeniedError (the token does not cover it)."""
        self._conn().check(namespace)

    def close(self, timeout_s: float | None) -> None:
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

    def _conn(self) -> Connection:
        connection = self._connection
        if connection is None:
            raise CacheClosedError("this sidecar store is not connected")
        return connection

    def _parts(self) -> tuple[StoreLayout, ChunkCheck]:
        layout, check = self._layout, self._check
        assert layout is not None and check is not None  # set by start()
        return layout, check

    def _session_of(self, keys: Sequence[ChunkKey]) -> ClientSession:
        digest = keys[0][:NAMESPACE_BYTES]
        if any(key[:NAMESPACE_BYTES] != digest for key in keys):
            raise InvalidRequestError("one call's keys must all be of one namespace")
        return self._conn().session(self._parts()[0].namespace_of(digest))

    def _any_session(self) -> ClientSession:
        return self._conn().any_session(self._parts()[0].base)

    # ---- lookups -------------------------------------------------------------------

    def name_chunks(self, names: Mapping[ChunkKey, ChunkName]) -> None:
        """Nothing: the sidecar's events name its chunks by their keys."""

    def lookup_now(self, keys: Sequence[ChunkKey]) -> Lookup | None:
        """None: every answer is a call to the sidecar."""
        return None

    def lookup(self, keys: Sequence[ChunkKey], *, local_only: bool) -> Lookup:
        connection = self._conn()
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

    def load(self, keys: Sequence[ChunkKey], lookup: Lookup | None) -> list[LoadedChunk]:
        """Leased slabs of the shared pool, read in place (:func:`.slabs.load_shared`),
        or chunks streamed into this process's pool."""
        connection = self._conn()
        check = self._parts()[1]
        try:
            session = self._session_of(keys)
            request = pb.LoadRequest(session_id=session.id, keys=b"".join(keys))
            if lookup is not None:
                request.lookup.extend(
                    pb.TierSpan(tier=s.tier, start=s.start, stop=s.stop) for s in lookup.spans
                )
            if session.pool is not None:
                return load_shared(check, connection, session, request, keys)
            handles, meta = receive_chunks(connection, request, self._local_pool(), len(keys))
            return checked_chunks(check, keys, handles, meta)
        except SidecarUnavailable:
            return []

    def _local_pool(self) -> HostPool:
        with self._lock:
            if self._local is None:
                layout = self._parts()[0]
                slab = layout.kv_spec.encoded_chunk_bytes(layout.chunk_size)
                self._local = HostPool.for_chunks(slab, max(self._staging_bytes, slab), align=64)
                # A store is one StoreStream fed batch by batch (streaming.py), half
                # the pool a batch: one is sent while the next is copied. (Batches of
                # 8 ran slower here: 0.74-0.79x a raw stream against 0.84-0.88x.)
                self.store_batch = max(1, self._local.num_slabs // 2)
            return self._local

    # ---- stores --------------------------------------------------------------------

    def acquire_slabs(self, count: int, *, wait: bool = True) -> list[SlabHandle]:
        """Slabs of the sidecar's pool (the sidecar applies its own back-pressure)."""
        connection = self._conn()
        try:
            return self._acquire(connection, self._any_session(), count)
        except SidecarUnavailable:
            return []

    def reserve(
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
            present = skip if skip is not None else self.lookup(keys, local_only=True).num_chunks
            self._sending.begin()  # this store's chunks travel in one call
            try:
                slabs = self._acquire(connection, session, min(count, len(keys) - present))
            except BaseException:
                self._sending.end()
                raise
            return present, Reserved(slabs, done=self._sending.end)
        except SidecarUnavailable:  # nothing can be stored now, and nothing is known held
            return (skip or 0), Reserved(refused=True)

    def _acquire(
        self, connection: Connection, session: ClientSession, count: int
    ) -> list[SlabHandle]:
        """Slabs to fill: the shared pool's (:func:`.slabs.acquire_shared`), or this
        process's when streaming."""
        if session.pool is not None:
            return acquire_shared(connection, session, count)
        pool = self._local_pool()
        slabs = self._sending.acquire(pool, count)
        if self._sending.storing and reuses_freed_memory():  # each chunk into its message
            encoded_size = self._parts()[0].framer.template.encoded_size
            slabs = in_messages(pool, slabs, session.id, encoded_size)
        return slabs

    def hand_over(self, encoded: Encoded) -> Callable[[], int]:
        """Commit shared slabs and stream private ones (both in flight when this
        returns: :mod:`lmtier.storing` copies the next batch meanwhile); a function
        that waits for the sidecar's answers and says how many it stored."""
        connection = self._conn()
        layout = self._parts()[0]
        waits: list[Callable[[], int]] = []
        shared = [item for item in encoded if isinstance(item[1], RemoteSlab)]
        local = [item for item in encoded if not isinstance(item[1], RemoteSlab)]
        try:
            for digest in {key[:NAMESPACE_BYTES] for key, _, _ in encoded}:  # known to it
                connection.session(layout.namespace_of(digest))
            waits.extend(commit_shared(connection, shared))
            if local:
                session = self._session_of([local[0][0]])
                max_chunks = self._local_pool().num_slabs
                waits.append(
                    self._sending.send(connection, session.id, local, max_chunks=max_chunks)
                )
                local = []  # the call in flight owns their slabs now
        except SidecarUnavailable:
            pass
        finally:
            for _, handle, _ in shared + local:
                if not handle.released:
                    handle.release()
        return lambda: sum(wait() for wait in waits)

    # ---- the rest ------------------------------------------------------------------

    def host_memory(self) -> HostMemory:
        """This process's own host memory (the private streaming pool, if any)."""
        self._conn()
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
        return False

    def add_evict_listener(self, callback: EvictListener) -> None:
        """Accepted and never called: evictions happen in the sidecar."""

    def remove_evict_listener(self, callback: EvictListener) -> None:
        """A no-op (see :meth:`add_evict_listener`)."""

    def flush(self) -> None:
        """Wait until the sidecar has attempted the background writes queued so far
        (nothing to wait for when its token has opened no session: no store was)."""
        connection = self._conn()
        try:
            session = self._any_session()
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
            session = self._any_session()
            reply = connection.call(connection.stub.Stats, pb.StatsRequest(session_id=session.id))
        except SidecarUnavailable:
            return {}
        out: dict[str, dict[str, object]] = {
            tier: dict(counters.values) for tier, counters in reply.tiers.items()
        }
        out["sidecar"] = dict(reply.sidecar.values)
        return out

    def purge(self, namespace: Namespace, *, dry_run: bool) -> dict[str, int]:
        """Done by the sidecar (tiers that failed or cannot list are left out);
        SidecarUnavailable while it is unreachable, PermissionDeniedError for a
        namespace the token does not cover."""
        connection = self._conn()
        session = connection.session(namespace)
        request = pb.PurgeRequest(session_id=session.id, dry_run=dry_run)
        reply = connection.call(connection.stub.Purge, request)
        return dict(reply.deleted)

    def pin(self, keys: Sequence[ChunkKey]) -> dict[str, int]:
        """In the sidecar's tiers (its host-memory pins last as long as the sidecar);
        SidecarUnavailable while it is unreachable."""
        return self._pin(keys, unpin=False) if keys else {}

    def unpin(self, keys: Sequence[ChunkKey] | None) -> dict[str, int]:
        """``keys`` None unpins every chunk of this client's model namespace (no more:
        other tenants' pins are theirs)."""
        if keys is not None and not keys:
            return {}
        return self._pin(keys or [], unpin=True)

    def _pin(self, keys: Sequence[ChunkKey], *, unpin: bool) -> dict[str, int]:
        # One Pin per namespace the keys belong to (a session each: the sidecar checks
        # every key against its session's namespace); no keys: this model's own.
        connection, layout = self._conn(), self._parts()[0]
        groups: dict[bytes, list[ChunkKey]] = {layout.base.digest: []} if not keys else {}
        for key in keys:
            groups.setdefault(key[:NAMESPACE_BYTES], []).append(key)
        counts: dict[str, int] = {}
        for digest, group in groups.items():
            session = connection.session(layout.namespace_of(digest))
            request = pb.PinRequest(session_id=session.id, keys=b"".join(group), unpin=unpin)
            for tier, count in connection.call(connection.stub.Pin, request).pinned.items():
                counts[tier] = counts.get(tier, 0) + count
        return counts
