"""Closing the S3 tier ends its requests in flight (lmtier_backends.s3.io.Connections),
against a loopback listener that accepts connections (the kernel does) and never
answers: a hung endpoint, without moto or a stopped process."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from lmtier.config import S3TierConfig
from lmtier.errors import BackendUnavailable
from lmtier_backends.s3.io import Connections, make_client

TIMEOUT_S = 60.0
"""The client's timeouts: far above the bounds below, so only aborting can end a call."""


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A listening socket nobody reads from: requests to it hang."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.fixture
def client(silent_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    config = S3TierConfig(bucket="hung-bucket", endpoint_url=silent_endpoint, timeout_s=TIMEOUT_S)
    client = make_client(config)
    yield client
    client.close()


def call_in_thread(fn: Any) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, errors


def test_abort_ends_a_hung_request_and_refuses_its_retry(client: Any) -> None:
    connections = Connections("S3 tier 's3' (hung-bucket) is closed")
    connections.attach(client)
    thread, errors = call_in_thread(lambda: client.head_object(Bucket="hung-bucket", Key="k"))
    time.sleep(0.3)
    assert thread.is_alive()  # hung on the silent endpoint
    started = time.perf_counter()
    connections.abort()
    thread.join(10.0)
    assert not thread.is_alive(), "the request waited out its timeout"
    assert time.perf_counter() - started < 10.0
    assert len(errors) == 1
    assert isinstance(errors[0], BackendUnavailable)
    assert "closed" in str(errors[0])
    with pytest.raises(BackendUnavailable, match="closed"):  # refused before it connects
        client.head_object(Bucket="hung-bucket", Key="k")


def test_a_socket_that_connects_after_abort_is_shut_down() -> None:
    connections = Connections("closed")
    ours, theirs = socket.socketpair()
    with ours, theirs:
        connections.abort()
        connections._register(ours)  # a connect that raced with abort
        theirs.settimeout(5.0)
        assert theirs.recv(1) == b""  # EOF: ours was shut down


def test_abort_spares_sockets_already_closed() -> None:
    connections = Connections("closed")
    ours, theirs = socket.socketpair()
    with theirs:
        connections._register(ours)
        ours.close()
        connections.abort()  # no error on the closed socket
        connections.abort()  # idempotent


def test_attach_warns_where_botocore_keeps_no_pool_classes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hooks: list[str] = []
    events = SimpleNamespace(register=lambda name, handler: hooks.append(name))
    with caplog.at_level(logging.WARNING, logger="lmtier_backends.s3.io"):
        Connections("closed").attach(SimpleNamespace(meta=SimpleNamespace(events=events)))
    assert "will not end requests in flight" in caplog.text
    assert hooks == ["before-send.s3"]  # new requests are still refused once closed
