"""The lease protocol of a sidecar's shared pool, client side: this module is its one
owner. :class:`~lmtier.remote.client.SidecarStore` asks it for slabs to store into
(:func:`reserve_shared`, :func:`acquire_shared`), hands them back filled
(:func:`commit_shared`) and loads chunks in place (:func:`load_shared`); it builds
every request that grants, carries or ends a lease; the connection sends them (and
batches the releases queued here into the next call).

:class:`RemoteSlab` is a :class:`~lmtier.storage.host_pool.SlabHandle` over the client's
mapping of the pool, so everything written for host slabs (``LoadResult``, the
facade's ``ChunkFramer``, the vLLM worker's gathers) uses it unchanged. What differs:
releasing it tells the sidecar (queued, sent in the background), it has one owner
(no ``share``), and it refuses to be used past its lease's deadline.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

from lmtier.chunks.keys import KEY_BYTES, ChunkKey
from lmtier.errors import HandleError
from lmtier.remote.connection import ClientSession, Connection, SidecarUnavailable
from lmtier.storage.check import ChunkCheck
from lmtier.storage.host_pool import HostPool, SlabHandle, SoleLease
from lmtier.storage.lookup import LoadedChunk
from lmtier.store import Reserved
from lmtier.v1 import sidecar_pb2 as pb

__all__ = [
    "LEASE_MARGIN",
    "SUB_LOAD",
    "RemoteSlab",
    "acquire_shared",
    "checked_chunks",
    "commit_shared",
    "load_shared",
    "reserve_shared",
]

LEASE_MARGIN = 0.9
"""Part of a lease's life this client uses: it stops touching a slab well before the
sidecar may reclaim it."""
SUB_LOAD = 32
"""Chunks per Load when a long load is pipelined on the lane."""


class RemoteSlab(SoleLease):
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
        connection.hold(session)  # its session stays open while this is held

    @property
    def lease(self) -> int:
        return self._lease

    @property
    def session(self) -> ClientSession:
        return self._session

    def _end(self) -> None:
        self._connection.release(self._session, self._lease)
        self._connection.unhold(self._session)

    def handed_over(self) -> None:
        """The sidecar took the slab (a commit): this lease ends without a release."""
        if not self._released:
            self._released = True
            self._connection.unhold(self._session)

    def _check_usable(self, what: str) -> None:
        super()._check_usable(what)
        if time.monotonic() >= self._deadline:
            raise HandleError(f"slab {self._index}: {what} used after its sidecar lease expired")


def load_shared(
    check: ChunkCheck,
    connection: Connection,
    session: ClientSession,
    request: pb.LoadRequest,
    keys: Sequence[ChunkKey],
) -> list[LoadedChunk]:
    """A load through shared memory: ``request`` carries the leases this session has
    ended since its last call, and the chunks come back as :class:`RemoteSlab` leases,
    checked. On the lane, a long load is asked as several pipelined Loads
    (``SUB_LOAD`` chunks each), so this client checks one part's chunks while the
    sidecar serves the next."""
    request.release.extend(connection.take_releases(session))
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
        got = _leased_chunks(check, connection, session, part_keys, reply, deadline=deadline)
        chunks += got
        complete = len(got) == len(part_keys)
    return chunks


def _leased_chunks(
    check: ChunkCheck,
    connection: Connection,
    session: ClientSession,
    keys: Sequence[ChunkKey],
    reply: pb.LoadReply,
    *,
    deadline: float,
) -> list[LoadedChunk]:
    """The chunks a Load leased to ``session``, as :class:`RemoteSlab` leases, checked,
    up to the first that is not what was asked; every other lease is given back."""
    pool = session.pool
    assert pool is not None  # a shared-memory session
    handles: list[SlabHandle] = []
    meta: list[tuple[int, str]] = []
    for item in reply.chunks:
        usable = item.slab < pool.num_slabs and len(handles) == len(meta)
        if usable and len(handles) < len(keys):
            lease, slab = item.lease, item.slab
            handles.append(
                RemoteSlab(
                    pool,
                    slab,
                    lease=lease,
                    session=session,
                    connection=connection,
                    deadline=deadline,
                )
            )
            meta.append((item.length, item.tier))
        else:
            connection.release(session, item.lease)  # not what was asked: give it back
            meta.append((0, ""))  # nothing after this one is kept
    return checked_chunks(check, keys, handles, meta[: len(handles)])


def checked_chunks(
    check: ChunkCheck,
    keys: Sequence[ChunkKey],
    handles: Sequence[SlabHandle],
    meta: Sequence[tuple[int, str]],
) -> list[LoadedChunk]:
    """Loaded chunks that are what was asked for (header, key, geometry), up to the
    first that is not; the rest are released. ``meta``: each one's length and tier."""
    chunks: list[LoadedChunk] = []
    for index, handle in enumerate(handles):
        length, tier = meta[index]
        view = handle.view
        chunk = (
            check.header(keys[index], view[:length])
            if len(chunks) == index and 0 < length <= len(view)
            else None
        )
        if chunk is None:
            handle.release()
            continue
        chunks.append(LoadedChunk(keys[index], tier, chunk, handle))
    return chunks


def reserve_shared(
    connection: Connection,
    session: ClientSession,
    keys: Sequence[ChunkKey],
    *,
    skip: int | None,
    count: int,
    step: int,
) -> tuple[int, Reserved]:
    """A shared-memory store's reservation (:mod:`lmtier.storing`): two AcquireSlabs
    sent at once, the first batch's ``step`` slabs (and, without ``skip``, how many
    leading keys the sidecar holds), then the rest's, answered while the first batch
    is copied. The second names the keys past the first batch, so the sidecar frees
    no slabs (evicting chunks) for the part of them it holds."""
    step = min(count, step)
    first = pb.AcquireSlabsRequest(
        session_id=session.id, count=step, release=connection.take_releases(session)
    )
    rest = pb.AcquireSlabsRequest(session_id=session.id, count=count - step)
    if skip is None:
        first.keys = joined = b"".join(keys)
        rest.keys = joined[step * KEY_BYTES :]
    sent = time.monotonic()
    answer = connection.start(session, "AcquireSlabs", first)
    coming: list[Callable[[], list[SlabHandle]]] = []
    if rest.count > 0:
        later = connection.start(session, "AcquireSlabs", rest)
        coming.append(functools.partial(_granted_later, connection, session, later, sent))
    try:
        reply = answer()
    except BaseException:
        Reserved(coming=coming).release()  # its leases are given back, not left held
        raise
    present = reply.present if skip is None else skip
    return present, Reserved(_granted_slabs(connection, session, reply, sent), coming)


def acquire_shared(connection: Connection, session: ClientSession, count: int) -> list[SlabHandle]:
    """``count`` free slabs of the shared pool (one AcquireSlabs, which also ends the
    leases this session has ended since its last call), as :class:`RemoteSlab` leases."""
    request = pb.AcquireSlabsRequest(
        session_id=session.id, count=count, release=connection.take_releases(session)
    )
    sent = time.monotonic()
    reply = connection.unary(session, "AcquireSlabs", request)
    return _granted_slabs(connection, session, reply, sent)


def _granted_slabs(
    connection: Connection, session: ClientSession, reply: Any, sent: float
) -> list[SlabHandle]:
    """An AcquireSlabsReply's slabs as :class:`RemoteSlab` leases (``sent``: when
    they were asked for; their deadline counts from then)."""
    pool = session.pool
    assert pool is not None  # a shared-memory session
    deadline = sent + session.info.lease_ttl_s * LEASE_MARGIN
    return [
        RemoteSlab(
            pool,
            grant.slab,
            lease=grant.lease,
            session=session,
            connection=connection,
            deadline=deadline,
        )
        for grant in reply.slabs
    ]


def _granted_later(
    connection: Connection, session: ClientSession, answer: Callable[[], Any], sent: float
) -> list[SlabHandle]:
    try:
        return _granted_slabs(connection, session, answer(), sent)
    except SidecarUnavailable:
        return []  # no slab free (or no sidecar): the chunks left are dropped


def commit_shared(
    connection: Connection, items: Sequence[tuple[ChunkKey, SlabHandle, int]]
) -> list[Callable[[], int]]:
    """Commit filled :class:`RemoteSlab` leases, one Commit per session (in flight when
    this returns; each is handed over to the sidecar, never touched here again):
    functions that wait for each Commit's answer and say how many it stored."""
    by_session: dict[ClientSession, list[tuple[ChunkKey, RemoteSlab, int]]] = {}
    for key, handle, length in items:
        assert isinstance(handle, RemoteSlab)
        by_session.setdefault(handle.session, []).append((key, handle, length))
    waits: list[Callable[[], int]] = []
    for session, group in by_session.items():
        request = pb.CommitRequest(session_id=session.id)
        for key, handle, length in group:
            request.chunks.add(lease=handle.lease, key=key, length=length)
        if session.lane is not None:  # in flight while the next batch is copied
            answer = connection.start(session, "Commit", request)
            for _, handle, _ in group:
                handle.handed_over()  # the sidecar's now: never touched here again
            waits.append(functools.partial(_committed, answer))
            continue
        future = connection.stub.Commit.future(
            request, timeout=connection.timeout_s, metadata=connection.metadata
        )
        for _, handle, _ in group:
            handle.handed_over()
        waits.append(functools.partial(connection.stored, future))
    return waits


def _committed(answer: Callable[[], Any]) -> int:
    """What a Commit on the lane stored (0 if it failed: a miss)."""
    try:
        return int(answer().stored)
    except SidecarUnavailable:
        return 0
