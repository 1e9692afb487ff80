"""The local lane: the shared-memory calls on a plain unix socket, without gRPC's cost.

On these machines a Python gRPC call costs ~0.35 ms of round trip however little it
carries, and a shared-memory load or store is one or two calls around a copy of a
few milliseconds: the calls, not the copies, set how fast the sidecar is. The lane
carries the same protobuf messages of the five calls a local client makes on its data
path (Lookup, Load, AcquireSlabs, Commit, Release) as length-prefixed frames on a
unix socket beside the gRPC one (same directory, mode 0600): ~0.04 ms a call.

Everything else stays gRPC: sessions (their lifetime is still the ``OpenSession``
stream, so leases cannot leak whatever happens to a lane connection), the streaming
calls, stats, purge, health. The lane runs each request through the service's own
handler code (the same checks, sessions and status codes), and it is offered only
with shared memory (``SessionInfo.lane``), so only the sidecar's own user reaches it.

Framing (also in the .proto, ``SessionInfo.lane``): a request is ``<u32 length><u8
method><payload>``, a reply ``<u32 length><u8 status><payload>``, little-endian; the
status is the gRPC code's number, and a payload that is not OK's is the error
message. A connection starts with a hello (method 0) carrying the authorization value.

This module is the framing and the client's end, which engines load; the sidecar's
end (:class:`lmtier.sidecar.lane.LaneServer`) is the server's own.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from lmtier.config import Secret
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.wire.credentials import authorization

__all__ = ["HEADER", "HELLO", "METHODS", "LaneClient", "LaneError", "lane_path"]

HELLO = 0
METHODS: dict[str, tuple[int, Any, Any]] = {
    "Lookup": (1, pb.LookupRequest, pb.LookupReply),
    "Load": (2, pb.LoadRequest, pb.LoadReply),
    "AcquireSlabs": (3, pb.AcquireSlabsRequest, pb.AcquireSlabsReply),
    "Commit": (4, pb.CommitRequest, pb.StoreReply),
    "Release": (5, pb.ReleaseRequest, pb.ReleaseReply),
}
"""Method name -> (method byte, request type, reply type)."""
HEADER = struct.Struct("<IB")
"""A frame's header: ``<u32 length><u8 method or status>``, little-endian."""
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class LaneError(grpc.RpcError):  # type: ignore[misc]
    """A lane call that failed: ``code()`` and ``details()`` as grpc's errors have;
    ``sent`` says whether the request may have reached the sidecar (False: the lane
    could not be reached, and the call can go another way)."""

    def __init__(self, code: grpc.StatusCode, details: str, *, sent: bool = True) -> None:
        super().__init__(details)
        self._code, self._details, self.sent = code, details, sent

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class LaneClient:
    """A client's end of the lane: blocking calls, one connection per thread (opened on
    first use, with its hello; dropped on any error and reopened by the next call;
    closed when its thread ends, or by :meth:`close`)."""

    def __init__(self, path: str, token: Secret | None, timeout_s: float) -> None:
        self.path = path
        self._hello = authorization(token).encode()
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._opened: weakref.WeakSet[_Conn] = weakref.WeakSet()  # for close()
        self._lock = threading.Lock()

    def call(self, name: str, request: Any) -> Any:
        """The reply to ``request``; LaneError (UNAVAILABLE when the lane is gone)."""
        return self.start(name, request)()

    def start(self, name: str, request: Any) -> Callable[[], Any]:
        """Send ``request`` now and return a function that waits for its reply (call it
        in this thread). Requests sent before are answered first, in order: a Commit
        can be in flight while the next batch of KV is copied."""
        number, _, reply_type = METHODS[name]
        payload = request.SerializeToString()
        try:
            conn = self._conn()
        except OSError as exc:  # no lane there (refused, gone): nothing was sent
            message = f"lane {self.path}: {exc}"
            raise LaneError(grpc.StatusCode.UNAVAILABLE, message, sent=False) from None
        try:
            conn.sock.sendall(HEADER.pack(len(payload), number) + payload)
        except OSError as exc:  # reset, timed out, closed: it may have been done
            raise self._fail(conn, exc) from None
        pending = _Pending()
        conn.queue.append(pending)

        def wait() -> Any:
            self._settle(conn, pending)
            if pending.error is not None:
                raise pending.error
            assert pending.reply is not None  # settled: one or the other
            code, body = pending.reply
            if code != grpc.StatusCode.OK:
                raise LaneError(code, body.decode("utf-8", "replace"))
            return reply_type.FromString(body)

        return wait

    def _settle(self, conn: _Conn, target: _Pending) -> None:
        """Read replies in order until ``target``'s is in."""
        while target.reply is None and target.error is None:
            head = conn.queue.popleft()
            try:
                head.reply = _receive(conn.sock)
            except OSError as exc:
                head.error = self._fail(conn, exc)

    def _fail(self, conn: _Conn, exc: OSError) -> LaneError:
        """The connection broke: every reply still awaited on it fails too."""
        error = LaneError(grpc.StatusCode.UNAVAILABLE, f"lane {self.path}: {exc}")
        for pending in conn.queue:
            pending.error = error
        conn.queue.clear()
        conn.close()
        return error

    def _conn(self) -> _Conn:
        """This thread's connection, opened (with its hello) if it has none."""
        conn: _Conn | None = getattr(self._local, "conn", None)
        if conn is not None and not conn.closed:
            return conn
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.path)
            sock.sendall(HEADER.pack(len(self._hello), HELLO) + self._hello)
            code, body = _receive(sock)
        except OSError:
            sock.close()
            raise
        if code != grpc.StatusCode.OK:
            sock.close()
            raise LaneError(code, body.decode("utf-8", "replace"))
        conn = self._local.conn = _Conn(sock)
        with self._lock:
            self._opened.add(conn)
        return conn

    def close(self) -> None:
        """Close every thread's connection: a call in flight on one fails (UNAVAILABLE),
        a later call opens a new one."""
        with self._lock:
            opened, self._opened = list(self._opened), weakref.WeakSet()
        for conn in opened:
            conn.close()


class _Conn:
    """One thread's lane connection and the replies it awaits. Its socket is closed
    when it is dropped (its thread ended) if not before."""

    __slots__ = ("__weakref__", "closed", "queue", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.queue: deque[_Pending] = deque()
        self.closed = False
        weakref.finalize(self, sock.close)

    def close(self) -> None:
        """Close it; a thread blocked reading it wakes (and fails)."""
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


@dataclass(slots=True)
class _Pending:
    """A request sent on the lane whose reply has not been read yet."""

    reply: tuple[grpc.StatusCode, bytes] | None = None
    error: LaneError | None = None


def _receive(sock: socket.socket) -> tuple[grpc.StatusCode, bytes]:
    header = _read(sock, HEADER.size)
    length, code = HEADER.unpack(header)
    return _CODES.get(code, grpc.StatusCode.UNKNOWN), bytes(_read(sock, length))


def _read(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        count = sock.recv_into(view[got:])
        if count == 0:
            raise ConnectionResetError("the sidecar closed the lane")
        got += count
    return buffer


def lane_path(socket_path: Path) -> Path:
    """Where the lane of a sidecar listening on ``socket_path`` lives."""
    return socket_path.with_name(socket_path.name + ".lane")
