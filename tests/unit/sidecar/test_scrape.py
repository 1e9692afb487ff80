"""The sidecar's ``/metrics`` server against hostile connections (real sockets and
threads): a connection that never sends its whole request is closed after the read
timeout, quietly; past ``MAX_CONNECTIONS`` at once a new connection closes the oldest
one still sending its request, so half-sent requests from any local user cannot keep
a scrape out. prometheus_client's own server kept each such connection (a thread and a
descriptor) for ever: enough of them and the sidecar's gRPC listeners could not accept
engines."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator

import pytest

from lmtier.sidecar import scrape
from lmtier.sidecar.metrics import SidecarMetrics
from lmtier.sidecar.scrape import MetricsServer


def scraped(port: int) -> bool:
    """Whether a scrape of ``port`` answers with the metrics."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
            return b"lmtier_sidecar_" in reply.read()
    except OSError:
        return False


def half_request(port: int) -> socket.socket:
    """A connection that sends part of a request line and stops."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(60)
    sock.sendall(b"GET /metr")
    return sock


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    running = SidecarMetrics().serve("127.0.0.1:0")
    yield running
    running.close()


def test_a_scrape_answers(server: MetricsServer) -> None:
    assert scraped(server.port)


def test_a_request_never_finished_is_closed_after_the_read_timeout(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(scrape._Handler, "timeout", 0.2)
    running = SidecarMetrics().serve("127.0.0.1:0")
    try:
        with half_request(running.port) as stalled:
            assert stalled.recv(4096) == b""  # closed by the server, no reply
        assert scraped(running.port)
    finally:
        running.close()
    assert "Traceback" not in capfd.readouterr().err  # socketserver's handle_error


def test_half_sent_requests_past_the_cap_cannot_keep_a_scrape_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Connections that never finish their request, as many as the cap: a scrape still
    answers, and closes the oldest of them. (Before, it was closed on arrival: 32
    half-sent requests kept every scrape out, renewed every read timeout.)"""
    monkeypatch.setattr(scrape, "MAX_CONNECTIONS", 4)
    running = SidecarMetrics().serve("127.0.0.1:0")
    try:
        held = [half_request(running.port) for _ in range(4)]
        for _ in range(3):
            assert scraped(running.port)
        assert held[0].recv(4096) == b""  # the oldest made room (and got no reply)
        for sock in held:
            sock.close()
    finally:
        running.close()
