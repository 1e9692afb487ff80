"""A client's connection to a sidecar: the channel, one session per namespace, the
shared pool's mapping, lease releases, and what happens when the sidecar is gone.

The rule a client lives by: a sidecar that is down, killed or restarting costs
misses, never a failed request. Every call has a deadline; a call that fails for
want of a sidecar opens the connection's circuit breaker (the tiers' own,
:class:`~lmtier.storage.breaker.CircuitBreaker`): calls then miss at once without
trying, until one call probes (after 50 ms, doubling to 5 s while probes fail) and
reconnects, opening fresh sessions. Errors that are the call's own raise for that
call and leave the breaker closed: INVALID_ARGUMENT (InvalidRequestError) and
PERMISSION_DENIED (PermissionDeniedError: a namespace the token's scope does not
cover). :mod:`.outcomes` says what each status code means.

Sessions: one ``OpenSession`` stream per namespace (model, geometry, rank, salt),
opened on first use and watched by a daemon thread; when the stream ends (the
sidecar drained or died) the session is dropped and the next call reopens it.

Releases: ending a lease is queued by the releasing thread; the session's next Load
or AcquireSlabs carries it, or, when none comes within a few milliseconds, one
sender thread sends a Release; an engine thread never waits for a round trip to
give slabs back, and a busy one makes no extra calls for it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from lmtier.chunks.keys import Namespace
from lmtier.config import Secret
from lmtier.errors import (
    AuthenticationError,
    BackendUnavailable,
    InvalidRequestError,
    LMTierError,
    PermissionDeniedError,
)
from lmtier.remote.client_session import ClientSession, first_event
from lmtier.remote.mappings import PoolMappings
from lmtier.remote.probe import serving_problem
from lmtier.storage.breaker import BreakerState, CircuitBreaker
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.v1 import sidecar_pb2_grpc as pb_grpc
from lmtier.wire.credentials import token_metadata
from lmtier.wire.keepalive import DEFAULT_KEEPALIVE_S, keepalive_options
from lmtier.wire.lane import LaneClient, LaneError
from lmtier.wire.namespaces import to_wire
from lmtier.wire.status import SidecarRefused, SidecarUnavailable, outcome

__all__ = [
    "ClientSession",
    "Connection",
    "SidecarRefused",
    "SidecarUnavailable",
    "serving_problem",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 5.0
RELEASE_DELAY_S = 0.005
"""How long ended leases wait for a Load or AcquireSlabs to carry them before a
Release call of their own is sent."""
MAX_MESSAGE_BYTES = 64 * 1024**2


class Connection:
    """A client's connection to one sidecar (module docstring). Thread-safe."""

    def __init__(
        self,
        target: str,
        *,
        token: Secret | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        shared_memory: bool = True,
        timeout_s: float = 10.0,
        client_name: str = "",
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.shared_memory = shared_memory and target.startswith("unix:")
        self.client_name = client_name
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            *keepalive_options(keepalive_s),  # sidecar.keepalive_s, as the server's
        ]
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            self._channel = grpc.secure_channel(target, credentials, options=options)
        self.stub = pb_grpc.SidecarStub(self._channel)  # type: ignore[no-untyped-call]
        # The chunk pieces of the streaming calls are bytes that lmtier.wire.pieces
        # encodes and parses: one copy of the KV each way instead of two.
        self.load_stream = self._channel.unary_stream(
            "/lmtier.v1.Sidecar/LoadStream",
            request_serializer=pb.LoadRequest.SerializeToString,
            response_deserializer=None,
        )
        self.store_stream = self._channel.stream_unary(
            "/lmtier.v1.Sidecar/StoreStream",
            request_serializer=None,
            response_deserializer=pb.StoreReply.FromString,
        )
        self.metadata = token_metadata(token)
        self._lock = threading.Lock()
        self._sessions: dict[bytes, ClientSession] = {}
        self.pools = PoolMappings()
        """The sidecar's shared pools mapped here (one per incarnation)."""
        self._lanes: dict[str, LaneClient] = {}
        self._token = token
        self._opened: Namespace | None = None
        """The namespace whose session opened last (:meth:`any_session`)."""
        self._breaker = CircuitBreaker(
            failure_threshold=1, reset_after_s=BACKOFF_FIRST_S, max_reset_after_s=BACKOFF_MAX_S
        )
        self._closed = False
        self._wake = threading.Condition(self._lock)
        self._pending: set[ClientSession] = set()
        self._sender = threading.Thread(target=self._send_releases, daemon=True)
        self._sender.name = "lmtier-sidecar-releases"
        self._sender.start()

    # ---- calls ---------------------------------------------------------------------

    def call(self, method: Callable[..., T], request: Any, *, timeout_s: float | None = None) -> T:
        """``method(request)`` with the deadline and token; SidecarUnavailable for what
        must be a miss, InvalidRequestError for what is the caller's error."""
        try:
            return method(request, timeout=timeout_s or self.timeout_s, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise self.failed(exc) from None

    def stored(self, future: Any) -> int:
        """What a ``Commit`` or ``StoreStream`` in flight stored: 0 if it failed (a
        miss, and the breaker knows) or was cancelled with the channel."""
        try:
            return int(future.result().stored)
        except grpc.RpcError as exc:
            self.failed(exc)
            return 0
        except grpc.FutureCancelledError:
            return 0

    def failed(self, exc: grpc.RpcError, *, quiet: bool = False) -> Exception:
        """What a failed call means here (:mod:`lmtier.wire.status`): the exception to raise (a
        SidecarUnavailable is a miss); marks the connection down when the sidecar did
        not answer. ``quiet``: log nothing (the caller reports the error itself)."""
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = exc.details() if hasattr(exc, "details") else ""
        found = outcome(code, details or "", self.target)
        if found.complaint and not quiet:
            logger.error("%s", found.complaint)
        if found.forget:
            self._drop_sessions()
        if found.answered:
            with self._lock:
                self._breaker.record_success()  # up: no backoff for what is not an outage
        else:
            self._mark_down(f"{code.name}: {details}", quiet=quiet)
        return found.error

    def _mark_down(self, why: str, *, quiet: bool = False) -> None:
        with self._lock:
            if self._breaker.state is BreakerState.CLOSED and not quiet:
                logger.warning(
                    "sidecar %s unreachable (%s): misses until it is back", self.target, why
                )
            self._breaker.record_failure()
            sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            self._end(session)

    # ---- sessions ------------------------------------------------------------------

    def session(self, namespace: Namespace) -> ClientSession:
        """The live session of ``namespace``, opened now if needed; SidecarUnavailable
        while the sidecar is down (or backing off).

        Once the sidecar has failed, reconnecting is the breaker's probe and runs in
        the background: the call that starts it misses at once, as the calls meanwhile
        do. A caller never waits out a hung sidecar's timeout to reconnect; only the
        call on which it first stops answering does."""
        with self._lock:
            if self._closed:
                raise SidecarUnavailable("the connection is closed")
            found = self._sessions.get(namespace.digest)
            if found is not None and found.alive:
                return found
            reconnecting = self._breaker.state is not BreakerState.CLOSED
            if not self._breaker.allow():
                raise SidecarUnavailable("the sidecar is down; a probe reconnects later")
        if reconnecting:
            probe = threading.Thread(target=self._probe, args=(namespace,), daemon=True)
            probe.name = "lmtier-sidecar-probe"
            probe.start()
            raise SidecarUnavailable("the sidecar failed; reconnecting in the background")
        return self._connect(namespace)

    def _probe(self, namespace: Namespace) -> None:
        """The breaker's probe: open ``namespace``'s session; every outcome ends the
        half-open state (a success closes the breaker, a failure backs off)."""
        try:
            self._connect(namespace)
        except SidecarUnavailable:
            pass  # recorded by failed(): the next probe waits longer
        except (InvalidRequestError, PermissionDeniedError) as exc:  # answered: it is up
            logger.warning("sidecar %s refused a session: %s", self.target, exc)
        except Exception:
            logger.exception("sidecar %s: reconnecting failed", self.target)
            with self._lock:
                self._breaker.record_failure()

    def _connect(self, namespace: Namespace, *, quiet: bool = False) -> ClientSession:
        try:
            session = self._open(namespace, quiet=quiet)
        except (InvalidRequestError, PermissionDeniedError):
            with self._lock:
                self._breaker.record_success()  # it answered: this namespace is the problem
            raise
        with self._lock:
            closed, current = self._closed, self._sessions.get(namespace.digest)
            won = not closed and (current is None or not current.alive)
            if won:
                self._sessions[namespace.digest] = session
                self._opened = namespace
                self._breaker.record_success()
        if won:
            return session
        self._end(session)  # closed meanwhile, or another thread's session is live
        if closed or current is None:
            raise SidecarUnavailable("the connection is closed")
        return current

    def any_session(self, preferred: Namespace) -> ClientSession:
        """A session for a call that is the sidecar's, not one namespace's (Stats,
        Flush, slabs for a store whose keys come later): ``preferred``'s if live, else
        any live one, else ``preferred``'s opened now, else, when the token's scope
        refuses ``preferred`` (PermissionDeniedError), the namespace whose session
        opened last. Raises as :meth:`session` does."""
        with self._lock:
            own = self._sessions.get(preferred.digest)
            live = [s for s in self._sessions.values() if s.alive]
            opened = self._opened
        if own is not None and own.alive:
            return own
        if live:
            return live[0]
        try:
            return self.session(preferred)
        except PermissionDeniedError:
            if opened is None or opened.digest == preferred.digest:
                raise
            return self.session(opened)

    def check(self, namespace: Namespace) -> None:
        """Open ``namespace``'s session now, whatever the breaker says, or raise why
        not: for tools that must tell "nothing cached" from "no sidecar"
        (``lmtier stats --sidecar``). BackendUnavailable: it did not answer;
        AuthenticationError: it refused this client's token; PermissionDeniedError
        and InvalidRequestError: it refused this namespace. Nothing is logged: the
        caller reports it."""
        try:
            self._connect(namespace, quiet=True)
        except SidecarRefused as exc:
            raise AuthenticationError(
                f"the sidecar at {self.target} refused this client's token: {exc}"
            ) from None
        except SidecarUnavailable as exc:
            raise BackendUnavailable(
                f"the sidecar at {self.target} did not answer ({exc}): is `lmtier serve` "
                "running there?"
            ) from None

    def _open(self, namespace: Namespace, *, quiet: bool = False) -> ClientSession:
        request = pb.OpenSessionRequest(
            namespace=to_wire(namespace),
            shared_memory=self.shared_memory,
            client_name=self.client_name,
        )
        try:
            call = self.stub.OpenSession(request, metadata=self.metadata)
            first = first_event(call, self.timeout_s)
        except grpc.RpcError as exc:
            raise self.failed(exc, quiet=quiet) from None
        info = first.opened
        if bytes(info.namespace_digest) != namespace.digest:
            call.cancel()
            raise InvalidRequestError(
                "the sidecar computes another namespace digest for this model: its lmtier "
                f"version ({info.server_version}) keys chunks differently"
            )
        pool = self.pools.map(info.shm) if info.HasField("shm") else None
        lane = self._lane(info.lane) if pool is not None and info.lane else None
        session = ClientSession(info, call, pool, lane)
        watcher = threading.Thread(target=self._watch, args=(session,), daemon=True)
        watcher.name = "lmtier-sidecar-session"
        watcher.start()
        return session

    def _lane(self, path: str) -> LaneClient:
        with self._lock:
            lane = self._lanes.get(path)
            if lane is None:
                lane = self._lanes[path] = LaneClient(path, self._token, self.timeout_s)
            return lane

    def unary(self, session: ClientSession, name: str, request: Any) -> Any:
        """One of the data-path calls (``Lookup``, ``Load``, ``AcquireSlabs``,
        ``Commit``, ``Release``) of ``session``: on its lane when it has one, else
        gRPC; failures as :meth:`call` says."""
        return self.start(session, name, request)()

    def start(self, session: ClientSession, name: str, request: Any) -> Callable[[], Any]:
        """:meth:`unary`, sent now, answered when the returned function is called (in
        this thread): on the lane, later calls may be sent meanwhile."""
        lane = session.lane
        if lane is not None:
            try:
                wait = lane.start(name, request)
            except LaneError as exc:
                if exc.sent or self._closed:
                    raise self.failed(exc) from None
                # The lane cannot be reached but the sidecar may well be: this session
                # goes on over gRPC (nothing was sent, so nothing runs twice).
                logger.warning("sidecar lane %s unreachable: this session uses gRPC", lane.path)
                session.lane = None
            else:
                return functools.partial(self._answer, wait)
        method = getattr(self.stub, name)
        return functools.partial(self.call, method, request)

    def _answer(self, wait: Callable[[], Any]) -> Any:
        try:
            return wait()
        except LaneError as exc:
            raise self.failed(exc) from None

    def _watch(self, session: ClientSession) -> None:
        """Follow a session's stream until it ends; then the session is dead."""
        try:
            for event in session.call:
                if event.WhichOneof("event") == "draining":
                    logger.info("sidecar %s is draining", self.target)
        except grpc.RpcError:
            pass
        session.alive = False
        with self._lock:
            if self._sessions.get(session.info.namespace_digest) is session:
                del self._sessions[session.info.namespace_digest]

    def _end(self, session: ClientSession) -> None:
        """No call uses ``session`` from now on. Its stream, whose end makes the sidecar
        reclaim every lease of it, is cancelled once no lease of it is held here: a
        result being read keeps its slabs until released (or its deadline), even when
        this client gives up on a slow sidecar meanwhile."""
        with self._lock:
            session.alive = False
            session.ending = session.held > 0
        if not session.ending:
            session.call.cancel()

    def hold(self, session: ClientSession) -> None:
        """A lease of ``session`` is held here (until :meth:`unhold`)."""
        with self._lock:
            session.held += 1
        if session.pool is not None:
            self.pools.hold(session.pool)

    def unhold(self, session: ClientSession) -> None:
        """A lease of ``session`` held here ended (released or handed over)."""
        with self._lock:
            session.held -= 1
            last = session.ending and session.held == 0
            if last:
                session.ending = False
        if last:
            session.call.cancel()
        if session.pool is not None:
            self.pools.unhold(session.pool)

    def _drop_sessions(self) -> None:
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            self._end(session)

    # ---- releases ------------------------------------------------------------------

    def release(self, session: ClientSession, lease: int) -> None:
        """Queue the end of ``lease`` (sent in the background; any thread)."""
        with self._lock:
            session.releases.append(lease)
            if session not in self._pending:  # the sender is woken once per batch
                self._pending.add(session)
                self._wake.notify()

    def take_releases(self, session: ClientSession) -> list[int]:
        """The leases of ``session`` waiting to be ended, for a call that ends them
        itself (a Load or AcquireSlabs carries them: no Release call of its own)."""
        with self._lock:
            leases, session.releases = session.releases, []
            return leases

    def _send_releases(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if not self._closed:  # let a call that follows at once carry them
                    self._wake.wait(RELEASE_DELAY_S)
                batch = [(s, s.releases) for s in self._pending]
                for session, _ in batch:
                    session.releases = []
                self._pending.clear()
                closed = self._closed
            for session, leases in batch:
                if session.alive and leases:
                    request = pb.ReleaseRequest(session_id=session.id, leases=leases)
                    try:
                        self.unary(session, "Release", request)
                    except (SidecarUnavailable, LMTierError) as exc:  # the sender lives on
                        logger.debug("release of %d lease(s) failed: %s", len(leases), exc)
            if closed:
                return

    def close(self) -> None:
        """Send queued releases, end every session, close the channel. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify()
        self._sender.join(timeout=self.timeout_s)
        self._drop_sessions()
        self._channel.close()
        with self._lock:
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.close()
        self.pools.close()

    def sessions(self) -> Sequence[ClientSession]:
        with self._lock:
            return list(self._sessions.values())
