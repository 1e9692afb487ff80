"""A slow but healthy network link for integration tests: a TCP proxy on loopback that
forwards every byte to a real server (redis-server, moto) at a capped rate.

Faults here are real: the tier talks to a real server through real sockets, and the
proxy only delays bytes, exactly as a long-distance or congested link would. It runs
in threads of the test process and listens on 127.0.0.1 only.

    with SlowLink(target_port, bytes_per_s=1_600_000) as link:
        url = f"redis://127.0.0.1:{link.port}/0"

It also injects a fault at a precise moment: :meth:`SlowLink.trip_on_reply` runs an
action (kill the server) when the first large reply starts to flow back, that is in
the middle of a load, never during the small replies of lookups.
"""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType

__all__ = ["SlowLink"]

_BLOCK = 16 * 1024


class _Bucket:
    """A token bucket shared by every connection of one direction: the link's capacity.
    An idle link saves up at most ``_BLOCK`` bytes of credit."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._tokens = float(_BLOCK)
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        """Wait until ``nbytes`` may go."""
        with self._lock:  # one sender at a time: they queue like packets on a wire
            now = time.monotonic()
            self._tokens = min(float(_BLOCK), self._tokens + (now - self._last) * self.rate)
            self._tokens -= nbytes
            self._last = now
            if self._tokens < 0:
                time.sleep(-self._tokens / self.rate)
                self._tokens, self._last = 0.0, time.monotonic()


class SlowLink:
    """A TCP proxy from ``127.0.0.1:port`` to ``127.0.0.1:target_port`` moving at most
    ``bytes_per_s`` in each direction, all connections together (``math.inf``: a plain
    proxy, for :meth:`trip_on_reply`)."""

    def __init__(self, target_port: int, bytes_per_s: float = math.inf) -> None:
        self.target_port = target_port
        self.bytes_per_s = bytes_per_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._up, self._down = _Bucket(bytes_per_s), _Bucket(bytes_per_s)
        self._lock = threading.Lock()
        self._closed = False
        self._trip: tuple[int, Callable[[], None]] | None = None
        self.tripped = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="slow-link", daemon=True)

    def __enter__(self) -> SlowLink:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def trip_on_reply(self, min_bytes: int, action: Callable[[], None]) -> None:
        """Arm a fault: the first read of at least ``min_bytes`` (at most 16 KiB) coming
        back from the server runs ``action`` and cuts that connection instead of
        forwarding it; once (then :attr:`tripped` is set)."""
        with self._lock:
            self._trip = (min(min_bytes, _BLOCK), action)

    def _tripwire(self, size: int) -> bool:
        """Whether a read of ``size`` bytes from the server trips the armed fault."""
        with self._lock:
            if self._trip is None or size < self._trip[0]:
                return False
            action, self._trip = self._trip[1], None
        action()
        self.tripped.set()
        return True

    def close(self) -> None:
        """Stop accepting and cut every connection."""
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        self._listener.close()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
            for source, sink, bucket in ((client, server, self._up), (server, client, self._down)):
                threading.Thread(
                    target=self._pump, args=(source, sink, bucket), daemon=True
                ).start()

    def _pump(self, source: socket.socket, sink: socket.socket, bucket: _Bucket) -> None:
        try:
            while True:
                data = source.recv(_BLOCK)
                if not data:
                    break
                if bucket is self._down and self._tripwire(len(data)):
                    for sock in (source, sink):  # the reply never arrives whole
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_RDWR)
                    return
                bucket.take(len(data))
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)
