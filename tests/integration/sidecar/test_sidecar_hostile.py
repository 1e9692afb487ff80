"""A real ``lmtier serve`` process against hostile and broken clients, over raw gRPC.

Every refusal must carry the status code that proto/lmtier/v1/sidecar.proto promises
(INVALID_ARGUMENT for bad input, PERMISSION_DENIED for another namespace's keys,
NOT_FOUND for an unknown session, RESOURCE_EXHAUSTED for no free slab or an oversized
message, FAILED_PRECONDITION for a call the session was not offered), never a stack
trace, and must leave the sidecar unharmed: the process alive, health SERVING, a fresh
session that looks up, and no lease or slab left behind.

One sidecar serves the whole module: a unix socket, no token, and a tiny shared pool
(6 slabs of 16 KiB: 4 cached, 2 staging) so that every slab can be held at once.
"""

from __future__ import annotations

import os
import random
import secrets
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from lmtier.chunks.format import PREFIX, PREFIX_LEN
from lmtier.testing.sidecar import SidecarProcess
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.v1 import sidecar_pb2_grpc as pb_grpc
from lmtier.wire.shm import SharedRegion
from support.sidecar_helpers import (
    CALL_TIMEOUT_S,
    Session,
    assert_unharmed,
    chunk_for,
    drain,
    expect_code,
    gauges,
    namespace,
    open_session,
    pieces,
    store_stream,
    wait_for,
    write_slab,
)

pytestmark = pytest.mark.integration

Code = grpc.StatusCode
SLAB_BYTES = 16 * 1024
NUM_SLABS = 6
MAX_SESSIONS = 8
MAX_MESSAGE_BYTES = 4 * 1024**2
MAX_KEYS = 1 << 16  # lmtier.sidecar.namespaces.MAX_KEYS
CHUNK_SIZE = 16  # sidecar_helpers.NAMESPACE
SETTINGS = {
    "cpu": {"capacity_bytes": "64KiB", "staging_bytes": "32KiB"},
    "sidecar": {
        "slab_bytes": "16KiB",
        "max_message_bytes": "4MiB",
        "stream_piece_bytes": "64KiB",
        "max_sessions": MAX_SESSIONS,
    },
}


# --- fixtures --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    with SidecarProcess(tmp_path_factory.mktemp("hostile"), SETTINGS) as process:
        yield process


@pytest.fixture(scope="module")
def channel(sidecar: SidecarProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(sidecar.target) as opened:
        yield opened


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.SidecarStub:
    return pb_grpc.SidecarStub(channel)


@pytest.fixture(scope="module")
def control(stub: pb_grpc.SidecarStub) -> Iterator[Session]:
    """A session open for the whole module: Stats go through it."""
    with open_session(stub, client_name="control") as session:
        assert session.info.HasField("shm")
        assert session.info.shm.num_slabs == NUM_SLABS
        yield session


@pytest.fixture(scope="module")
def region(control: Session) -> Iterator[SharedRegion]:
    """The sidecar's shared pool, mapped here (to write slabs as a client does)."""
    shm = control.info.shm
    mapped = SharedRegion.attach(Path(shm.path), shm.size)
    yield mapped
    mapped.close()


@pytest.fixture
def quiet(stub: pb_grpc.SidecarStub, control: Session) -> dict[str, float]:
    """The sidecar's gauges once earlier tests' sessions have closed (only the control
    session open, no lease held)."""

    def settled() -> dict[str, float] | None:
        now = gauges(stub, control)
        return now if now["sessions"] == 1 and now["leases"] == 0 else None

    return wait_for(settled, "the sessions of earlier tests to close")


# --- helpers ---------------------------------------------------------------------------


def acquire(stub: pb_grpc.SidecarStub, session: Session, count: int) -> list[pb.SlabGrant]:
    reply = stub.AcquireSlabs(
        pb.AcquireSlabsRequest(session_id=session.id, count=count), timeout=CALL_TIMEOUT_S
    )
    return list(reply.slabs)


def release(stub: pb_grpc.SidecarStub, session: Session, leases: list[int]) -> None:
    stub.Release(pb.ReleaseRequest(session_id=session.id, leases=leases), timeout=CALL_TIMEOUT_S)


def found(stub: pb_grpc.SidecarStub, session: Session, *keys: bytes) -> int:
    reply = stub.Lookup(
        pb.LookupRequest(session_id=session.id, keys=b"".join(keys)), timeout=CALL_TIMEOUT_S
    )
    return reply.num_chunks


def assert_no_slab_held(stub: pb_grpc.SidecarStub, control: Session) -> None:
    """No lease is held and every slab can be leased (evicting the cached chunks)."""
    assert gauges(stub, control)["leases"] == 0
    grants = acquire(stub, control, NUM_SLABS)
    release(stub, control, [g.lease for g in grants])
    assert len(grants) == NUM_SLABS, "a slab was leaked"
    assert gauges(stub, control)["leases"] == 0


def assert_unharmed_when_quiet(
    sidecar: SidecarProcess, stub: pb_grpc.SidecarStub, control: Session
) -> None:
    """:func:`assert_unharmed` once the test's own sessions have closed."""
    wait_for(lambda: gauges(stub, control)["sessions"] == 1, "the test's sessions to close")
    assert_unharmed(sidecar)


def expect_open_refused(
    code: grpc.StatusCode, stub: pb_grpc.SidecarStub, space: Any, client_name: str = ""
) -> str:
    """OpenSession must fail with ``code`` before its first event."""
    request = pb.OpenSessionRequest(namespace=space, shared_memory=True, client_name=client_name)
    call = stub.OpenSession(request, timeout=CALL_TIMEOUT_S)
    try:
        return expect_code(code, lambda: next(call))
    finally:
        call.cancel()  # opened after all (the test failed): do not leave it open


# --- the socket ------------------------------------------------------------------------


def test_unix_socket_and_shared_pool_are_owner_only(
    sidecar: SidecarProcess, control: Session
) -> None:
    info = sidecar.socket.lstat()
    assert stat.S_ISSOCK(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_uid == os.getuid()
    folder = sidecar.socket.parent.stat()
    assert stat.S_IMODE(folder.st_mode) == 0o700
    pool = Path(control.info.shm.path).lstat()
    assert stat.S_ISREG(pool.st_mode) and stat.S_IMODE(pool.st_mode) == 0o600


# --- malformed and oversized messages --------------------------------------------------

GARBAGE = {
    "truncated-varint": b"\xff\xff\xff\xff",
    "length-past-end": b"\x0a\xff\xff\xff\xff\x0f",
    "short-field": b"\x0a\x05ab",
    "end-group-tag": b"\x0c",
    "random": random.Random(2026).randbytes(4096),
}


@pytest.mark.parametrize("garbage", list(GARBAGE.values()), ids=list(GARBAGE))
@pytest.mark.parametrize(
    "method",
    ["Lookup", "Load", "AcquireSlabs", "Commit", "Release", "OpenSession", "LoadStream"],
)
def test_garbage_bytes_are_refused(
    sidecar: SidecarProcess,
    channel: grpc.Channel,
    stub: pb_grpc.SidecarStub,
    control: Session,
    quiet: dict[str, float],
    method: str,
    garbage: bytes,
) -> None:
    path = f"/lmtier.v1.Sidecar/{method}"
    if method in ("OpenSession", "LoadStream"):
        call = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
    else:
        call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as caught:
        drain(call(garbage, timeout=CALL_TIMEOUT_S))
    error = caught.value
    assert error.code() == Code.INVALID_ARGUMENT, f"{error.code().name}: {error.details()}"
    assert "Traceback" not in (error.details() or "") and "Traceback" not in sidecar.log()
    after = gauges(stub, control)
    assert (after["sessions"], after["leases"]) == (1, 0)
    assert_unharmed(sidecar)


@pytest.mark.parametrize("garbage_first", [True, False], ids=["first", "mid-chunk"])
def test_garbage_in_a_client_stream_is_invalid(
    sidecar: SidecarProcess,
    channel: grpc.Channel,
    stub: pb_grpc.SidecarStub,
    control: Session,
    garbage_first: bool,
) -> None:
    """In StoreStream the sidecar's own handler reads the messages, so a message that
    does not parse is its to answer: bad input (INVALID_ARGUMENT), not an internal
    error with a logged traceback."""
    call = channel.stream_unary(
        "/lmtier.v1.Sidecar/StoreStream", request_serializer=None, response_deserializer=None
    )
    before = gauges(stub, control)["slabs_in_use"]
    valid = pb.ChunkPiece(session_id=control.id, key=control.key(), total_length=9000)
    messages = [GARBAGE["length-past-end"]]
    if not garbage_first:  # the first piece takes a slab, which must come back
        messages.insert(0, valid.SerializeToString())
    with pytest.raises(grpc.RpcError) as caught:
        call(iter(messages), timeout=CALL_TIMEOUT_S)
    wait_for(
        lambda: gauges(stub, control)["slabs_in_use"] == before, "the stream's slab to come back"
    )
    assert_unharmed(sidecar)
    error = caught.value
    assert error.code() == Code.INVALID_ARGUMENT, f"{error.code().name}: {error.details()}"


def _bad_utf8(message: Any, marker: bytes = b"QQQQ") -> bytes:
    """``message`` serialized, the string ``marker`` it holds made invalid UTF-8."""
    data = message.SerializeToString()
    assert data.count(marker) == 1
    return data.replace(marker, b"\xff\xfe" + marker[2:])


def test_strings_that_are_not_utf8_are_invalid(
    sidecar: SidecarProcess, channel: grpc.Channel, control: Session
) -> None:
    """protobuf refuses a string field that is not UTF-8 when it parses the message:
    bad input (INVALID_ARGUMENT), not grpc's UNKNOWN with a logged traceback."""
    span = pb.TierSpan(tier="QQQQ", start=0, stop=1)
    requests = {
        "OpenSession": pb.OpenSessionRequest(namespace=namespace(), client_name="QQQQ"),
        "Load": pb.LoadRequest(session_id=control.id, keys=control.key(), lookup=[span]),
        "LoadStream": pb.LoadRequest(session_id=control.id, keys=control.key(), lookup=[span]),
    }
    for method, request in requests.items():
        path = f"/lmtier.v1.Sidecar/{method}"
        if method in ("OpenSession", "LoadStream"):
            call = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
        else:
            call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
        details = expect_code(Code.INVALID_ARGUMENT, call, _bad_utf8(request))
        assert "UTF-8" in details, details
    piece = pb.ChunkPiece(session_id=control.id, key=control.key(), total_length=4, data=b"abcd")
    piece.tier = "QQQQ"  # a load's field, ignored on a store, but it must parse
    store = channel.stream_unary(
        "/lmtier.v1.Sidecar/StoreStream", request_serializer=None, response_deserializer=None
    )
    expect_code(Code.INVALID_ARGUMENT, store, iter([_bad_utf8(piece)]))
    assert "Traceback" not in sidecar.log()
    assert_unharmed(sidecar)


@pytest.mark.parametrize("field", ["kv_dtype", "kv_layout"])
def test_long_strings_are_quoted_briefly(
    sidecar: SidecarProcess, stub: pb_grpc.SidecarStub, field: str
) -> None:
    """An error that quotes a 20,000-character value is still the caller's error: its
    message is cut (grpc refuses status details over 16 KiB, which would turn it into
    RESOURCE_EXHAUSTED)."""
    space = namespace(**{field: "x" * 20_000})
    details = expect_open_refused(Code.INVALID_ARGUMENT, stub, space)
    assert len(details) <= 1100, len(details)
    assert_unharmed(sidecar)


def test_long_model_ids_and_client_names_are_logged_briefly(
    sidecar: SidecarProcess, stub: pb_grpc.SidecarStub
) -> None:
    """The sidecar logs each session's model id and client name at INFO: a 1 MB id wrote
    1 MB of log per session. Now both are cut (about 100 characters each), and names
    past their bounds (a session keeps its namespace all its life) are refused."""
    for space, client in (
        (namespace(model_id="m" * 1_000_000), ""),
        (namespace(cache_salt="s" * 1025), ""),
        (namespace(), "c" * 1_000_000),
    ):
        details = expect_open_refused(Code.INVALID_ARGUMENT, stub, space, client_name=client)
        assert "at most" in details and len(details) < 200, details
    before = len(sidecar.log())
    space = namespace(model_id="m" * 1024)
    with open_session(stub, space, client_name="c" * 256):
        pass
    marker = "log-marker-" + secrets.token_hex(8)
    with open_session(stub, client_name=marker):
        pass
    log = wait_for(lambda: marker in sidecar.log() and sidecar.log(), "the marker in the log")
    assert len(log) - before < 16_384, len(log) - before
    assert "mmmmmmmmmm" in log  # still named, briefly


def test_empty_message_parses_and_names_no_session(
    channel: grpc.Channel, sidecar: SidecarProcess
) -> None:
    call = channel.unary_unary(
        "/lmtier.v1.Sidecar/Lookup", request_serializer=None, response_deserializer=None
    )
    expect_code(Code.NOT_FOUND, call, b"")
    assert_unharmed(sidecar)


def test_messages_over_max_message_bytes_are_resource_exhausted(
    sidecar: SidecarProcess, stub: pb_grpc.SidecarStub, control: Session
) -> None:
    before = gauges(stub, control)
    keys = control.key() * (MAX_MESSAGE_BYTES // 32 + 1)
    expect_code(
        Code.RESOURCE_EXHAUSTED, stub.Lookup, pb.LookupRequest(session_id=control.id, keys=keys)
    )
    expect_code(
        Code.RESOURCE_EXHAUSTED, stub.Load, pb.LoadRequest(session_id=control.id, keys=keys)
    )
    huge = pb.ChunkPiece(
        session_id=control.id,
        key=control.key(),
        total_length=MAX_MESSAGE_BYTES + 1,
        data=bytes(MAX_MESSAGE_BYTES + 1),
    )
    expect_code(Code.RESOURCE_EXHAUSTED, stub.StoreStream, iter([huge]))
    after = gauges(stub, control)
    assert after["leases"] == before["leases"]
    wait_for(
        lambda: gauges(stub, control)["slabs_in_use"] == before["slabs_in_use"],
        "no slab to be held by the refused stream",
    )
    assert_unharmed(sidecar)


# --- keys ------------------------------------------------------------------------------


def _key_calls(stub: pb_grpc.SidecarStub) -> dict[str, Callable[[bytes, bytes], Any]]:
    """Each call that takes keys, as ``call(session_id, keys)``."""
    return {
        "Lookup": lambda sid, keys: stub.Lookup(
            pb.LookupRequest(session_id=sid, keys=keys), timeout=CALL_TIMEOUT_S
        ),
        "Load": lambda sid, keys: stub.Load(
            pb.LoadRequest(session_id=sid, keys=keys), timeout=CALL_TIMEOUT_S
        ),
        "LoadStream": lambda sid, keys: list(
            stub.LoadStream(pb.LoadRequest(session_id=sid, keys=keys), timeout=CALL_TIMEOUT_S)
        ),
    }


@pytest.mark.parametrize("method", ["Lookup", "Load", "LoadStream"])
@pytest.mark.parametrize("length", [1, 16, 31, 33, 63, 65])
def test_keys_not_a_multiple_of_32_bytes_are_invalid(
    stub: pb_grpc.SidecarStub, control: Session, method: str, length: int
) -> None:
    keys = (control.key() * 3)[:length]
    details = expect_code(Code.INVALID_ARGUMENT, _key_calls(stub)[method], control.id, keys)
    assert "32 bytes" in details


@pytest.mark.parametrize("method", ["Lookup", "Load", "LoadStream"])
def test_too_many_keys_are_invalid(
    sidecar: SidecarProcess, stub: pb_grpc.SidecarStub, control: Session, method: str
) -> None:
    keys = control.key() * (MAX_KEYS + 1)
    details = expect_code(Code.INVALID_ARGUMENT, _key_calls(stub)[method], control.id, keys)
    assert str(MAX_KEYS) in details
    assert found(stub, control, *[control.key()] * MAX_KEYS) == 0  # the limit itself is fine
    assert_unharmed(sidecar)


def test_too_many_keys_from_token_ids_are_invalid(
    sidecar: SidecarProcess, stub: pb_grpc.SidecarStub, control: Session
) -> None:
    """Token ids hash into keys: more than MAX_KEYS full chunks is as many keys as
    the limit refuses when they are given (16 tokens a chunk here, 1 byte a token id)."""
    tokens = pb.TokenIds(ids=[7] * (CHUNK_SIZE * (MAX_KEYS + 1)))
    expect_code(
        Code.INVALID_ARGUMENT, stub.Lookup, pb.LookupRequest(session_id=control.id, tokens=tokens)
    )
    assert_unharmed(sidecar)


@pytest.mark.parametrize("method", ["Lookup", "Load", "LoadStream"])
def test_keys_of_another_namespace_are_permission_denied(
    stub: pb_grpc.SidecarStub, control: Session, method: str
) -> None:
    call = _key_calls(stub)[method]
    stranger = secrets.token_bytes(32)
    expect_code(Code.PERMISSION_DENIED, call, control.id, stranger)
    expect_code(Code.PERMISSION_DENIED, call, control.id, control.key() + stranger)
    # Also a namespace this very client has open in another session.
    with open_session(stub, namespace(model_id="hostile/other")) as other:
        expect_code(Code.PERMISSION_DENIED, call, control.id, other.key())
        expect_code(Code.PERMISSION_DENIED, call, other.id, control.key())


@pytest.mark.parametrize("method", ["Load", "LoadStream"])
def test_a_load_that_names_a_key_twice_is_invalid(
    sidecar: SidecarProcess, stub: pb_grpc.SidecarStub, control: Session, method: str
) -> None:
    """A load names the chunks of one prefix, each once: one LoadStream that named a
    cached key 65,536 times streamed it each time (550 MB for a 2 MB request)."""
    key = control.key()
    assert store_stream(stub, control, [(key, chunk_for(key))]).stored == 1
    call = _key_calls(stub)[method]
    for keys, words in ((key * 3, "key 1 repeats key 0"), (key + control.key() + key, "key 2")):
        details = expect_code(Code.INVALID_ARGUMENT, call, control.id, keys)
        assert words in details
    assert gauges(stub, control)["leases"] == 0
    assert_unharmed(sidecar)


# --- sessions --------------------------------------------------------------------------


def _session_calls(stub: pb_grpc.SidecarStub) -> dict[str, Callable[[bytes], Any]]:
    """Each call that names a session, as ``call(session_id)``."""
    return {
        "Lookup": lambda sid: stub.Lookup(
            pb.LookupRequest(session_id=sid, keys=b""), timeout=CALL_TIMEOUT_S
        ),
        "Load": lambda sid: stub.Load(pb.LoadRequest(session_id=sid), timeout=CALL_TIMEOUT_S),
        "LoadStream": lambda sid: list(
            stub.LoadStream(pb.LoadRequest(session_id=sid), timeout=CALL_TIMEOUT_S)
        ),
        "AcquireSlabs": lambda sid: stub.AcquireSlabs(
            pb.AcquireSlabsRequest(session_id=sid, count=1), timeout=CALL_TIMEOUT_S
        ),
        "Commit": lambda sid: stub.Commit(
            pb.CommitRequest(session_id=sid, chunks=[pb.CommittedSlab(lease=1, length=1)]),
            timeout=CALL_TIMEOUT_S,
        ),
        "StoreStream": lambda sid: stub.StoreStream(
            iter([pb.ChunkPiece(session_id=sid, key=bytes(32), total_length=64, data=bytes(64))]),
            timeout=CALL_TIMEOUT_S,
        ),
        "Release": lambda sid: stub.Release(
            pb.ReleaseRequest(session_id=sid, leases=[1]), timeout=CALL_TIMEOUT_S
        ),
        "Flush": lambda sid: stub.Flush(pb.FlushRequest(session_id=sid), timeout=CALL_TIMEOUT_S),
        "Stats": lambda sid: stub.Stats(pb.StatsRequest(session_id=sid), timeout=CALL_TIMEOUT_S),
        "Purge": lambda sid: stub.Purge(pb.PurgeRequest(session_id=sid), timeout=CALL_TIMEOUT_S),
    }


SESSION_IDS = {
    "empty": b"",
    "zeros": bytes(16),
    "random": secrets.token_bytes(16),
    "short": b"\x01",
    "long": secrets.token_bytes(1024),
}


@pytest.mark.parametrize("session_id", list(SESSION_IDS.values()), ids=list(SESSION_IDS))
@pytest.mark.parametrize(
    "method",
    [
        "Lookup",
        "Load",
        "LoadStream",
        "AcquireSlabs",
        "Commit",
        "StoreStream",
        "Release",
        "Flush",
        "Stats",
        "Purge",
    ],
)
def test_unknown_session_ids_are_not_found(
    stub: pb_grpc.SidecarStub, method: str, session_id: bytes
) -> None:
    expect_code(Code.NOT_FOUND, _session_calls(stub)[method], session_id)


def test_a_closed_session_is_not_found(
    sidecar: SidecarProcess, stub: pb_grpc.SidecarStub, control: Session, quiet: dict[str, float]
) -> None:
    session = open_session(stub)
    grants = acquire(stub, session, 2)
    assert len(grants) == 2
    assert gauges(stub, control)["leases"] == 2
    session.close()

    def gone() -> grpc.StatusCode | None:
        try:
            found(stub, session, session.key())
        except grpc.RpcError as error:
            return error.code()
        return None

    assert wait_for(gone, "the cancelled session to close") == Code.NOT_FOUND
    wait_for(lambda: gauges(stub, control)["leases"] == 0, "its leases to be released")
    for call in _session_calls(stub).values():
        expect_code(Code.NOT_FOUND, call, session.id)
    assert_no_slab_held(stub, control)
    assert_unharmed(sidecar)


BAD_NAMESPACES = {
    "num_layers-0": ({"num_layers": 0}, "num_layers"),
    "num_kv_heads-0": ({"num_kv_heads": 0}, "num_kv_heads"),
    "head_dim-0": ({"head_dim": 0}, "head_dim"),
    "head_dim-huge": ({"head_dim": (1 << 20) + 1}, "head_dim"),
    "chunk_size-0": ({"chunk_size": 0}, "chunk_size"),
    "chunk_size-7": ({"chunk_size": 7}, "chunk_size"),
    "chunk_size-24": ({"chunk_size": 24}, "chunk_size"),
    "chunk_size-max": ({"chunk_size": 2**32 - 16}, ""),
    "tp_rank-eq-size": ({"tp_size": 2, "tp_rank": 2}, "tp_rank"),
    "tp_rank-no-size": ({"tp_rank": 1}, "tp_rank"),
    "dtype-unknown": ({"kv_dtype": "float64"}, "dtype"),
    "dtype-garbage": ({"kv_dtype": "torch.float32; rm -rf"}, "dtype"),
    "layout-unknown": ({"kv_layout": "THLKD"}, "layout"),
    "layout-ltd-heads": ({"kv_layout": "LTD", "num_kv_heads": 2}, "LTD"),
    "paged-no-block-size": ({"kv_layout": "LBHSC"}, "block_size"),
    "paged-block-not-dividing": ({"kv_layout": "LBSHC", "kv_block_size": 6}, "divide"),
    "paged-block-huge": ({"kv_layout": "LBHSC", "kv_block_size": 2**32 - 1}, "divide"),
    "block-size-of-a-token-layout": ({"kv_block_size": 16}, "block_size"),
    "model_id-empty": ({"model_id": ""}, "model_id"),
    "model_id-blank": ({"model_id": "  \t"}, "model_id"),
    "chunk-over-slab": ({"chunk_size": 256}, "slab"),
    "dims-over-slab": ({"num_layers": 1 << 20, "num_kv_heads": 1 << 20, "head_dim": 1 << 20}, ""),
}


@pytest.mark.parametrize(
    ("changes", "words"), list(BAD_NAMESPACES.values()), ids=list(BAD_NAMESPACES)
)
def test_bad_namespaces_are_invalid(
    sidecar: SidecarProcess,
    stub: pb_grpc.SidecarStub,
    control: Session,
    quiet: dict[str, float],
    changes: dict[str, Any],
    words: str,
) -> None:
    details = expect_open_refused(Code.INVALID_ARGUMENT, stub, namespace(**changes))
    assert words in details
    assert gauges(stub, control)["sessions"] == 1
    assert_unharmed(sidecar)


def test_max_sessions_is_resource_exhausted(
    sidecar: SidecarProcess, stub: pb_grpc.SidecarStub, control: Session, quiet: dict[str, float]
) -> None:
    sessions = [open_session(stub) for _ in range(MAX_SESSIONS - 1)]  # + control
    try:
        expect_open_refused(Code.RESOURCE_EXHAUSTED, stub, namespace())
        sessions.pop().close()
        wait_for(lambda: gauges(stub, control)["sessions"] < MAX_SESSIONS, "a session to close")
        sessions.append(open_session(stub))
    finally:
        for session in sessions:
            session.close()
    assert_unharmed_when_quiet(sidecar, stub, control)


def test_shared_memory_calls_on_a_streaming_session_are_failed_precondition(
    sidecar: SidecarProcess, stub: pb_grpc.SidecarStub, control: Session
) -> None:
    with open_session(stub, shared_memory=False) as session:
        assert not session.info.HasField("shm")
        details = expect_code(
            Code.FAILED_PRECONDITION,
            stub.Load,
            pb.LoadRequest(session_id=session.id, keys=session.key()),
        )
        assert "LoadStream" in details
        details = expect_code(
            Code.FAILED_PRECONDITION,
            stub.AcquireSlabs,
            pb.AcquireSlabsRequest(session_id=session.id, count=1),
        )
        assert "StoreStream" in details
        assert gauges(stub, control)["leases"] == 0
    assert_unharmed(sidecar)


# --- AcquireSlabs, Commit and Release ---------------------------------------------------


def test_acquire_when_every_slab_is_held_is_resource_exhausted(
    sidecar: SidecarProcess, stub: pb_grpc.SidecarStub, control: Session, quiet: dict[str, float]
) -> None:
    with open_session(stub) as first, open_session(stub, shared_memory=False) as streaming:
        held = acquire(stub, first, 10**6)  # capped at the pool's size
        assert len(held) == NUM_SLABS
        assert len({g.slab for g in held}) == NUM_SLABS
        assert gauges(stub, control)["slabs_in_use"] == NUM_SLABS
        details = expect_code(
            Code.RESOURCE_EXHAUSTED,
            stub.AcquireSlabs,
            pb.AcquireSlabsRequest(session_id=control.id, count=1),
        )
        assert "no free slab" in details
        assert acquire(stub, control, 0) == []
        # A streamed store with no slab free is a drop, not an error.
        key = streaming.key()
        reply = store_stream(stub, streaming, [(key, chunk_for(key))])
        assert (reply.stored, reply.dropped) == (0, 1)
        assert gauges(stub, control)["leases"] == NUM_SLABS
        # Releasing in the same call hands the slabs on at once.
        again = stub.AcquireSlabs(
            pb.AcquireSlabsRequest(
                session_id=first.id, count=2, release=[g.lease for g in held[:2]]
            ),
            timeout=CALL_TIMEOUT_S,
        ).slabs
        assert len(again) == 2
        release(stub, first, [g.lease for g in held[2:]] + [g.lease for g in again])
        assert gauges(stub, control)["leases"] == 0
    assert_no_slab_held(stub, control)
    assert_unharmed(sidecar)


def test_release_of_unknown_leases_is_ignored(
    sidecar: SidecarProcess,
    stub: pb_grpc.SidecarStub,
    control: Session,
    region: SharedRegion,
    quiet: dict[str, float],
) -> None:
    with open_session(stub) as owner, open_session(stub) as other:
        grants = acquire(stub, owner, 1)
        assert len(grants) == 1
        release(stub, owner, [0, grants[0].lease + 1, 12345, 2**64 - 1])
        release(stub, owner, [])
        # Lease ids are per session: another session cannot end this one's lease.
        release(stub, other, [grants[0].lease])
        assert gauges(stub, control)["leases"] == 1
        key = owner.key()
        data = chunk_for(key)
        write_slab(region, owner, grants[0].slab, data)
        committed = pb.CommittedSlab(lease=grants[0].lease, key=key, length=len(data))
        reply = stub.Commit(
            pb.CommitRequest(session_id=owner.id, chunks=[committed]), timeout=CALL_TIMEOUT_S
        )
        assert reply.stored == 1
        release(stub, owner, [grants[0].lease])  # already committed: ignored too
        assert found(stub, owner, key) == 1
        assert gauges(stub, control)["leases"] == 0
    assert_unharmed(sidecar)


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]


def _bad_prefix(data: bytes, **fields: int) -> bytes:
    magic, version, flags, header_len, reserved, checksum = PREFIX.unpack_from(data)
    values = {
        "version": version,
        "flags": flags,
        "header_len": header_len,
        "reserved": reserved,
        "checksum": checksum,
        **fields,
    }
    return PREFIX.pack(magic, *values.values()) + data[PREFIX_LEN:]


# Each case: (slab content from a valid chunk of key, the CommittedSlab from the lease,
# key and valid chunk) and the code its commit must get.
CommitCase = Callable[[Session, int, bytes, bytes], tuple[bytes, pb.CommittedSlab]]


def _case(
    content: Callable[[bytes, bytes, Session], bytes] = lambda data, key, s: data,
    lease: Callable[[int], int] = lambda lease: lease,
    key: Callable[[bytes, Session], bytes] = lambda key, s: key,
    length: Callable[[int], int] = lambda n: n,
) -> CommitCase:
    def build(s: Session, granted: int, k: bytes, data: bytes) -> tuple[bytes, pb.CommittedSlab]:
        written = content(data, k, s)
        return written, pb.CommittedSlab(
            lease=lease(granted), key=key(k, s), length=length(len(data))
        )

    return build


COMMIT_CASES: dict[str, tuple[CommitCase, grpc.StatusCode]] = {
    "unknown-lease": (_case(lease=lambda lease: lease + 1000), Code.INVALID_ARGUMENT),
    "lease-zero": (_case(lease=lambda lease: 0), Code.INVALID_ARGUMENT),
    "key-of-another-namespace": (
        _case(key=lambda k, s: secrets.token_bytes(16) + k[16:]),
        Code.PERMISSION_DENIED,
    ),
    "key-short": (_case(key=lambda k, s: k[:31]), Code.INVALID_ARGUMENT),
    "key-long": (_case(key=lambda k, s: k + b"x"), Code.INVALID_ARGUMENT),
    "key-empty": (_case(key=lambda k, s: b""), Code.INVALID_ARGUMENT),
    "key-not-the-chunks": (_case(key=lambda k, s: s.key()), Code.INVALID_ARGUMENT),
    "random-bytes": (
        _case(content=lambda d, k, s: secrets.token_bytes(len(d))),
        Code.INVALID_ARGUMENT,
    ),
    "zeros": (_case(content=lambda d, k, s: bytes(len(d))), Code.INVALID_ARGUMENT),
    "length-over-slab": (_case(length=lambda n: SLAB_BYTES + 1), Code.INVALID_ARGUMENT),
    "length-huge": (_case(length=lambda n: 2**64 - 1), Code.INVALID_ARGUMENT),
    "length-zero": (_case(length=lambda n: 0), Code.INVALID_ARGUMENT),
    "length-truncated": (_case(length=lambda n: n - 1), Code.INVALID_ARGUMENT),
    "length-prefix-only": (_case(length=lambda n: PREFIX_LEN), Code.INVALID_ARGUMENT),
    "flipped-header-byte": (
        _case(content=lambda d, k, s: _flip(d, PREFIX_LEN + 3)),
        Code.INVALID_ARGUMENT,
    ),
    "bad-version": (
        _case(content=lambda d, k, s: _bad_prefix(d, version=99)),
        Code.INVALID_ARGUMENT,
    ),
    "header-len-huge": (
        _case(content=lambda d, k, s: _bad_prefix(d, header_len=2**32 - 1)),
        Code.INVALID_ARGUMENT,
    ),
    "header-len-zero": (
        _case(content=lambda d, k, s: _bad_prefix(d, header_len=0)),
        Code.INVALID_ARGUMENT,
    ),
    "wrong-geometry": (
        _case(content=lambda d, k, s: chunk_for(k, hidden=32)),
        Code.INVALID_ARGUMENT,
    ),
}


@pytest.mark.parametrize(("case", "code"), list(COMMIT_CASES.values()), ids=list(COMMIT_CASES))
def test_bad_commits_are_refused_and_end_their_leases(
    sidecar: SidecarProcess,
    stub: pb_grpc.SidecarStub,
    control: Session,
    region: SharedRegion,
    quiet: dict[str, float],
    case: CommitCase,
    code: grpc.StatusCode,
) -> None:
    with open_session(stub) as session:
        good_grant, bad_grant = acquire(stub, session, 2)
        good_key, bad_key = session.key(), session.key()
        good = chunk_for(good_key)
        content, bad = case(session, bad_grant.lease, bad_key, chunk_for(bad_key))
        write_slab(region, session, good_grant.slab, good)
        write_slab(region, session, bad_grant.slab, content)
        chunks = [pb.CommittedSlab(lease=good_grant.lease, key=good_key, length=len(good)), bad]
        expect_code(code, stub.Commit, pb.CommitRequest(session_id=session.id, chunks=chunks))
        # Every lease the commit named ended either way (a lease it did not name, when
        # it named an unknown one, is still held); nothing of the batch was stored.
        unnamed = [] if bad.lease == bad_grant.lease else [bad_grant.lease]
        assert gauges(stub, control)["leases"] == len(unnamed)
        release(stub, session, unnamed)
        assert gauges(stub, control)["leases"] == 0
        assert found(stub, session, good_key) == 0
        expect_code(
            Code.INVALID_ARGUMENT,
            stub.Commit,
            pb.CommitRequest(session_id=session.id, chunks=chunks[:1]),
        )
        assert gauges(stub, control)["slabs_in_use"] == quiet["slabs_in_use"]
        # The session still works: a good commit is stored.
        (grant,) = acquire(stub, session, 1)
        write_slab(region, session, grant.slab, good)
        reply = stub.Commit(
            pb.CommitRequest(
                session_id=session.id,
                chunks=[pb.CommittedSlab(lease=grant.lease, key=good_key, length=len(good))],
            ),
            timeout=CALL_TIMEOUT_S,
        )
        assert (reply.stored, reply.dropped) == (1, 0)
        assert found(stub, session, good_key) == 1
    assert_no_slab_held(stub, control)
    assert_unharmed(sidecar)


def test_commits_of_leases_not_acquired_for_writing_are_refused(
    sidecar: SidecarProcess,
    stub: pb_grpc.SidecarStub,
    control: Session,
    region: SharedRegion,
    quiet: dict[str, float],
) -> None:
    with open_session(stub) as session, open_session(stub) as other:
        key = session.key()
        data = chunk_for(key, seed=1)
        assert store_stream(stub, session, [(key, data)]).stored == 1
        loaded = stub.Load(pb.LoadRequest(session_id=session.id, keys=key), timeout=CALL_TIMEOUT_S)
        (item,) = loaded.chunks
        # A loaded (read-only) slab cannot be committed over.
        commit = pb.CommittedSlab(lease=item.lease, key=key, length=item.length)
        expect_code(
            Code.INVALID_ARGUMENT,
            stub.Commit,
            pb.CommitRequest(session_id=session.id, chunks=[commit]),
        )
        # Another session's lease id is not this session's lease.
        (grant,) = acquire(stub, session, 1)
        write_slab(region, session, grant.slab, data)
        stolen = pb.CommittedSlab(lease=grant.lease, key=key, length=len(data))
        expect_code(
            Code.INVALID_ARGUMENT,
            stub.Commit,
            pb.CommitRequest(session_id=other.id, chunks=[stolen]),
        )
        # The same lease twice in one batch.
        expect_code(
            Code.INVALID_ARGUMENT,
            stub.Commit,
            pb.CommitRequest(session_id=session.id, chunks=[stolen, stolen]),
        )
        assert gauges(stub, control)["leases"] == 1  # the loaded slab's lease, still held
        release(stub, session, [item.lease])
        assert gauges(stub, control)["leases"] == 0
    assert_no_slab_held(stub, control)
    assert_unharmed(sidecar)


# --- StoreStream -----------------------------------------------------------------------


def _stream_cases(s: Session) -> dict[str, tuple[list[pb.ChunkPiece], grpc.StatusCode]]:
    key = s.key()
    data = chunk_for(key)
    whole = list(pieces(s.id, [(key, data)], piece_bytes=2048))
    first = whole[0]

    def piece(**fields: Any) -> pb.ChunkPiece:
        out = pb.ChunkPiece()
        out.CopyFrom(first)
        for name, value in fields.items():
            setattr(out, name, value)
        return out

    tail = pb.ChunkPiece(offset=2048, data=data[2048:])
    return {
        "first-piece-without-key": ([piece(key=b"")], Code.INVALID_ARGUMENT),
        "first-piece-not-at-zero": ([piece(offset=1)], Code.INVALID_ARGUMENT),
        "out-of-order": ([first, whole[2], whole[1], *whole[3:]], Code.INVALID_ARGUMENT),
        "piece-repeated": ([first, whole[1], whole[1], *whole[2:]], Code.INVALID_ARGUMENT),
        "gap": ([first, *whole[2:]], Code.INVALID_ARGUMENT),
        "piece-beyond-total-length": (
            [first, pb.ChunkPiece(offset=2048, data=data[2048:] + b"x")],
            Code.INVALID_ARGUMENT,
        ),
        "piece-far-beyond": (
            [first, pb.ChunkPiece(offset=2**40, data=b"x")],
            Code.INVALID_ARGUMENT,
        ),
        "ends-inside-a-chunk": (whole[:-1], Code.INVALID_ARGUMENT),
        "ends-after-first-piece": ([first], Code.INVALID_ARGUMENT),
        "total-length-zero": ([piece(total_length=0, data=b"")], Code.INVALID_ARGUMENT),
        "total-length-over-slab": ([piece(total_length=SLAB_BYTES + 1)], Code.INVALID_ARGUMENT),
        "total-length-huge": ([piece(total_length=2**64 - 1)], Code.INVALID_ARGUMENT),
        "key-of-another-namespace": (
            [piece(key=secrets.token_bytes(16) + key[16:]), tail],
            Code.PERMISSION_DENIED,
        ),
        "key-short": ([piece(key=key[:31]), tail], Code.INVALID_ARGUMENT),
        "key-not-the-chunks": ([piece(key=s.key()), tail], Code.INVALID_ARGUMENT),
        "garbage-chunk": (
            [piece(data=secrets.token_bytes(2048)), tail],
            Code.INVALID_ARGUMENT,
        ),
    }


STREAM_CASES = list(_stream_cases(Session(None, pb.SessionInfo(namespace_digest=bytes(16)), ())))


@pytest.mark.parametrize("case", STREAM_CASES)
@pytest.mark.parametrize("shared_memory", [False, True], ids=["streaming", "shm-session"])
def test_bad_store_streams_are_refused_without_leaking_a_slab(
    sidecar: SidecarProcess,
    stub: pb_grpc.SidecarStub,
    control: Session,
    quiet: dict[str, float],
    case: str,
    shared_memory: bool,
) -> None:
    with open_session(stub, shared_memory=shared_memory) as session:
        messages, code = _stream_cases(session)[case]
        expect_code(code, stub.StoreStream, iter(messages))
        after = gauges(stub, control)
        assert after["slabs_in_use"] == quiet["slabs_in_use"]
        assert after["leases"] == 0
        # The session still stores.
        key = session.key()
        assert store_stream(stub, session, [(key, chunk_for(key))]).stored == 1
        assert found(stub, session, key) == 1
    assert_no_slab_held(stub, control)
    assert_unharmed(sidecar)


def test_a_store_stream_cancelled_mid_chunk_gives_its_slab_back(
    sidecar: SidecarProcess, stub: pb_grpc.SidecarStub, control: Session, quiet: dict[str, float]
) -> None:
    assert_no_slab_held(stub, control)  # the cache is empty now: slabs_in_use is 0
    with open_session(stub, shared_memory=False) as session:
        key = session.key()
        data = chunk_for(key)
        hold = threading.Event()

        def messages() -> Iterator[pb.ChunkPiece]:
            yield next(pieces(session.id, [(key, data)], piece_bytes=2048))
            hold.wait(CALL_TIMEOUT_S)  # the client hangs inside the chunk

        future = stub.StoreStream.future(messages(), timeout=CALL_TIMEOUT_S)
        try:
            wait_for(
                lambda: gauges(stub, control)["slabs_in_use"] == 1,
                "the stream to take a slab",
            )
            future.cancel()
        finally:
            hold.set()
        wait_for(
            lambda: gauges(stub, control)["slabs_in_use"] == 0,
            "the cancelled stream's slab to come back",
        )
        assert found(stub, session, key) == 0
    assert_no_slab_held(stub, control)
    assert_unharmed(sidecar)


def test_a_session_that_ends_releases_its_leases(
    sidecar: SidecarProcess, stub: pb_grpc.SidecarStub, control: Session, quiet: dict[str, float]
) -> None:
    session = open_session(stub)
    assert len(acquire(stub, session, 3)) == 3
    assert gauges(stub, control)["leases"] == 3
    session.close()
    wait_for(lambda: gauges(stub, control)["leases"] == 0, "the closed session's leases to end")
    assert_no_slab_held(stub, control)
    assert_unharmed(sidecar)


def test_load_with_lies_in_its_lookup_spans(
    sidecar: SidecarProcess, stub: pb_grpc.SidecarStub, control: Session, quiet: dict[str, float]
) -> None:
    """The spans a client passes back to Load are hints: spans that are malformed, or
    that claim chunks a tier does not hold, cost a miss, never an error or a slab."""
    with open_session(stub) as session:
        stored, missing = session.key(), session.key()
        assert store_stream(stub, session, [(stored, chunk_for(stored))]).stored == 1
        lies = [
            [pb.TierSpan(tier="cpu", start=0, stop=10**6)],
            [pb.TierSpan(tier="nowhere", start=0, stop=2)],
            [pb.TierSpan(tier="cpu", start=1, stop=2)],
            [pb.TierSpan(tier="cpu", start=0, stop=2)],  # the second is not there
            [pb.TierSpan(tier="cpu", start=0, stop=1), pb.TierSpan(tier="cpu", start=0, stop=2)],
        ]
        for spans in lies:
            reply = stub.Load(
                pb.LoadRequest(session_id=session.id, keys=stored + missing, lookup=spans),
                timeout=CALL_TIMEOUT_S,
            )
            assert len(reply.chunks) <= 1
            release(stub, session, [c.lease for c in reply.chunks])
        reply = stub.Load(
            pb.LoadRequest(
                session_id=session.id,
                keys=missing + stored,
                lookup=[pb.TierSpan(tier="cpu", start=0, stop=2)],
            ),
            timeout=CALL_TIMEOUT_S,
        )
        assert list(reply.chunks) == []
        assert gauges(stub, control)["leases"] == 0
    assert_no_slab_held(stub, control)
    assert_unharmed(sidecar)


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), -1.0, 1e300, 1e-9], ids=str)
def test_flush_with_odd_timeouts(
    sidecar: SidecarProcess, stub: pb_grpc.SidecarStub, control: Session, timeout_s: float
) -> None:
    reply = stub.Flush(
        pb.FlushRequest(session_id=control.id, timeout_s=timeout_s), timeout=CALL_TIMEOUT_S
    )
    assert reply.done in (True, False)
    assert_unharmed(sidecar)


# --- streams that stall ----------------------------------------------------------------
@pytest.mark.slow  # a real timer: the lease's ttl
def test_stalled_streams_hold_slabs_no_longer_than_a_lease(tmp_path: Path) -> None:
    """A LoadStream reader that stops reading, and a StoreStream writer that stops
    mid-chunk, keep the stream open but not the slabs: they come back after
    ``lease_ttl_s`` as a lease's would (the load ends there; the chunk is dropped)."""
    # Eight chunks of 512 KiB: far more than grpc's flow control lets through unread
    # (a load names each chunk once).
    settings = {
        "cpu": {"capacity_bytes": "4160KiB", "staging_bytes": "1040KiB"},
        "sidecar": {**SETTINGS["sidecar"], "slab_bytes": "520KiB", "lease_ttl_s": 2},
    }
    wide = namespace(head_dim=4096)
    with (
        SidecarProcess(tmp_path, settings) as process,
        grpc.insecure_channel(process.target) as channel,
    ):
        stub = pb_grpc.SidecarStub(channel)
        with (
            open_session(stub, wide, client_name="control") as control,
            open_session(stub, wide, shared_memory=False) as session,
        ):
            num_slabs = control.info.shm.num_slabs
            keys = [session.key() for _ in range(8)]
            stored = [(key, chunk_for(key, seed=i, hidden=4096)) for i, key in enumerate(keys)]
            assert store_stream(stub, session, stored).stored == 8

            def all_slabs_free() -> bool:
                grants = acquire(stub, control, num_slabs)
                release(stub, control, [grant.lease for grant in grants])
                return len(grants) == num_slabs

            load = stub.LoadStream(pb.LoadRequest(session_id=session.id, keys=b"".join(keys)))
            next(load)  # then stall
            wait_for(all_slabs_free, "the stalled load's slabs to be reclaimed")
            load.cancel()

            go_on = threading.Event()
            key, data = stored[0]

            def stalling() -> Iterator[pb.ChunkPiece]:
                first, *rest = pieces(session.id, [(key, data)], piece_bytes=len(data) // 2)
                yield first
                go_on.wait(timeout=60)
                yield from rest

            purge = pb.PurgeRequest(session_id=session.id)
            stub.Purge(purge, metadata=session.metadata, timeout=CALL_TIMEOUT_S)
            base = gauges(stub, control)["slabs_in_use"]
            answer = stub.StoreStream.future(stalling(), timeout=60)
            in_use = lambda: gauges(stub, control)["slabs_in_use"]  # noqa: E731
            wait_for(lambda: in_use() == base + 1, "the store to take a slab")
            wait_for(lambda: in_use() == base, "the stalled store's slab to be reclaimed")
            go_on.set()
            reply = answer.result()
            assert (reply.stored, reply.dropped) == (0, 1)
            assert found(stub, session, key) == 0
        assert "Traceback" not in process.log()
        assert_unharmed(process)
