"""Sessions and the leases they hold: what makes a slab lent to a client impossible to
leak.

A session is one client's view of one namespace; it lives exactly as long as the
client's ``OpenSession`` stream (the service closes it when the stream ends: a
close, a lost connection, a client killed by SIGKILL). Every slab lent to a client
(a loaded chunk to read, a free slab to fill) is a :class:`Lease` of a session, and
holds a :class:`~lmtier.storage.host_pool.SlabHandle`: the slab cannot be evicted or
reused until the lease ends. A lease ends when the client releases or commits it,
when its session closes, or at its deadline (:meth:`Sessions.reap`), whichever is
first. Lease ids are per session: one client can never end another's lease. What
each token may hold, sessions and leased slabs, is bounded by its share
(:mod:`.shares`).

All of it runs on the sidecar's event loop: no locks.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from lmtier.errors import CapacityError, brief
from lmtier.sidecar.auth import Principal
from lmtier.sidecar.namespaces import SessionSpace
from lmtier.sidecar.shares import Shares
from lmtier.storage.host_pool import HostPool, SlabHandle
from lmtier.wire.status import SessionNotFound

__all__ = ["Lease", "Session", "SessionNotFound", "Sessions"]

logger = logging.getLogger(__name__)

SESSION_ID_BYTES = 16


@dataclass(slots=True)
class Lease:
    """One slab lent to a session until ``deadline`` (the loop's monotonic clock)."""

    handle: SlabHandle
    deadline: float
    writable: bool
    """Acquired to be filled and committed (not a loaded chunk)."""


@dataclass(eq=False, slots=True)
class Session:
    """One client's session (module docstring)."""

    id: bytes
    space: SessionSpace
    principal: Principal
    shared_memory: bool
    client_name: str
    leases: dict[int, Lease] = field(default_factory=dict)
    next_lease: int = 1
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the session must end (drain, or its leases expired): the service then
    ends its stream."""

    @property
    def closed(self) -> bool:
        return self.ended.is_set()


class Sessions:
    """The open sessions of one sidecar and their leases (module docstring)."""

    def __init__(
        self,
        *,
        max_sessions: int,
        lease_ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        shares: Shares | None = None,
    ) -> None:
        self.max_sessions = max_sessions
        self.lease_ttl_s = lease_ttl_s
        self.shares = shares if shares is not None else Shares()
        """What each principal may hold: its sessions here, its leased slabs (which a
        caller counts with :meth:`Shares.take` before :meth:`grant`) and its
        streaming calls' slabs (:mod:`.holds`)."""
        self._clock = clock
        self._sessions: dict[bytes, Session] = {}
        # By the principal's identity: each configured token is one Principal object,
        # and two tokens with equal names and scopes are still two callers.
        self._spaces: dict[tuple[int, bytes], list[Session]] = {}
        self.expired = 0
        """Leases reclaimed at their deadline since start."""

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    @property
    def num_leases(self) -> int:
        return sum(len(s.leases) for s in self._sessions.values())

    @property
    def num_clients(self) -> int:
        """Distinct client names with a session open."""
        return len({s.client_name for s in self._sessions.values()})

    def gauges(self, pool: HostPool) -> dict[str, float]:
        """The sidecar's own gauges (Stats, and /metrics): sessions, leases, slabs."""
        return {
            "sessions": len(self._sessions),
            "clients": self.num_clients,
            "leases": self.num_leases,
            "leases_expired": self.expired,
            "slabs_total": pool.num_slabs,
            "slabs_in_use": pool.num_in_use,
            "share_refusals": self.shares.refusals,
            "stream_slabs_reclaimed": self.shares.reclaimed,
        }

    def open(
        self, space: SessionSpace, principal: Principal, *, shared_memory: bool, client_name: str
    ) -> Session:
        """A new session; CapacityError when ``max_sessions`` are open, or when
        ``principal`` has its share of them open."""
        if len(self._sessions) >= self.max_sessions:
            raise CapacityError(f"{self.max_sessions} sessions are open (sidecar.max_sessions)")
        self.shares.open_session(principal)
        session = Session(
            secrets.token_bytes(SESSION_ID_BYTES), space, principal, shared_memory, client_name
        )
        self._sessions[session.id] = session
        self._spaces.setdefault((id(principal), space.digest), []).append(session)
        return session

    def space_for(self, principal: Principal, digest: bytes) -> SessionSpace | None:
        """The namespace ``digest`` if ``principal`` has a session open on it (it may
        then commit chunks of it through any of its sessions); None otherwise."""
        found = self._spaces.get((id(principal), digest))
        return found[0].space if found else None

    def get(self, session_id: bytes, principal: Principal) -> Session:
        """The open session ``session_id``, if ``principal`` (the same token: principals
        are compared by identity) opened it.

        SessionNotFound otherwise (the same answer whether the id is unknown or another
        principal's, so ids cannot be probed).
        """
        session = self._sessions.get(session_id)
        if session is None or session.closed or session.principal is not principal:
            raise SessionNotFound("no such session (closed, expired or never opened): reopen")
        return session

    def close(self, session: Session) -> int:
        """End ``session`` and every lease it holds; how many leases. Idempotent."""
        session.ended.set()
        if self._sessions.pop(session.id, None) is not None:
            key = (id(session.principal), session.space.digest)
            peers = self._spaces[key]
            peers.remove(session)
            if not peers:
                del self._spaces[key]
            self.shares.close_session(session.principal)
        leases, session.leases = session.leases, {}
        for lease in leases.values():
            lease.handle.release()
        self.shares.give(session.principal, len(leases))
        return len(leases)

    def grant(self, session: Session, handle: SlabHandle, *, writable: bool) -> int:
        """Lend ``handle`` (ownership passes to the lease) to ``session``; the lease id.
        The caller has counted the slab against the session's principal
        (:meth:`Shares.take`): the lease now holds that count, and gives it back when
        it ends. SessionNotFound (the handle and its count still the caller's) if the
        session has closed."""
        if session.closed:
            raise SessionNotFound("the session closed meanwhile: reopen")
        lease_id = session.next_lease
        session.next_lease += 1
        session.leases[lease_id] = Lease(handle, self._clock() + self.lease_ttl_s, writable)
        return lease_id

    def take(self, session: Session, lease_id: int, *, writable: bool) -> SlabHandle | None:
        """End lease ``lease_id`` of ``session`` and hand its slab to the caller (a
        commit); None when there is no such lease of that kind."""
        lease = session.leases.get(lease_id)
        if lease is None or lease.writable != writable:
            return None
        del session.leases[lease_id]
        self.shares.give(session.principal)  # the cache takes it, or the caller frees it
        return lease.handle

    def release(self, session: Session, lease_ids: Iterable[int]) -> int:
        """End leases of ``session`` (unknown ids are ignored); how many ended."""
        ended = 0
        for lease_id in lease_ids:
            lease = session.leases.pop(lease_id, None)
            if lease is not None:
                lease.handle.release()
                ended += 1
        self.shares.give(session.principal, ended)
        return ended

    def reap(self) -> int:
        """End every lease past its deadline; how many. A client that held a slab that
        long is stuck or gone: the slab goes back to the pool (the client refuses to
        touch a lease past its deadline, which it counts from before the call that
        took it). Its session and its other leases stay: they are another load's,
        still being read."""
        now = self._clock()
        reaped = 0
        for session in list(self._sessions.values()):
            late = [i for i, lease in session.leases.items() if lease.deadline <= now]
            if not late:
                continue
            reaped += self.release(session, late)
            logger.warning(
                "session of %s held %d slab(s) past their %.0f s lease: reclaimed",
                brief(session.client_name) if session.client_name else "a client",
                len(late),
                self.lease_ttl_s,
            )
        self.expired += reaped
        return reaped
