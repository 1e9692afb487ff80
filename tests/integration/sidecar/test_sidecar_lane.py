"""The sidecar's local lane (lmtier.wire.lane, lmtier.sidecar.lane): the data-path calls
on a plain unix socket. Raw frames against a real sidecar process: what a well-behaved client gets,
what a hostile one gets (and that the sidecar is unharmed), who may connect, and
that a client whose lane vanishes carries on over gRPC."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from lmtier.remote.client import SidecarStore
from lmtier.testing.sidecar import SidecarProcess
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.v1 import sidecar_pb2_grpc as pb_grpc
from support.sidecar_client import connect, kv_of, prompt
from support.sidecar_helpers import (
    LANE_HEADER,
    Session,
    assert_unharmed,
    bearer,
    open_session,
    read_exactly,
)

pytestmark = pytest.mark.integration

TOKEN = "lane-test-token-0123456789"
SETTINGS = {
    "cpu": {"capacity_bytes": "16MiB", "staging_bytes": "8MiB"},
    "sidecar": {
        "slab_bytes": "520KiB",
        "auth_token": TOKEN,
        "max_message_bytes": "1MiB",
        "stream_piece_bytes": "512KiB",
    },
}


class Lane:
    """A raw connection to the lane."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(path)

    def send(self, method: int, payload: bytes) -> None:
        self.sock.sendall(LANE_HEADER.pack(len(payload), method) + payload)

    def receive(self) -> tuple[grpc.StatusCode, bytes]:
        header = self._read(LANE_HEADER.size)
        length, code = LANE_HEADER.unpack(header)
        codes = {c.value[0]: c for c in grpc.StatusCode}
        return codes[code], self._read(length)

    def call(self, method: int, payload: bytes) -> tuple[grpc.StatusCode, bytes]:
        self.send(method, payload)
        return self.receive()

    def closed_by_peer(self) -> bool:
        return self.sock.recv(1) == b""

    def _read(self, size: int) -> bytes:
        return read_exactly(self.sock, size)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    with SidecarProcess(tmp_path_factory.mktemp("lane"), SETTINGS) as process:
        yield process


@pytest.fixture
def session(sidecar: SidecarProcess) -> Iterator[Session]:
    with grpc.insecure_channel(sidecar.target) as channel:
        stub = pb_grpc.SidecarStub(channel)
        with open_session(stub, metadata=bearer(TOKEN)) as opened:
            yield opened


@pytest.fixture
def lane(session: Session) -> Iterator[Lane]:
    connection = Lane(session.info.lane)
    yield connection
    connection.close()


def hello(lane: Lane, token: str = TOKEN) -> None:
    assert lane.call(0, f"Bearer {token}".encode()) == (grpc.StatusCode.OK, b"")


def test_the_lane_is_offered_owner_only_beside_the_socket(
    sidecar: SidecarProcess, session: Session
) -> None:
    path = Path(session.info.lane)
    assert path == sidecar.socket.with_name(sidecar.socket.name + ".lane")
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_a_lookup_on_the_lane(session: Session, lane: Lane) -> None:
    hello(lane)
    request = pb.LookupRequest(session_id=session.id, keys=session.key() + session.key())
    code, body = lane.call(1, request.SerializeToString())
    assert code == grpc.StatusCode.OK and pb.LookupReply.FromString(body).num_chunks == 0


@pytest.mark.parametrize(
    ("token", "code"),
    [
        ("", grpc.StatusCode.UNAUTHENTICATED),
        ("wrong-token-0123456789", grpc.StatusCode.UNAUTHENTICATED),
    ],
)
def test_a_hello_without_the_token_is_refused(
    sidecar: SidecarProcess, session: Session, token: str, code: grpc.StatusCode
) -> None:
    lane = Lane(session.info.lane)
    try:
        got, message = lane.call(0, f"Bearer {token}".encode() if token else b"")
        assert got == code and TOKEN.encode() not in message
        assert lane.closed_by_peer()
    finally:
        lane.close()
    assert_unharmed(sidecar, metadata=bearer(TOKEN))


def test_a_call_before_hello_is_refused(sidecar: SidecarProcess, session: Session) -> None:
    lane = Lane(session.info.lane)
    try:
        request = pb.LookupRequest(session_id=session.id, keys=session.key())
        assert lane.call(1, request.SerializeToString())[0] == grpc.StatusCode.UNAUTHENTICATED
        assert lane.closed_by_peer()
    finally:
        lane.close()


@pytest.mark.parametrize(
    ("method", "payload", "code"),
    [
        (9, b"", grpc.StatusCode.INVALID_ARGUMENT),  # no such method
        (1, b"\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT),  # not a message
        (2, pb.LoadRequest(session_id=b"x" * 16).SerializeToString(), grpc.StatusCode.NOT_FOUND),
        (4, pb.CommitRequest(session_id=b"").SerializeToString(), grpc.StatusCode.NOT_FOUND),
    ],
)
def test_bad_requests_get_a_status_and_the_lane_stays_usable(
    session: Session, lane: Lane, method: int, payload: bytes, code: grpc.StatusCode
) -> None:
    hello(lane)
    assert lane.call(method, payload)[0] == code
    request = pb.LookupRequest(session_id=session.id, keys=session.key())
    assert lane.call(1, request.SerializeToString())[0] == grpc.StatusCode.OK


def test_keys_of_another_namespace_are_permission_denied(session: Session, lane: Lane) -> None:
    hello(lane)
    other = bytes(32)
    request = pb.LoadRequest(session_id=session.id, keys=other)
    assert lane.call(2, request.SerializeToString())[0] == grpc.StatusCode.PERMISSION_DENIED


def test_an_oversized_frame_is_refused_and_the_sidecar_unharmed(
    sidecar: SidecarProcess, session: Session, lane: Lane
) -> None:
    hello(lane)
    lane.sock.sendall(LANE_HEADER.pack(64 * 1024**2, 1))  # announces 64 MiB, sends none
    assert lane.receive()[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert lane.closed_by_peer()
    assert_unharmed(sidecar, metadata=bearer(TOKEN))


def test_a_frame_cut_short_costs_nothing(sidecar: SidecarProcess, session: Session) -> None:
    lane = Lane(session.info.lane)
    hello(lane)
    lane.sock.sendall(LANE_HEADER.pack(1000, 1) + b"\x0a\x10")  # 2 of 1000 bytes, then gone
    lane.close()
    assert_unharmed(sidecar, metadata=bearer(TOKEN))


def test_the_client_carries_on_over_grpc_when_the_lane_is_gone(tmp_path: Path) -> None:
    settings = {"cpu": SETTINGS["cpu"], "sidecar": {"slab_bytes": "520KiB"}}
    with SidecarProcess(tmp_path, settings) as sidecar:
        cache = connect(sidecar.target, stream=False)
        try:
            store = cache.chunk_store
            assert isinstance(store, SidecarStore)
            ids = prompt(11, 2000)
            assert cache.store(ids, kv_of(11, 2000)) == 7
            session = store._conn().session(cache.namespace())
            assert session.lane is not None
            Path(session.lane.path).unlink()  # the lane's socket vanishes
            session.lane.close()
            with cache.load(ids) as hit:  # the next call cannot connect: gRPC instead
                assert hit.num_tokens == 7 * 256
            assert session.lane is None
        finally:
            cache.close()


def test_a_drain_closes_open_lane_connections_cleanly(tmp_path: Path) -> None:
    """SIGTERM with lane connections open (one idle after a call, one mid-frame): the
    sidecar closes them itself and exits 0, logging no error and no traceback."""
    with SidecarProcess(tmp_path, SETTINGS) as process:
        with grpc.insecure_channel(process.target) as channel:
            stub = pb_grpc.SidecarStub(channel)
            with open_session(stub, metadata=bearer(TOKEN)) as opened:
                idle, partial = Lane(opened.info.lane), Lane(opened.info.lane)
                try:
                    hello(idle)
                    request = pb.LookupRequest(session_id=opened.id, keys=opened.key())
                    code, _ = idle.call(1, request.SerializeToString())
                    assert code == grpc.StatusCode.OK
                    hello(partial)
                    partial.sock.sendall(LANE_HEADER.pack(100, 1) + b"half")  # never finished
                    process.signal(signal.SIGTERM)
                    assert process.wait() == 0
                    assert idle.closed_by_peer() and partial.closed_by_peer()
                finally:
                    idle.close()
                    partial.close()
        log = process.log()
        assert "Traceback" not in log and '"level": "ERROR"' not in log, log[-3000:]
