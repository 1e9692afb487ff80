"""The sidecar's gRPC handlers (``lmtier.v1.Sidecar``), on the sidecar's event loop.

Each handler checks the caller (:mod:`.auth`), finds its session (:mod:`.sessions`),
turns the request into StorageManager calls, and answers; every failure becomes a
status code with lmtier's message (:mod:`.status`). Handlers never block the loop on
I/O: tier calls are the manager's coroutines; the rest is hashing, header checks and
(streaming calls only) copies of chunk bytes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np

from lmtier import __version__
from lmtier.chunks.hashers import make_hasher
from lmtier.chunks.keys import KEY_BYTES, NAMESPACE_BYTES, ChunkKey
from lmtier.config import LMTierConfig
from lmtier.errors import CapacityError, InvalidRequestError, brief
from lmtier.sidecar.auth import Authenticator, Principal
from lmtier.sidecar.calls import InFlight, answer, session_stream, streaming, unary
from lmtier.sidecar.holds import StreamHold
from lmtier.sidecar.metrics import SidecarMetrics
from lmtier.sidecar.namespaces import (
    MAX_CLIENT_NAME_CHARS,
    MAX_KEYS,
    NamespaceCheck,
    SessionSpace,
    check_unique,
    check_written,
    parse_keys,
)
from lmtier.sidecar.sessions import Session, Sessions
from lmtier.sidecar.status import numeric_leaves
from lmtier.sidecar.transfers import clipped, receive_chunks, send_chunks
from lmtier.storage.host_pool import HostPool, SlabHandle
from lmtier.storage.lookup import LoadedChunk, TierSpan
from lmtier.storage.lookup import Lookup as Found
from lmtier.storage.manager import StorageManager
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.v1 import sidecar_pb2_grpc as pb_grpc
from lmtier.wire.shm import SharedRegion
from lmtier.wire.status import Draining, NotOffered

__all__ = ["SidecarService"]

logger = logging.getLogger(__name__)

R = TypeVar("R")
Handler = Callable[..., Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class Parts:
    """What the handlers work with, built by :mod:`.server`."""

    config: LMTierConfig
    manager: StorageManager
    pool: HostPool
    check: NamespaceCheck
    sessions: Sessions
    auth: Authenticator
    metrics: SidecarMetrics
    shm: SharedRegion | None
    """The shared host pool, offered to sessions that ask (None: streaming only)."""


class SidecarService(pb_grpc.SidecarServicer):
    """The handlers of ``lmtier.v1.Sidecar`` (see proto/lmtier/v1/sidecar.proto)."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.metrics = parts.metrics
        self.in_flight = InFlight()
        """Calls being served: a drain lets them finish before it ends the sessions."""
        self.draining = False
        self.lane = ""
        """The lane's socket path, offered to shared-memory sessions (:mod:`.lane`)."""
        self._piece = parts.config.sidecar.stream_piece_bytes

    def admit(self, context: Any) -> Principal:
        """The caller of a gRPC call, if the sidecar is serving (:meth:`check_serving`)."""
        self.check_serving()
        return self.parts.auth.authenticate(context.invocation_metadata())

    def check_serving(self) -> None:
        """Draining (UNAVAILABLE) once the sidecar is shutting down."""
        if self.draining:
            raise Draining("the sidecar is draining: retry against its successor")

    async def answer(self, name: str, work: Awaitable[Any]) -> tuple[grpc.StatusCode, Any]:
        """Run call ``name``'s work (:func:`.calls.answer`): the gRPC handlers and the
        lane (:mod:`.lane`) answer through it."""
        return await answer(self, name, work)

    def _session(self, session_id: bytes, principal: Principal) -> Session:
        return self.parts.sessions.get(session_id, principal)

    # ---- sessions ----------------------------------------------------------------

    @session_stream
    async def OpenSession(
        self, request: pb.OpenSessionRequest, principal: Principal, context: Any
    ) -> AsyncIterator[pb.SessionEvent]:
        space = SessionSpace.from_wire(request.namespace)
        if len(request.client_name) > MAX_CLIENT_NAME_CHARS:
            raise InvalidRequestError(
                f"client_name is {len(request.client_name)} characters; at most "
                f"{MAX_CLIENT_NAME_CHARS}"
            )
        if not principal.allows(space.namespace.model_id, space.namespace.cache_salt):
            raise PermissionError(
                f"{principal.name} may not use model {brief(space.namespace.model_id)} under "
                "this cache salt"
            )
        slab_bytes = self.parts.pool.slab_bytes
        if space.chunk_bytes > slab_bytes:
            raise InvalidRequestError(
                f"a chunk of this namespace is {space.chunk_bytes} bytes; the sidecar's slabs "
                f"hold {slab_bytes} (raise sidecar.slab_bytes, or use a smaller chunk_size)"
            )
        # A token scoped to some namespaces streams: the shared pool holds every
        # tenant's chunks, and whoever maps it can read (and write) all of them.
        shm = self.parts.shm if request.shared_memory and principal.reaches_all else None
        self.parts.check.register(space)
        try:
            session = self.parts.sessions.open(
                space, principal, shared_memory=shm is not None, client_name=request.client_name
            )
        except BaseException:
            self.parts.check.unregister(space)  # refused (max_sessions): not live
            raise
        # Client-chosen strings are cut: one session must not write megabytes of log.
        logger.info(
            "session opened: %s (%s), model %s, rank %d/%d, %s",
            brief(request.client_name) if request.client_name else "unnamed client",
            principal.name,
            brief(space.namespace.model_id),
            space.namespace.tp_rank,
            space.namespace.tp_size,
            "shared memory" if shm is not None else "streaming",
        )
        try:
            yield pb.SessionEvent(opened=self._info(session, shm))
            await session.ended.wait()
            if self.draining:
                yield pb.SessionEvent(draining="the sidecar is draining")
        finally:
            released = self.parts.sessions.close(session)
            self.parts.check.unregister(space)
            logger.info(
                "session closed: %s, %d lease(s) released", brief(request.client_name), released
            )

    def _info(self, session: Session, shm: SharedRegion | None) -> pb.SessionInfo:
        pool = self.parts.pool
        info = pb.SessionInfo(
            session_id=session.id,
            namespace_digest=session.space.digest,
            hash_algorithm=self.parts.config.hash_algorithm,
            lease_ttl_s=self.parts.sessions.lease_ttl_s,
            max_chunk_bytes=pool.slab_bytes,
            server_version=__version__,
        )
        if shm is not None:
            info.lane = self.lane
            info.shm.CopyFrom(
                pb.SharedMemory(
                    path=str(shm.path),
                    size=shm.size,
                    first_slab_offset=pool.first_slab_offset,
                    slab_stride=pool.slab_bytes,
                    slab_bytes=pool.slab_bytes,
                    num_slabs=pool.num_slabs,
                )
            )
        return info

    # ---- lookups and loads -------------------------------------------------------

    def _keys(self, session: Session, request: Any) -> list[ChunkKey]:
        """The keys a Lookup or Load names (hashed from tokens, or given)."""
        space = session.space
        if request.WhichOneof("query") == "tokens":
            if len(request.tokens.ids) > MAX_KEYS * space.chunk_size:
                raise InvalidRequestError(
                    f"at most {MAX_KEYS} chunks ({MAX_KEYS * space.chunk_size} tokens) per call"
                )
            ids = np.fromiter(request.tokens.ids, dtype=np.uint32, count=len(request.tokens.ids))
            hasher = make_hasher(space.namespace, algorithm=self.parts.config.hash_algorithm)
            keys = hasher.extend(ids)
            if request.max_tokens:
                keys = keys[: request.max_tokens // space.chunk_size]
            return keys
        return parse_keys(request.keys, space.digest)

    @unary
    async def Lookup(self, request: pb.LookupRequest, principal: Principal) -> pb.LookupReply:
        session = self._session(request.session_id, principal)
        keys = self._keys(session, request)
        manager = self.parts.manager
        if not keys:
            found = Found(0, ())
        elif request.local_only:
            found = manager.lookup_local(keys)
        else:
            found = manager.lookup_now(keys) or await manager.lookup(keys)
        spans = [pb.TierSpan(tier=s.tier, start=s.start, stop=s.stop) for s in found.spans]
        reply = pb.LookupReply(num_chunks=found.num_chunks, spans=spans)
        if request.WhichOneof("query") == "tokens":
            reply.keys = b"".join(keys)
        return reply

    def _load_keys(self, session: Session, request: pb.LoadRequest) -> list[ChunkKey]:
        """The keys a Load or LoadStream asks for, each once (the leases it returns
        released first)."""
        self.parts.sessions.release(session, request.release)
        keys = self._keys(session, request)
        check_unique(keys)
        return keys

    def _given_lookup(self, request: pb.LoadRequest, num_keys: int) -> Found | None:
        """The request's lookup spans if they are well formed (contiguous from chunk 0,
        known tiers, within the keys); None (walk the tiers again) otherwise."""
        if not request.lookup:
            return None
        names = {self.parts.manager.cpu_tier.name, *(t.name for t in self.parts.manager.tiers)}
        spans, at = [], 0
        for span in request.lookup:
            if span.tier not in names or span.start != at or not at < span.stop <= num_keys:
                return None
            spans.append(TierSpan(span.tier, span.start, span.stop))
            at = span.stop
        return Found(at, tuple(spans))

    @unary
    async def Load(self, request: pb.LoadRequest, principal: Principal) -> pb.LoadReply:
        """Leases on the chunks of the keys' cached prefix, as many as the caller's
        share of the slabs allows (:mod:`.shares`: the client reads a shorter hit)."""
        session = self._session(request.session_id, principal)
        if not session.shared_memory:
            raise NotOffered("this session has no shared memory: use LoadStream")
        keys = self._load_keys(session, request)
        if not keys:
            return pb.LoadReply()
        shares = self.parts.sessions.shares
        counted = shares.take_some(principal, len(keys))
        chunks: list[LoadedChunk] = []
        try:
            lookup = clipped(self._given_lookup(request, len(keys)), 0, counted)
            chunks = await self.parts.manager.get(keys[:counted], lookup)
        finally:
            shares.give(principal, counted - len(chunks))  # the leases keep the rest
        reply, granted = pb.LoadReply(), 0
        grant = self.parts.sessions.grant
        try:
            for loaded in chunks:
                lease = grant(session, loaded.handle, writable=False)
                granted += 1  # the lease owns the slab (and its count) now
                decoded = loaded.chunk
                reply.chunks.add(
                    lease=lease,
                    slab=loaded.handle.index,
                    length=decoded.payload_offset + len(decoded.payload),
                    tier=loaded.tier,
                )
        finally:
            for left in chunks[granted:]:
                left.release()
            shares.give(principal, len(chunks) - granted)
        return reply

    def _stream_hold(self, principal: Principal) -> StreamHold:
        side = self.parts.config.sidecar
        return StreamHold(
            self.parts.sessions.shares,
            principal,
            stall_s=side.stream_stall_s,
            ttl_s=side.lease_ttl_s,
        )

    @streaming
    async def LoadStream(
        self, request: pb.LoadRequest, principal: Principal, context: Any
    ) -> AsyncIterator[bytes]:
        """Yields serialized ``ChunkPiece`` messages (:func:`.transfers.send_chunks`:
        within the caller's share of the slabs; a reader that stops reading holds
        them no longer than ``sidecar.stream_stall_s``)."""
        session = self._session(request.session_id, principal)
        keys = self._load_keys(session, request)
        lookup = self._given_lookup(request, len(keys))
        hold = self._stream_hold(principal)
        try:
            async for piece in send_chunks(self.parts.manager, hold, keys, lookup, self._piece):
                yield piece
        finally:
            hold.close()

    # ---- stores --------------------------------------------------------------------

    @unary
    async def AcquireSlabs(
        self, request: pb.AcquireSlabsRequest, principal: Principal
    ) -> pb.AcquireSlabsReply:
        session = self._session(request.session_id, principal)
        if not session.shared_memory:
            raise NotOffered("this session has no shared memory: use StoreStream")
        sessions = self.parts.sessions
        sessions.release(session, request.release)
        count, present = min(request.count, self.parts.pool.num_slabs), 0
        if request.keys:
            keys = parse_keys(request.keys, session.space.digest)
            present = self.parts.manager.lookup_local(keys).num_chunks
            count = min(count, len(keys) - present)
        if count == 0:
            return pb.AcquireSlabsReply(present=present)
        shares = sessions.shares
        counted = shares.take_some(principal, count)
        handles = await self.parts.manager.acquire_slabs_async(counted)
        shares.give(principal, counted - len(handles))
        if not handles:
            raise CapacityError("no free slab: every slab is held by readers and pending writes")
        reply = pb.AcquireSlabsReply(present=present)
        for at, handle in enumerate(handles):
            try:
                lease = sessions.grant(session, handle, writable=True)
            except BaseException:
                for rest in handles[at:]:
                    rest.release()
                shares.give(principal, len(handles) - at)
                raise
            reply.slabs.add(lease=lease, slab=handle.index)
        return reply

    @unary
    async def Commit(self, request: pb.CommitRequest, principal: Principal) -> pb.StoreReply:
        session = self._session(request.session_id, principal)
        taken: list[tuple[ChunkKey, SlabHandle, int]] = []
        try:
            for index, item in enumerate(request.chunks):
                handle = self.parts.sessions.take(session, item.lease, writable=True)
                if handle is None:
                    raise InvalidRequestError(f"chunk {index}: lease {item.lease} is not held")
                taken.append((ChunkKey(item.key), handle, item.length))
            for index, (key, handle, length) in enumerate(taken):
                self._check_chunk(session, key, handle, length, index)
        except BaseException:
            for _, handle, _ in taken:
                handle.release()
            raise
        stored, manager = 0, self.parts.manager
        for at, (key, handle, length) in enumerate(taken):
            try:
                await manager.room_for_store()  # back-pressure, never blocking the loop
                stored += manager.put(key, handle, length)
            except BaseException:
                for _, rest, _ in taken[at + 1 :]:
                    rest.release()
                raise
        return pb.StoreReply(stored=stored, dropped=len(taken) - stored)

    def _check_chunk(
        self, session: Session, key: ChunkKey, handle: SlabHandle, length: int, index: int
    ) -> None:
        """That ``handle``'s slab holds chunk ``key``, of a namespace the caller has a
        session open on (this one, or another salt's), in that namespace's geometry."""
        if len(key) != KEY_BYTES:
            raise InvalidRequestError(f"chunk {index}: a key is {KEY_BYTES} bytes")
        digest = key[:NAMESPACE_BYTES]
        space = (
            session.space
            if digest == session.space.digest
            else self.parts.sessions.space_for(session.principal, digest)
        )
        if space is None:
            raise PermissionError(f"chunk {index}: its key is of no namespace you opened")
        if not 0 < length <= len(handle.view):
            raise InvalidRequestError(f"chunk {index}: length {length} does not fit a slab")
        check_written(space, key, handle.view[:length], index)

    @unary
    async def StoreStream(
        self, pieces: AsyncIterator[bytes], principal: Principal
    ) -> pb.StoreReply:
        """Each chunk into a slab, checked, to the cache (:func:`.transfers.receive_chunks`:
        within the caller's share; a chunk stalled mid-way is dropped)."""
        hold = self._stream_hold(principal)
        try:
            stored, dropped = await receive_chunks(
                self.parts.manager,
                hold,
                pieces,
                slab_bytes=self.parts.pool.slab_bytes,
                session_of=lambda session_id: self._session(session_id, principal),
                check=self._check_chunk,
            )
        finally:
            hold.close()
        return pb.StoreReply(stored=stored, dropped=dropped)

    @unary
    async def Release(self, request: pb.ReleaseRequest, principal: Principal) -> pb.ReleaseReply:
        session = self._session(request.session_id, principal)
        self.parts.sessions.release(session, request.leases)
        return pb.ReleaseReply()

    # ---- operations ----------------------------------------------------------------

    @unary
    async def Flush(self, request: pb.FlushRequest, principal: Principal) -> pb.FlushReply:
        self._session(request.session_id, principal)
        timeout = request.timeout_s or self.parts.config.sidecar.drain_timeout_s
        try:
            await asyncio.wait_for(self.parts.manager.flush(), timeout)
        except TimeoutError:
            return pb.FlushReply(done=False)
        return pb.FlushReply(done=True)

    @unary
    async def Stats(self, request: pb.StatsRequest, principal: Principal) -> pb.StatsReply:
        self._session(request.session_id, principal)
        reply = pb.StatsReply()
        for tier, entry in self.parts.manager.stats().items():
            counters = reply.tiers[tier]
            for name, value in numeric_leaves(entry):
                counters.values[name] = value
        for name, value in self.gauges().items():
            reply.sidecar.values[name] = value
        return reply

    def gauges(self) -> dict[str, float]:
        """The sidecar's own gauges (Stats, and /metrics)."""
        return self.parts.sessions.gauges(self.parts.pool)

    @unary
    async def Purge(self, request: pb.PurgeRequest, principal: Principal) -> pb.PurgeReply:
        session = self._session(request.session_id, principal)
        manager, digest = self.parts.manager, session.space.digest
        if request.dry_run:
            deleted = await manager.count_namespace(digest)
        else:
            deleted = await manager.purge(digest)
        return pb.PurgeReply(deleted={k: v for k, v in deleted.items() if v >= 0})

    @unary
    async def Pin(self, request: pb.PinRequest, principal: Principal) -> pb.PinReply:
        session = self._session(request.session_id, principal)
        digest = session.space.digest
        keys = parse_keys(request.keys, digest) if request.keys else None
        manager = self.parts.manager
        if not request.unpin:
            counts = await manager.pin(keys or [])
        else:
            counts = await manager.unpin(keys if keys is not None else manager.pinned(digest))
        return pb.PinReply(pinned={k: v for k, v in counts.items() if v >= 0})
