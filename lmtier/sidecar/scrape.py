"""The sidecar's ``/metrics`` HTTP endpoint: prometheus_client's WSGI app behind a
server that hostile connections cannot use to starve the sidecar.

prometheus_client's own ``start_http_server`` gives every connection a thread that
waits for its request for ever: connections that send half a request line and stay
(slowloris) each hold a thread and a file descriptor, until the process runs out of
descriptors and its gRPC listeners cannot accept engines any more. This server
bounds both: a connection has :data:`READ_TIMEOUT_S` to send its request, and at
most :data:`MAX_CONNECTIONS` are served at once. A connection that arrives when all
are taken closes the oldest one still sending its request, so half-sent requests
(which any local user can open) cannot keep a scraper out: its request comes at once,
so it is never the oldest unfinished one. When every connection has sent its request,
more are closed on arrival (a scraper retries at its next interval; the engines'
calls are what must not wait).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections import OrderedDict
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

__all__ = ["MAX_CONNECTIONS", "READ_TIMEOUT_S", "MetricsServer", "serve_metrics"]

logger = logging.getLogger(__name__)

READ_TIMEOUT_S = 10.0
"""How long a connection may take to send its request (and to take the reply)."""
MAX_CONNECTIONS = 32
"""Connections served at once; Prometheus opens one per scrape."""


class _Handler(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S  # socketserver sets it on the connection's socket
    server: _Server

    def parse_request(self) -> bool:
        """Read the request line and headers; from then on the connection is served,
        never closed for a newcomer."""
        parsed = super().parse_request()
        self.server.request_read(self.connection)
        return parsed

    def log_message(self, format: str, *args: Any) -> None:
        """Requests are not logged (a scrape every few seconds)."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a connection still in its timeout does not hold up close()
    address_family = socket.AF_INET

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._reading: OrderedDict[Any, None] = OrderedDict()  # oldest first
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        # Full: close the oldest still reading, and wait for its thread to give its
        # place back (at once: its read fails); if every place is serving, close this.
        if not self._slots.acquire(blocking=False) and not (
            self._evict_oldest() and self._slots.acquire(timeout=READ_TIMEOUT_S)
        ):
            self.shutdown_request(request)
            return
        with self._lock:
            self._reading[request] = None
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.request_read(request)
            self._slots.release()  # no thread took it
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.request_read(request)
            self._slots.release()

    def request_read(self, request: Any) -> None:
        """``request`` has sent its request (or ended): it is not closed for newcomers."""
        with self._lock:
            self._reading.pop(request, None)

    def _evict_oldest(self) -> bool:
        """Close the oldest connection still sending its request (its thread's read
        fails, and its place comes back); whether there was one."""
        with self._lock:
            if not self._reading:
                return False
            oldest, _ = self._reading.popitem(last=False)
        with contextlib.suppress(OSError):
            oldest.shutdown(socket.SHUT_RDWR)
        return True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that timed out or broke is closed quietly (socketserver would
        print a traceback to stderr, which is the sidecar's log)."""
        logger.debug("/metrics: a connection ended in error", exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


POLL_S = 0.05
"""How often the serving thread looks for a shutdown, in seconds."""


class MetricsServer:
    """A running ``/metrics`` endpoint: its :attr:`port`, and :meth:`close`."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.port: int = server.server_port
        """The bound port (the system's pick when asked for port 0)."""

    def close(self) -> None:
        """Stop serving, close the socket and join the server's thread. Idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def __repr__(self) -> str:
        return f"MetricsServer(port={self.port})"


def serve_metrics(host: str, port: int, registry: CollectorRegistry) -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics`` (any path, as
    prometheus_client does) from a thread of its own. Raises OSError if it cannot bind."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = _Server6 if family == socket.AF_INET6 else _Server
    server = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_Handler)
    # shutdown() waits for serve_forever's next poll: 0.5 s by default, on every close
    # of a sidecar (and every test's); a 50 ms select costs nothing while idle.
    thread = threading.Thread(
        target=server.serve_forever, args=(POLL_S,), name="lmtier-metrics", daemon=True
    )
    thread.start()
    return MetricsServer(server, thread)
