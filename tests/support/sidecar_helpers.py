"""Helpers for the integration tests that talk to a real ``lmtier serve`` process with
raw gRPC stubs (test_sidecar_hostile.py, test_sidecar_auth.py).

Nothing here fakes the sidecar: sessions are real ``OpenSession`` streams, chunks are
real encodings (:func:`lmtier.testing.make_chunk`), and every "the server is unharmed"
check asks the process itself (alive, health SERVING, a fresh session that looks up).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import secrets
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc
import pytest
import torch
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lmtier.chunks.keys import ChunkKey
from lmtier.testing import make_chunk
from lmtier.testing.sidecar import START_TIMEOUT_S, SidecarProcess
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.v1 import sidecar_pb2_grpc as pb_grpc
from lmtier.wire.shm import SharedRegion

__all__ = [
    "CALL_TIMEOUT_S",
    "LANE_HEADER",
    "NAMESPACE",
    "Metadata",
    "Session",
    "TENANT_MODEL",
    "TcpSidecar",
    "assert_unharmed",
    "bearer",
    "chunk_for",
    "drain",
    "expect_code",
    "gauges",
    "health_status",
    "make_self_signed",
    "namespace",
    "open_session",
    "pieces",
    "read_exactly",
    "run_lmtier",
    "store_stream",
    "tenant",
    "wait_for",
    "write_slab",
    "write_tokens",
]

T = TypeVar("T")
Metadata = Sequence[tuple[str, str]]

CALL_TIMEOUT_S = 30.0
"""Deadline of every call: generous, only there so that a hung sidecar fails a test
instead of hanging it."""
POLL_TIMEOUT_S = 120.0
"""How long a condition is polled for: a hang guard, never reached when all is well."""
LANE_HEADER = struct.Struct("<IB")
"""A lane frame's header: ``<u32 length><u8 method or status>`` (lmtier.wire.lane)."""

NAMESPACE = pb.Namespace(
    model_id="hostile/model",
    kv_dtype="float32",
    kv_layout="LKTHD",
    num_layers=1,
    num_kv_heads=1,
    head_dim=64,
    chunk_size=16,
)
"""The geometry of :func:`lmtier.testing.make_chunk` (1 layer, 1 head, 64 wide, 16
tokens of float32): about 8.5 KB encoded, so it fits a 16 KiB slab."""


def namespace(**changes: Any) -> pb.Namespace:
    """:data:`NAMESPACE` with some fields changed."""
    out = pb.Namespace()
    out.CopyFrom(NAMESPACE)
    for name, value in changes.items():
        setattr(out, name, value)
    return out


def bearer(token: str) -> Metadata:
    return (("authorization", f"Bearer {token}"),)


TENANT_MODEL = "shared/model"
"""The model id the tenants of :func:`tenant` share (each under its own salt)."""


def write_tokens(folder: Path, entries: list[dict[str, Any]]) -> Path:
    """A ``tokens_file`` (0600) in ``folder`` with these entries."""
    path = folder / "tokens.yaml"
    path.write_text(yaml.safe_dump(entries))
    path.chmod(0o600)
    return path


def tenant(stub: pb_grpc.SidecarStub, token: str, salt: str, **kw: Any) -> Session:
    """A session of :data:`TENANT_MODEL` under ``salt``, opened with ``token``."""
    space = namespace(model_id=TENANT_MODEL, cache_salt=salt)
    return open_session(stub, space, metadata=bearer(token), **kw)


def wait_for(condition: Callable[[], T], what: str, timeout_s: float = POLL_TIMEOUT_S) -> T:
    """Poll ``condition`` until it returns something true (never a fixed sleep); fail
    with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


_METHODS = (
    grpc.UnaryUnaryMultiCallable,
    grpc.UnaryStreamMultiCallable,
    grpc.StreamUnaryMultiCallable,
    grpc.StreamStreamMultiCallable,
)


def drain(result: Any) -> None:
    """Read a server-streaming call's answer to its end (its error, if any, raises)."""
    if isinstance(result, grpc.Call) and hasattr(result, "__next__"):
        for _ in result:
            pass


def expect_code(code: grpc.StatusCode, call: Callable[..., Any], *args: Any, **kw: Any) -> str:
    """Call ``call(*args, **kw)``, which must fail with ``code``; its details.

    A gRPC method gets the deadline :data:`CALL_TIMEOUT_S`; a server-streaming call's
    answer is drained, so that its error surfaces here too.
    """
    if isinstance(call, _METHODS):
        kw.setdefault("timeout", CALL_TIMEOUT_S)
    with pytest.raises(grpc.RpcError) as caught:
        drain(call(*args, **kw))
    error = caught.value
    assert error.code() == code, f"expected {code.name}, got {error.code().name}: {error.details()}"
    details = error.details() or ""
    assert "Traceback" not in details, details
    return details


class Session:
    """One open ``OpenSession`` stream (a context manager that cancels it)."""

    def __init__(self, call: Any, info: pb.SessionInfo, metadata: Metadata) -> None:
        self.call = call
        self.info = info
        self.metadata = tuple(metadata)

    @property
    def id(self) -> bytes:
        return bytes(self.info.session_id)

    @property
    def digest(self) -> bytes:
        return bytes(self.info.namespace_digest)

    def key(self, chain: bytes | None = None) -> ChunkKey:
        """A key of this session's namespace (random chain unless given)."""
        return ChunkKey(self.digest + (chain if chain is not None else secrets.token_bytes(16)))

    def close(self) -> None:
        self.call.cancel()

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def open_session(
    stub: pb_grpc.SidecarStub,
    space: pb.Namespace = NAMESPACE,
    *,
    shared_memory: bool = True,
    metadata: Metadata = (),
    client_name: str = "",
) -> Session:
    """Open a session; its first event must be ``opened``."""
    request = pb.OpenSessionRequest(
        namespace=space, shared_memory=shared_memory, client_name=client_name
    )
    call = stub.OpenSession(request, metadata=tuple(metadata))
    try:
        first = next(call)
    except BaseException:
        call.cancel()
        raise
    assert first.WhichOneof("event") == "opened", first
    return Session(call, first.opened, metadata)


def gauges(stub: pb_grpc.SidecarStub, session: Session) -> dict[str, float]:
    """The sidecar's own counters (sessions, leases, slabs_in_use, ...)."""
    reply = stub.Stats(
        pb.StatsRequest(session_id=session.id), metadata=session.metadata, timeout=CALL_TIMEOUT_S
    )
    return dict(reply.sidecar.values)


def write_slab(region: SharedRegion, session: Session, slab: int, data: bytes, at: int = 0) -> None:
    """Write ``data`` at byte ``at`` of ``slab`` of the sidecar's shared pool, as a
    client that mapped it (``region``) can, lease or no lease."""
    shm = session.info.shm
    assert at + len(data) <= shm.slab_stride
    if not data:
        return
    start = shm.first_slab_offset + slab * shm.slab_stride + at
    region.tensor[start : start + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)


def chunk_for(key: ChunkKey, *, seed: int | None = None, hidden: int = 64) -> bytes:
    """A valid encoded chunk of :data:`NAMESPACE`'s geometry under ``key``."""
    return make_chunk(key, num_tokens=16, hidden=hidden, seed=seed)[1]


def pieces(
    session_id: bytes, chunks: Sequence[tuple[bytes, bytes]], piece_bytes: int = 4096
) -> Iterator[pb.ChunkPiece]:
    """The StoreStream messages of whole ``(key, encoded)`` chunks, in order."""
    first = True
    for key, data in chunks:
        for offset in range(0, len(data), piece_bytes):
            piece = pb.ChunkPiece(offset=offset, data=data[offset : offset + piece_bytes])
            if offset == 0:
                piece.key, piece.total_length = key, len(data)
            if first:
                piece.session_id, first = session_id, False
            yield piece


def store_stream(
    stub: pb_grpc.SidecarStub, session: Session, chunks: Sequence[tuple[bytes, bytes]]
) -> pb.StoreReply:
    reply: pb.StoreReply = stub.StoreStream(
        pieces(session.id, chunks), metadata=session.metadata, timeout=CALL_TIMEOUT_S
    )
    return reply


def health_status(
    target: str, credentials: grpc.ChannelCredentials | None = None
) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    channel = (
        grpc.insecure_channel(target)
        if credentials is None
        else grpc.secure_channel(target, credentials)
    )
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT_S
        )
    return reply.status


def assert_unharmed(
    sidecar: SidecarProcess,
    *,
    metadata: Metadata = (),
    credentials: grpc.ChannelCredentials | None = None,
    space: pb.Namespace = NAMESPACE,
) -> None:
    """The sidecar process is alive, its health says SERVING, and a fresh channel opens
    a session on which Lookup (keys and tokens) and Stats answer."""
    assert sidecar.process is not None and sidecar.process.poll() is None, sidecar.log()
    assert health_status(sidecar.target, credentials) == health_pb2.HealthCheckResponse.SERVING
    channel = (
        grpc.insecure_channel(sidecar.target)
        if credentials is None
        else grpc.secure_channel(sidecar.target, credentials)
    )
    with channel:
        stub = pb_grpc.SidecarStub(channel)
        with open_session(stub, space, metadata=metadata, client_name="unharmed-check") as s:
            reply = stub.Lookup(
                pb.LookupRequest(session_id=s.id, keys=s.key() + s.key()),
                metadata=s.metadata,
                timeout=CALL_TIMEOUT_S,
            )
            assert reply.num_chunks == 0
            tokens = pb.TokenIds(ids=list(range(48)))
            reply = stub.Lookup(
                pb.LookupRequest(session_id=s.id, tokens=tokens),
                metadata=s.metadata,
                timeout=CALL_TIMEOUT_S,
            )
            assert len(reply.keys) == 3 * 32
            assert gauges(stub, s)["sessions"] >= 1


LISTENING = re.compile(r"lmtier sidecar listening on (\S+)")


class TcpSidecar(SidecarProcess):
    """A sidecar on a TCP listener, which :class:`SidecarProcess` cannot wait for by
    itself: with port 0 the bound port is read from the line the sidecar prints
    ("lmtier sidecar listening on HOST:PORT"), and with TLS the health check needs the
    client's credentials. ``target`` becomes ``connect_host:PORT`` once it serves."""

    def __init__(
        self,
        directory: Path,
        settings: dict[str, Any],
        *,
        listen: str,
        credentials: grpc.ChannelCredentials | None = None,
        connect_host: str = "127.0.0.1",
        **kwargs: Any,
    ) -> None:
        super().__init__(directory, settings, listen=listen, **kwargs)
        self.credentials = credentials
        self.connect_host = connect_host
        self.port: int | None = None

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"the sidecar exited ({self.process.returncode}):\n{self.log()}")
            found = LISTENING.search(self.log())
            if found is not None:
                self.port = int(found[1].rsplit(":", 1)[1])
                self.target = f"{self.connect_host}:{self.port}"
                try:
                    status = health_status(self.target, self.credentials)
                except grpc.RpcError:
                    status = None
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sidecar did not serve in {timeout_s} s:\n{self.log()}")
            time.sleep(0.05)


def make_self_signed(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1 and its key (PEM files);
    the certificate is its own CA, for the client's ``ca_file``."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "server.crt", folder / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


def read_exactly(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes from ``sock``; ConnectionResetError if the peer closes first."""
    data = b""
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            raise ConnectionResetError("the peer closed")
        data += more
    return data


def run_lmtier(config_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m lmtier.cli --config CONFIG ARGS`` as a process, as an operator runs
    it (no LMTIER_* variables: the file rules; stdin empty)."""
    return subprocess.run(
        [sys.executable, "-m", "lmtier.cli", "--config", str(config_path), *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("LMTIER_")},
    )
