"""A client's lease on a slab of the sidecar's shared pool.

:class:`RemoteSlab` is a :class:`~lmtier.storage.memory.SlabHandle` over the client's
mapping of the pool, so everything written for host slabs (``LoadResult``, the
facade's ``ChunkFramer``, the vLLM worker's gathers) uses it unchanged. What differs:
releasing it tells the sidecar (queued, sent in the background), it has one owner
(no ``share``), and it refuses to be used past its lease's deadline.
"""

from __future__ import annotations

import time

from lmtier.errors import HandleError
from lmtier.sidecar.connection import ClientSession, Connection
from lmtier.storage.memory import HostPool, SlabHandle

__all__ = ["LEASE_MARGIN", "RemoteSlab"]

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
