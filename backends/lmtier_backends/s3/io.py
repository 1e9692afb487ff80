"""The S3 tier's worker-thread side: blocking boto3 calls, transfers and client plumbing.

Client construction (:func:`make_client`) and the bucket check at open
(:func:`check_bucket`); :class:`Connections`, which lets closing the tier end the
client's requests in flight; the transfer helpers (:class:`ViewReader`, a zero-copy PUT
body over the caller's buffer; :func:`read_body_into`, a GET body streamed into the
caller's buffer); the translation of botocore and socket exceptions into
:data:`RULES` to translate them (:func:`not_found` sorts 404s); the filter that
masks credentials in botocore's DEBUG logs (:func:`redact_botocore_logs`); and
:class:`Scan`, the cursor the ``contains`` workers share (it blocks them on a
condition).

Kept apart from :mod:`lmtier_backends.s3.tier` so that module holds the tier's
async orchestration (batches, expiry, failure accounting, the Tier interface) and
this one the code that runs in its thread pool and knows botocore's, urllib3's and
http.client's internals. Nothing here touches the tier's stats, pool or event loop.
Client settings and transfer paths are explained in the tier's module docstring.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import re
import socket
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    CredentialRetrievalError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    ReadTimeoutError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from lmtier.chunks.keys import ChunkKey
from lmtier.config import S3TierConfig
from lmtier.errors import BackendTimeout, BackendUnavailable, ConfigError
from lmtier.storage.budget import Progress
from lmtier.storage.failures import Rule

__all__ = [
    "RULES",
    "Connections",
    "Scan",
    "ViewReader",
    "check_bucket",
    "make_client",
    "not_found",
    "read_body_into",
    "redact_botocore_logs",
]

logger = logging.getLogger(__name__)

_READ_BLOCK = 1 << 20
"""Bytes per ``read`` on the fallback (copying) GET path."""
_READINTO_BLOCK = 256 << 10
"""Most bytes per ``readinto`` on the direct GET path: a buffered readinto fills all
it is given, and the progress meter should see a slow transfer move (256 KiB take
0.25 s at 1 MB/s) rather than wait for a whole chunk."""
_TRANSPORT_ERRORS = (
    HTTPClientError,
    BotoConnectionError,
    IncompleteReadError,
    NoCredentialsError,
    CredentialRetrievalError,
    OSError,
    http.client.HTTPException,
)

_KEY_ID = re.compile(r"Credential=[^/\s,'\"]+")
_TOKEN = re.compile(r"(x-amz-security-token['\"]?\s*[:=]\s*b?['\"]?)[^'\"\s,}]+", re.I)


class _RedactCredentials(logging.Filter):
    """Masks the access key id (``Credential=`` in the Authorization header) and session
    tokens in botocore's DEBUG records: ``Sending http request`` prints the signed
    headers, ``CanonicalRequest`` the token header."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = _TOKEN.sub(r"\1***", _KEY_ID.sub("Credential=***", message))
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


def redact_botocore_logs() -> None:
    """Install :class:`_RedactCredentials` on the botocore loggers that print requests.

    Process-wide, but idempotent and it only removes text; run at open, never in a
    constructor. A filter on a logger sees exactly the records that logger creates,
    whatever handlers the application configures.
    """
    for name in ("botocore.endpoint", "botocore.auth"):
        target = logging.getLogger(name)
        if not any(isinstance(f, _RedactCredentials) for f in target.filters):
            target.addFilter(_RedactCredentials())


def _server_failing(exc: BaseException) -> bool:
    return isinstance(exc, ClientError) and _status(exc) >= 500


RULES = (
    # A 5xx says the service is failing; another client error (403, 400) is that item's.
    Rule((ClientError,), BackendUnavailable, tier_level=_server_failing),
    Rule((ConnectTimeoutError, ReadTimeoutError, TimeoutError), BackendTimeout, tier_level=True),
    Rule(_TRANSPORT_ERRORS, BackendUnavailable, tier_level=True),
    Rule((BotoCoreError,), BackendUnavailable, tier_level=False),
)
"""botocore's and the socket's exceptions as lmtier's (:mod:`lmtier.storage.failures`)."""


def not_found(exc: ClientError) -> bool:
    return str(exc.response.get("Error", {}).get("Code")) in ("404", "NoSuchKey", "NotFound")


def _status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def make_client(cfg: S3TierConfig) -> Any:
    """The boto3 S3 client for ``cfg`` (settings: the tier's module docstring)."""
    config = Config(
        max_pool_connections=cfg.max_concurrency,
        connect_timeout=cfg.timeout_s,
        read_timeout=cfg.timeout_s,
        retries={"total_max_attempts": 2, "mode": "standard"},  # one retry
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        user_agent_extra="lmtier",
        # path style: MinIO and moto answer on one host name, without bucket DNS
        s3={
            "payload_signing_enabled": False,
            "addressing_style": "path" if cfg.endpoint_url else "auto",
        },
    )
    key_id, secret = cfg.access_key_id, cfg.secret_access_key
    session = boto3.session.Session(
        aws_access_key_id=key_id.reveal() if key_id else None,
        aws_secret_access_key=secret.reveal() if secret else None,
        region_name=cfg.region,
    )
    return session.client("s3", endpoint_url=cfg.endpoint_url, config=config)


class Connections:
    """The sockets of one boto3 client's connections, so that closing the tier ends its
    requests in flight at once rather than after their timeouts and retry.

    :meth:`attach` gives the client's connection pools a connection class that
    registers each socket once it is connected, and a ``before-send`` hook that refuses
    every request once :meth:`abort` has run. :meth:`abort` shuts every registered
    socket down both ways: a thread blocked on an answer or a body (either way) gets EOF
    or EPIPE at once, botocore's retry is refused by the hook, and the call fails with
    BackendUnavailable (``closed_message``). Without this, ``client.close()`` only
    closes idle connections: a request to a hung endpoint held its worker thread, and so
    a cancelled call that waits for its buffers, and interpreter exit (which joins
    the pool's threads), for the read timeout twice (one retry).

    A socket connected after :meth:`abort` is shut down as it registers; a connect still
    in progress is not interrupted (it ends within the connect timeout, and its request
    is refused). Only sockets are shut down, never closed, so a file descriptor cannot
    be reused under a thread that still holds it.
    """

    __slots__ = ("_closed", "_lock", "_sockets", "closed_message")

    def __init__(self, closed_message: str) -> None:
        self.closed_message = closed_message
        self._lock = threading.Lock()
        self._sockets: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def attach(self, client: Any) -> None:
        """Track ``client``'s connections: call before its first request (no pool exists
        yet). Reaches into botocore's ``URLLib3Session`` (its table of pool classes, which
        its pool managers share); if that changes, logs a warning and tracks nothing."""
        session = getattr(getattr(client, "_endpoint", None), "http_session", None)
        classes = getattr(session, "_pool_classes_by_scheme", None)
        if not isinstance(classes, dict):
            logger.warning(
                "botocore's connection pools are not where lmtier expects them: closing the "
                "S3 tier will not end requests in flight (they end within their timeouts)"
            )
        else:
            for scheme, pool_class in list(classes.items()):
                classes[scheme] = self._tracking(pool_class)
        client.meta.events.register("before-send.s3", self._refuse_when_closed)

    def _tracking(self, pool_class: type[Any]) -> type[Any]:
        """A subclass of ``pool_class`` whose connections register their sockets here."""
        base: type[Any] = pool_class.ConnectionCls
        register = self._register

        def connect(conn: Any) -> None:
            base.connect(conn)
            register(conn.sock)

        tracked = type(f"Tracked{base.__name__}", (base,), {"connect": connect})
        return type(f"Tracked{pool_class.__name__}", (pool_class,), {"ConnectionCls": tracked})

    def _register(self, sock: socket.socket | None) -> None:
        if sock is None:
            return
        with self._lock:
            if not self._closed:
                self._sockets.add(sock)
                return
        _shut(sock)

    def _refuse_when_closed(self, **_: Any) -> None:
        if self._closed:
            raise BackendUnavailable(self.closed_message)

    def abort(self) -> None:
        """Refuse every further request and shut down every connection. Idempotent."""
        with self._lock:
            self._closed = True
            sockets = list(self._sockets)
            self._sockets.clear()
        for sock in sockets:
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    """Shut ``sock`` down both ways (the plain socket's call, under TLS too: the TLS
    layer's would drop its state under a thread reading through it)."""
    with contextlib.suppress(OSError):  # already closed, or never connected
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def check_bucket(client: Any, bucket: str, endpoint: str) -> None:
    """HeadBucket: ConfigError if the bucket is missing or the credentials are refused,
    BackendUnavailable if the endpoint (already redacted) cannot be reached."""
    where = f"S3 bucket {bucket!r} at {endpoint}"
    try:
        client.head_bucket(Bucket=bucket)
    except ClientError as exc:
        if _status(exc) == 404 or not_found(exc):
            raise ConfigError(f"{where} does not exist (s3.bucket)") from exc
        if _status(exc) in (401, 403):
            raise ConfigError(
                f"{where}: credentials refused (HTTP {_status(exc)}); check "
                "s3.access_key_id/s3.secret_access_key or the AWS credential chain"
            ) from exc
        raise BackendUnavailable(f"{where}: HeadBucket failed: {exc}") from exc
    except (NoCredentialsError, CredentialRetrievalError) as exc:
        raise ConfigError(f"{where}: no AWS credentials found ({exc})") from exc
    except (*_TRANSPORT_ERRORS, BotoCoreError) as exc:
        raise BackendUnavailable(f"{where} cannot be reached: {exc}") from exc


class ViewReader:
    """A read-only file whose reads are slices of a buffer: a PUT body that botocore
    streams without a copy (it takes bytes or file-likes, not memoryviews). Each read
    ticks ``meter``: the bytes are leaving, so the endpoint is taking them."""

    __slots__ = ("_meter", "_pos", "_view")

    def __init__(self, view: memoryview, meter: Progress | None = None) -> None:
        self._view = view
        self._pos = 0
        self._meter = meter

    def read(self, amt: int | None = -1) -> memoryview:
        end = len(self._view) if amt is None or amt < 0 else min(len(self._view), self._pos + amt)
        out = self._view[self._pos : end]
        self._pos = end
        if self._meter is not None:
            self._meter.tick()
        return out

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._pos, len(self._view))[whence]
        self._pos = max(0, min(len(self._view), base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos


def read_body_into(
    body: Any, view: memoryview, *, direct: bool = True, meter: Progress | None = None
) -> None:
    """Fill ``view`` (exactly the object's length) from a GetObject ``Body``.

    ``direct``: ``readinto`` of the http.client response under botocore's urllib3
    response, when it carries the raw bytes (no content encoding); otherwise, or with
    ``direct=False``, copies of ``read(1 MiB)``. ``meter`` is ticked after every read
    that brought bytes. Raises IncompleteRead if the body ends early; the caller
    closes the body on any error.
    """
    tick = meter.tick if meter is not None else _no_tick
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    pos, size = 0, len(view)
    if (
        direct
        and raw is not None
        and isinstance(fp, http.client.HTTPResponse)
        and getattr(raw, "_fp_bytes_read", None) == 0  # urllib3 has consumed nothing yet
        and raw.headers.get("content-encoding", "identity") == "identity"
    ):
        while pos < size:
            count = fp.readinto(view[pos : pos + _READINTO_BLOCK])
            if not count:
                raise http.client.IncompleteRead(b"", size - pos)
            pos += count
            tick()
        if fp.isclosed():  # fully consumed: the connection can serve another request
            raw.release_conn()
        return
    while pos < size:
        data = body.read(min(_READ_BLOCK, size - pos))
        if not data:
            raise http.client.IncompleteRead(b"", size - pos)
        view[pos : pos + len(data)] = data
        pos += len(data)
        tick()


def _no_tick() -> None:
    pass


SCAN_AHEAD_WINDOWS = 4
"""How far a scan's cursor may run past the lowest key not answered yet, in full
windows: what a miss whose HEAD is slow (a descheduled thread, a slow S3 reply) can
cost in HEADs past it, however fast the hits after it answer."""


@dataclass(slots=True)
class Scan:
    """The shared cursor of one ``S3Tier.contains`` (the tier's module docstring), with
    TCP-like slow start: ``window`` HEADs may be in flight, one more after each hit, and
    none past ``SCAN_AHEAD_WINDOWS * max_window`` keys after the lowest unanswered one.

    Invariant (under ``cond``): every index below ``next_index`` was handed out, every
    index below ``base`` was answered, and ``stop`` is the lowest index known not to be
    a hit (``len(keys)`` if none); so once every worker has returned, every key below
    ``stop`` is a hit.
    """

    keys: Sequence[ChunkKey]
    stop: int
    window: int
    max_window: int
    outcomes: list[object]
    next_index: int = 0
    done: int = 0
    base: int = 0
    answered: set[int] = field(default_factory=set)  # answered indices at or past base
    cancelled: bool = False
    cond: threading.Condition = field(default_factory=threading.Condition)

    def take(self) -> int | None:
        """The next index to HEAD, once the window has room; None when there is none."""
        ahead = SCAN_AHEAD_WINDOWS * self.max_window
        with self.cond:
            while not self.cancelled and self.next_index < self.stop:
                in_flight = self.next_index - self.done
                if in_flight < self.window and self.next_index < self.base + ahead:
                    self.next_index += 1
                    return self.next_index - 1
                self.cond.wait()
            return None

    def finish(self, index: int, hit: bool) -> None:
        with self.cond:
            self.done += 1
            self.answered.add(index)
            while self.base in self.answered:
                self.answered.remove(self.base)
                self.base += 1
            if hit:
                self.window = min(self.window + 1, self.max_window)
            else:
                self.stop = min(self.stop, index)
            self.cond.notify_all()

    def cancel(self) -> None:
        with self.cond:
            self.cancelled = True
            self.cond.notify_all()
