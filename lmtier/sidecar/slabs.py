"""A client's lease on a slab of the sidecar's shared pool.

:class:`RemoteSlab` is a :class:`~lmtier.storage.memory.SlabHandle` over the client's
mapping of the pool, so everything written for host slabs (``LoadResult``, the
facade's ``ChunkFramer``, the vLLM worker's gathers) uses it unchanged. What differs:
releasing it tells the sidecar (queued, sent in the background), it has one owner
(no ``share``), and it refuses to be used past its lease's deadline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from lmtier.chunks.keys import ChunkKey
from lmtier.errors import HandleError
from lmtier.sidecar.connection import ClientSession, Connection
from lmtier.storage.check import ChunkCheck
from lmtier.storage.lookup import LoadedChunk
from lmtier.storage.memory import HostPool, SlabHandle
from lmtier.v1 import sidecar_pb2 as pb

__all__ = ["LEASE_MARGIN", "RemoteSlab", "checked_chunks", "leased_chunks"]

LEASE_MARGIN = 0.9
"""Part of a lease's life this client uses: it stops touching a slab well before the
sidecar may reclaim it."""


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


def leased_chunks(
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
