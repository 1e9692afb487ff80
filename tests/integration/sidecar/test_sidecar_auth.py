"""Who may talk to a real ``lmtier serve`` process, and over what.

* Tokens: a sidecar with ``sidecar.auth_token`` and a ``tokens_file`` of two tenants
  (run at ``--log-level DEBUG``) refuses calls without the right bearer token
  (UNAUTHENTICATED), keeps each token's sessions to it (NOT_FOUND for another's),
  keeps a tenant to its models and salts (PERMISSION_DENIED), keeps tenants' chunks
  apart, and never writes a token to its log.
* Listeners: a TCP port 0 listener says which port it bound; a listener other
  machines can reach needs ``allow_remote`` and a token, or the process exits with a
  one-line message; so does a loopback TCP listener without a token (unless
  ``allow_tcp_without_token``, logged), and another local user (``nobody``, a real
  second uid) reads nothing of a loopback sidecar's KV; with TLS, raw stubs and
  ``lmtier.connect`` work over TCP (streamed, bit-exact).
"""

from __future__ import annotations

import json
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import yaml

import lmtier
from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.errors import AuthenticationError, PermissionDeniedError
from lmtier.ops.stats import schema_problems
from lmtier.testing.sidecar import SidecarProcess
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.v1 import sidecar_pb2_grpc as pb_grpc
from lmtier.wire.credentials import channel_credentials
from support.other_user import NOBODY, OtherUser, other_user
from support.sidecar_helpers import (
    CALL_TIMEOUT_S,
    NAMESPACE,
    TENANT_MODEL,
    Metadata,
    Session,
    TcpSidecar,
    assert_unharmed,
    bearer,
    chunk_for,
    expect_code,
    gauges,
    health_status,
    make_self_signed,
    namespace,
    open_session,
    pieces,
    run_lmtier,
    store_stream,
    tenant,
    wait_for,
    write_tokens,
)

pytestmark = pytest.mark.integration

Code = grpc.StatusCode
ADMIN = "admin-" + secrets.token_hex(16)
TENANT_A = "tenant-a-" + secrets.token_hex(16)
TENANT_B = "tenant-b-" + secrets.token_hex(16)
REPLICA_1 = "replica-1-" + secrets.token_hex(16)
REPLICA_2 = "replica-2-" + secrets.token_hex(16)
WRONG = "wrong-" + secrets.token_hex(16)
"""Tokens are random per run, so that finding one in a log is never a coincidence."""
MODEL = TENANT_MODEL
HUGE = {"num_layers": 1 << 20, "num_kv_heads": 1 << 20, "head_dim": 1 << 20}
SMALL = {
    "cpu": {"capacity_bytes": "64KiB", "staging_bytes": "32KiB"},
    "sidecar": {"slab_bytes": "16KiB"},
}


def settings(**sidecar: Any) -> dict[str, Any]:
    return {"cpu": dict(SMALL["cpu"]), "sidecar": {**SMALL["sidecar"], **sidecar}}


# --- a sidecar with tokens -------------------------------------------------------------


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    folder = tmp_path_factory.mktemp("secured")
    tokens = write_tokens(
        folder,
        [
            {"token": TENANT_A, "name": "tenant-a", "models": [MODEL], "salts": ["salt-a"]},
            {"token": TENANT_B, "name": "tenant-b", "models": [MODEL], "salts": ["salt-b"]},
            # Two tokens of one service (same name, same scope), e.g. two replicas.
            {"token": REPLICA_1, "name": "replica", "models": [MODEL], "salts": ["salt-c"]},
            {"token": REPLICA_2, "name": "replica", "models": [MODEL], "salts": ["salt-c"]},
        ],
    )
    config = settings(auth_token=ADMIN, tokens_file=str(tokens))
    config["cpu"]["capacity_bytes"] = "128KiB"  # 10 slabs: 2 each for the 5 tokens
    with SidecarProcess(folder, config, args=["--log-level", "DEBUG"]) as process:
        yield process


@pytest.fixture(scope="module")
def stub(secured: SidecarProcess) -> Iterator[pb_grpc.SidecarStub]:
    with grpc.insecure_channel(secured.target) as channel:
        yield pb_grpc.SidecarStub(channel)


@pytest.fixture(scope="module")
def admin(stub: pb_grpc.SidecarStub) -> Iterator[Session]:
    with open_session(stub, metadata=bearer(ADMIN), client_name="admin") as session:
        yield session


BAD_METADATA: dict[str, Metadata] = {
    "none": (),
    "wrong-token": bearer(WRONG),
    "token-prefix": bearer(ADMIN[:-1]),
    "token-longer": bearer(ADMIN + "x"),
    "basic-scheme": (("authorization", f"Basic {ADMIN}"),),
    "no-scheme": (("authorization", ADMIN),),
    "bearer-only": (("authorization", "Bearer"),),
    "two-entries": (*bearer(WRONG), *bearer(ADMIN)),
    "other-header": (("x-api-key", ADMIN),),
}


def _calls(stub: pb_grpc.SidecarStub, session_id: bytes) -> dict[str, Any]:
    """Each method, as ``call(metadata)``, on ``session_id``."""
    key = bytes(32)
    return {
        "OpenSession": lambda md: next(
            stub.OpenSession(
                pb.OpenSessionRequest(namespace=namespace()), metadata=md, timeout=CALL_TIMEOUT_S
            )
        ),
        "Lookup": lambda md: stub.Lookup(
            pb.LookupRequest(session_id=session_id, keys=key), metadata=md, timeout=CALL_TIMEOUT_S
        ),
        "Load": lambda md: stub.Load(
            pb.LoadRequest(session_id=session_id, keys=key), metadata=md, timeout=CALL_TIMEOUT_S
        ),
        "LoadStream": lambda md: list(
            stub.LoadStream(
                pb.LoadRequest(session_id=session_id, keys=key),
                metadata=md,
                timeout=CALL_TIMEOUT_S,
            )
        ),
        "AcquireSlabs": lambda md: stub.AcquireSlabs(
            pb.AcquireSlabsRequest(session_id=session_id, count=1),
            metadata=md,
            timeout=CALL_TIMEOUT_S,
        ),
        "Commit": lambda md: stub.Commit(
            pb.CommitRequest(session_id=session_id), metadata=md, timeout=CALL_TIMEOUT_S
        ),
        "StoreStream": lambda md: stub.StoreStream(
            iter([pb.ChunkPiece(session_id=session_id)]), metadata=md, timeout=CALL_TIMEOUT_S
        ),
        "Release": lambda md: stub.Release(
            pb.ReleaseRequest(session_id=session_id, leases=[1]),
            metadata=md,
            timeout=CALL_TIMEOUT_S,
        ),
        "Flush": lambda md: stub.Flush(
            pb.FlushRequest(session_id=session_id), metadata=md, timeout=CALL_TIMEOUT_S
        ),
        "Stats": lambda md: stub.Stats(
            pb.StatsRequest(session_id=session_id), metadata=md, timeout=CALL_TIMEOUT_S
        ),
        "Purge": lambda md: stub.Purge(
            pb.PurgeRequest(session_id=session_id), metadata=md, timeout=CALL_TIMEOUT_S
        ),
    }


METHODS = [
    "OpenSession",
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
]


@pytest.mark.parametrize("metadata", list(BAD_METADATA.values()), ids=list(BAD_METADATA))
@pytest.mark.parametrize("method", METHODS)
def test_calls_without_the_right_token_are_unauthenticated(
    stub: pb_grpc.SidecarStub, admin: Session, method: str, metadata: Metadata
) -> None:
    details = expect_code(Code.UNAUTHENTICATED, _calls(stub, admin.id)[method], metadata)
    for token in (ADMIN, WRONG):
        assert token[-12:] not in details


def test_the_right_tokens_are_accepted(secured: SidecarProcess, stub: pb_grpc.SidecarStub) -> None:
    for metadata in (bearer(ADMIN), (("authorization", f"bearer   {ADMIN} "),)):
        assert_unharmed(secured, metadata=metadata)
    with tenant(stub, TENANT_A, "salt-a") as a, tenant(stub, TENANT_B, "salt-b") as b:
        assert gauges(stub, a)["sessions"] >= 2
        assert gauges(stub, b)["sessions"] >= 2
    # The health service answers without a token (probes have none); it says no more
    # than SERVING.
    assert health_status(secured.target) == 1


@pytest.mark.parametrize("method", METHODS[1:])
def test_a_session_of_another_token_is_not_found(
    stub: pb_grpc.SidecarStub, admin: Session, method: str
) -> None:
    with tenant(stub, TENANT_A, "salt-a") as a:
        calls = _calls(stub, admin.id)
        expect_code(Code.NOT_FOUND, calls[method], bearer(TENANT_A))
        expect_code(Code.NOT_FOUND, _calls(stub, a.id)[method], bearer(TENANT_B))
        expect_code(Code.NOT_FOUND, _calls(stub, a.id)[method], bearer(ADMIN))


def test_tokens_with_one_name_and_scope_do_not_share_sessions(
    stub: pb_grpc.SidecarStub,
) -> None:
    """A session belongs to the token that opened it, not to a name that two
    tokens_file entries happen to share."""
    with tenant(stub, REPLICA_1, "salt-c") as first:
        for method in ("Stats", "AcquireSlabs", "Release", "Purge"):
            expect_code(Code.NOT_FOUND, _calls(stub, first.id)[method], bearer(REPLICA_2))


def test_another_token_cannot_end_a_sessions_leases(
    stub: pb_grpc.SidecarStub, admin: Session
) -> None:
    with open_session(stub, metadata=bearer(ADMIN)) as a:
        grants = stub.AcquireSlabs(
            pb.AcquireSlabsRequest(session_id=a.id, count=2),
            metadata=a.metadata,
            timeout=CALL_TIMEOUT_S,
        ).slabs
        assert len(grants) == 2
        leases = [g.lease for g in grants]
        for token in (TENANT_A, TENANT_B):
            expect_code(
                Code.NOT_FOUND,
                stub.Release,
                pb.ReleaseRequest(session_id=a.id, leases=leases),
                metadata=bearer(token),
            )
        assert gauges(stub, a)["leases"] == 2
        stub.Release(
            pb.ReleaseRequest(session_id=a.id, leases=leases),
            metadata=a.metadata,
            timeout=CALL_TIMEOUT_S,
        )
        assert gauges(stub, a)["leases"] == 0


def test_only_a_token_of_every_namespace_is_handed_the_shared_pool(
    stub: pb_grpc.SidecarStub, admin: Session
) -> None:
    """The pool holds every tenant's chunks: a scoped token that asks for shared memory
    gets a streaming session (its KV moves over gRPC), never the pool's mapping."""
    assert admin.info.HasField("shm") and admin.info.lane
    with tenant(stub, TENANT_A, "salt-a", shared_memory=True) as a:
        assert not a.info.HasField("shm") and not a.info.lane
        for call, request in (
            (stub.AcquireSlabs, pb.AcquireSlabsRequest(session_id=a.id, count=1)),
            (stub.Load, pb.LoadRequest(session_id=a.id, keys=bytes(32))),
        ):
            expect_code(Code.FAILED_PRECONDITION, call, request, metadata=a.metadata)
        key = a.key()
        assert store_stream(stub, a, [(key, chunk_for(key))]).stored == 1


SCOPES = {
    "other-tenants-salt": (TENANT_A, MODEL, "salt-b"),
    "no-salt": (TENANT_A, MODEL, ""),
    "other-model": (TENANT_A, "other/model", "salt-a"),
    "b-with-as-salt": (TENANT_B, MODEL, "salt-a"),
}


@pytest.mark.parametrize(("token", "model", "salt"), list(SCOPES.values()), ids=list(SCOPES))
def test_scoped_tokens_cannot_open_other_namespaces(
    secured: SidecarProcess, stub: pb_grpc.SidecarStub, token: str, model: str, salt: str
) -> None:
    call = stub.OpenSession(
        pb.OpenSessionRequest(namespace=namespace(model_id=model, cache_salt=salt)),
        metadata=bearer(token),
        timeout=CALL_TIMEOUT_S,
    )
    details = expect_code(Code.PERMISSION_DENIED, lambda: next(call))
    assert token[-12:] not in details
    own = "salt-a" if token == TENANT_A else "salt-b"
    assert_unharmed(
        secured, metadata=bearer(token), space=namespace(model_id=MODEL, cache_salt=own)
    )


def test_tenants_cannot_reach_each_others_chunks(
    secured: SidecarProcess, stub: pb_grpc.SidecarStub
) -> None:
    tokens = pb.TokenIds(ids=list(range(1000, 1048)))  # three chunks of 16
    with (
        tenant(stub, TENANT_B, "salt-b", shared_memory=False) as b,
        tenant(stub, TENANT_A, "salt-a") as a,
    ):
        keys_b = stub.Lookup(
            pb.LookupRequest(session_id=b.id, tokens=tokens), metadata=b.metadata
        ).keys
        chunks = [(keys_b[i : i + 32], chunk_for(keys_b[i : i + 32], seed=i)) for i in (0, 32, 64)]
        assert store_stream(stub, b, chunks).stored == 3
        reply = stub.Lookup(pb.LookupRequest(session_id=b.id, keys=keys_b), metadata=b.metadata)
        assert reply.num_chunks == 3

        # The same prompt under A's salt is other keys, none cached.
        reply = stub.Lookup(pb.LookupRequest(session_id=a.id, tokens=tokens), metadata=a.metadata)
        assert reply.num_chunks == 0
        assert reply.keys != keys_b
        # B's keys through A's session: refused, whichever call carries them (A's
        # scoped token has no shared memory: the pool holds B's chunks too).
        for call, request in [
            (stub.Lookup, pb.LookupRequest(session_id=a.id, keys=keys_b)),
            (stub.LoadStream, pb.LoadRequest(session_id=a.id, keys=keys_b)),
        ]:
            expect_code(Code.PERMISSION_DENIED, call, request, metadata=a.metadata)
        for call, request in [
            (stub.Load, pb.LoadRequest(session_id=a.id, keys=keys_b)),
            (stub.AcquireSlabs, pb.AcquireSlabsRequest(session_id=a.id, count=1)),
        ]:
            expect_code(Code.FAILED_PRECONDITION, call, request, metadata=a.metadata)
        # Nor can A overwrite or plant chunks under B's keys.
        planted = [(keys_b[:32], chunk_for(keys_b[:32], seed=99))]
        expect_code(
            Code.PERMISSION_DENIED,
            stub.StoreStream,
            pieces(a.id, planted),
            metadata=a.metadata,
        )
        # A's purge is of A's namespace only.
        stub.Purge(pb.PurgeRequest(session_id=a.id), metadata=a.metadata)
        # B still reads its own chunks, bit-exact.
        streamed = list(
            stub.LoadStream(pb.LoadRequest(session_id=b.id, keys=keys_b), metadata=b.metadata)
        )
        assert b"".join(p.data for p in streamed) == b"".join(data for _, data in chunks)
        assert gauges(stub, a)["leases"] == 0
    assert_unharmed(secured, metadata=bearer(ADMIN))


def test_tokens_never_reach_the_log(secured: SidecarProcess, stub: pb_grpc.SidecarStub) -> None:
    """At DEBUG, after successful calls, refused calls (wrong and malformed tokens,
    bad namespaces) and a failure inside the sidecar, the log holds none of the tokens."""
    with tenant(stub, TENANT_A, "salt-a") as a:
        stub.Lookup(pb.LookupRequest(session_id=a.id, keys=a.key()), metadata=a.metadata)
    for metadata in BAD_METADATA.values():
        with pytest.raises(grpc.RpcError):
            stub.Stats(pb.StatsRequest(session_id=b"x"), metadata=metadata, timeout=CALL_TIMEOUT_S)
    refused = [
        (ADMIN, namespace(model_id="")),  # INVALID_ARGUMENT
        (TENANT_B, namespace(model_id=MODEL, cache_salt="salt-a")),  # PERMISSION_DENIED
        # KV so large that sizing its chunk fails inside the sidecar (an INTERNAL error
        # and a logged traceback, until the sidecar refuses it as INVALID_ARGUMENT).
        (TENANT_A, namespace(model_id=MODEL, cache_salt="salt-a", **HUGE)),
    ]
    for token, space in refused:
        call = stub.OpenSession(
            pb.OpenSessionRequest(namespace=space), metadata=bearer(token), timeout=CALL_TIMEOUT_S
        )
        with pytest.raises(grpc.RpcError):
            next(call)
    # A marker logged after all of that: once it is in the file, so is all the above.
    marker = "log-marker-" + secrets.token_hex(8)
    with open_session(stub, metadata=bearer(ADMIN), client_name=marker):
        pass
    log = wait_for(lambda: marker in secured.log() and secured.log(), "the marker in the log")
    assert '"level": "DEBUG"' in log, "the sidecar did not log at DEBUG"
    for token in (ADMIN, TENANT_A, TENANT_B, REPLICA_1, REPLICA_2, WRONG):
        assert token not in log
        assert token[-12:] not in log


# --- a client whose token is scoped to one salt (lmtier.connect, lmtier ops) ---------

SCOPED_SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=64)
"""The geometry of :data:`sidecar_helpers.NAMESPACE`: 8 KiB chunks of 16 tokens, which
fit the sidecar's 16 KiB slabs."""
OPS_GEOMETRY = ["--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "64"]


def scoped_client(sidecar: SidecarProcess, token: str = TENANT_A) -> LMTier:
    config = LMTierConfig(chunk_size=16)
    return lmtier.connect(sidecar.target, config, kv=SCOPED_SPEC, model_id=MODEL, token=token)


def prompt(start: int, chunks: int) -> tuple[list[int], torch.Tensor]:
    tokens = list(range(start, start + 16 * chunks + 3))  # and a tail, never stored
    kv = torch.randn(SCOPED_SPEC.shape(len(tokens)), generator=torch.Generator().manual_seed(start))
    return tokens, kv


def assert_served(cache: LMTier, tokens: list[int], kv: torch.Tensor, chunks: int) -> None:
    """``tokens``' first ``chunks`` chunks are cached under salt-a and load bit-exact."""
    assert cache.lookup(tokens, cache_salt="salt-a").num_tokens == 16 * chunks
    with cache.load(tokens, cache_salt="salt-a") as hit:
        assert hit.num_tokens == 16 * chunks
        assert torch.equal(hit.kv(), kv[:, :, : 16 * chunks])


def test_a_client_scoped_to_one_salt_keeps_its_first_store(secured: SidecarProcess) -> None:
    """The sidecar refuses the unsalted namespace that ``lmtier.connect`` opens first:
    that refusal is no outage, so the store right after it is kept (it was lost to an
    open breaker), and flush and stats go through the session the store opened."""
    tokens, kv = prompt(20_000, 3)
    with scoped_client(secured) as cache:
        assert cache.store(tokens, kv, cache_salt="salt-a") == 3
        cache.flush()
        assert_served(cache, tokens, kv, 3)
        assert cache.stats()["sidecar"]["sessions"] >= 1


def test_a_salt_the_token_does_not_cover_is_an_error_for_that_call_only(
    secured: SidecarProcess,
) -> None:
    tokens, kv = prompt(21_000, 2)
    other, other_kv = prompt(22_000, 2)
    with scoped_client(secured) as cache:
        assert cache.store(tokens, kv, cache_salt="salt-a") == 2
        refused = {
            "lookup": lambda: cache.lookup(tokens, cache_salt="salt-b"),
            "load": lambda: cache.load(tokens, cache_salt="salt-b"),
            "store": lambda: cache.store(tokens, kv, cache_salt="salt-b"),
            "lookup_keys": lambda: cache.lookup_keys(cache.keys(tokens, cache_salt="salt-b")),
            "purge": lambda: cache.purge("salt-b"),
            "unsalted": lambda: cache.lookup(tokens),
        }
        for name, call in refused.items():
            with pytest.raises(PermissionDeniedError) as caught:
                call()
            message = str(caught.value)
            assert "tenant-a may not use model" in message, (name, message)
            assert "\n" not in message and TENANT_A[-12:] not in message
            # ...and the salt it covers is served as before, at once (no breaker).
            assert_served(cache, tokens, kv, 2)
        cache.flush()
        assert cache.store(other, other_kv, cache_salt="salt-a") == 2
        assert_served(cache, other, other_kv, 2)
    assert_unharmed(secured, metadata=bearer(ADMIN))


def test_a_wrong_token_costs_misses_and_check_says_why(secured: SidecarProcess) -> None:
    """A token the sidecar does not accept fails every call alike: an engine gets
    misses, as from a sidecar that is down (docs/sidecar.md); check() names it."""
    tokens, kv = prompt(23_000, 2)
    with scoped_client(secured, token=WRONG) as cache:
        assert cache.store(tokens, kv, cache_salt="salt-a") == 0
        assert cache.lookup(tokens, cache_salt="salt-a").num_tokens == 0
        assert cache.stats() == {}
        with pytest.raises(AuthenticationError, match="refused this client's token"):
            cache.check("salt-a")  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def ops_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An operator's config (the model and chunk size) and token files."""
    folder = tmp_path_factory.mktemp("ops")
    files = {"config": folder / "ops.yaml"}
    files["config"].write_text(yaml.safe_dump({"model_id": MODEL, "chunk_size": 16}))
    for name, token in (("tenant-a", TENANT_A), ("wrong", WRONG)):
        files[name] = folder / f"{name}.token"
        files[name].write_text(token + "\n")
        files[name].chmod(0o600)
    return files


@pytest.mark.slow  # a topology: an ops command process each
def test_ops_commands_with_a_token_scoped_to_one_salt(
    secured: SidecarProcess, ops_files: dict[str, Path]
) -> None:
    """``lmtier stats``, ``lookup`` and ``purge`` through the sidecar, with a token of
    one salt (they failed with "did not answer": the first session they opened was
    the unsalted namespace's)."""
    tokens, kv = prompt(24_000, 2)
    with scoped_client(secured) as cache:
        assert cache.store(tokens, kv, cache_salt="salt-a") == 2
    config = ops_files["config"]
    side = ["--sidecar", secured.target, "--sidecar-token-file", str(ops_files["tenant-a"])]
    salted = [*side, "--cache-salt", "salt-a"]

    done = run_lmtier(config, "stats", *salted, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert schema_problems(report) == [] and report["sidecar"]["sessions"] >= 1

    ids = " ".join(map(str, tokens))
    done = run_lmtier(config, "lookup", *salted, *OPS_GEOMETRY, "--tokens", ids, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["cached_tokens"] == 32

    done = run_lmtier(config, "purge", *salted, *OPS_GEOMETRY, "--yes", "--json")
    assert done.returncode == 0, done.stderr
    purged = json.loads(done.stdout)["namespaces"][0]
    assert purged["found"]["cpu"] >= 2  # and what the tests before stored under salt-a
    assert purged["purged"] == purged["found"]
    with scoped_client(secured) as cache:
        assert cache.lookup(tokens, cache_salt="salt-a").num_tokens == 0

    # A salt the token does not cover, no salt, or a wrong token: one line each, exit 2.
    refusals = [
        (["stats", *side, "--cache-salt", "salt-b"], "tenant-a may not use model"),
        (["stats", *side], "tenant-a may not use model"),
        (["purge", *side, "--cache-salt", "salt-b", *OPS_GEOMETRY, "--yes"], "may not use"),
        (
            ["stats", "--sidecar", secured.target, "--sidecar-token-file", str(ops_files["wrong"])],
            "refused this client's token",
        ),
    ]
    for args, words in refusals:
        done = run_lmtier(config, *args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert words in done.stderr and "did not answer" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "Traceback" not in done.stderr and TENANT_A[-12:] not in done.stderr


# --- listeners -------------------------------------------------------------------------


def test_a_tcp_port_zero_listener_reports_the_port_it_bound(tmp_path: Path) -> None:
    with TcpSidecar(tmp_path, settings(auth_token=ADMIN), listen="127.0.0.1:0") as sidecar:
        assert sidecar.port is not None and sidecar.port > 0
        assert f"listening on 127.0.0.1:{sidecar.port}" in sidecar.log()
        assert_unharmed(sidecar, metadata=bearer(ADMIN))
        with grpc.insecure_channel(sidecar.target) as channel:
            stub = pb_grpc.SidecarStub(channel)
            with open_session(stub, shared_memory=True, metadata=bearer(ADMIN)) as session:
                assert not session.info.HasField("shm")  # shared memory: unix sockets only
                expect_code(
                    Code.FAILED_PRECONDITION,
                    stub.AcquireSlabs,
                    pb.AcquireSlabsRequest(session_id=session.id, count=1),
                    metadata=session.metadata,
                )
        assert sidecar.stop() == 0


REMOTE_REFUSED = {
    "no-allow-remote": ({"auth_token": ADMIN}, "allow_remote"),
    "no-token": ({"allow_remote": True}, "token"),
    "neither": ({}, "allow_remote"),
}


@pytest.mark.parametrize(
    ("extra", "words"), list(REMOTE_REFUSED.values()), ids=list(REMOTE_REFUSED)
)
def test_a_remote_listener_needs_allow_remote_and_a_token(
    tmp_path: Path, extra: dict[str, Any], words: str
) -> None:
    sidecar = SidecarProcess(tmp_path, settings(**extra), listen="0.0.0.0:0")
    try:
        with pytest.raises(RuntimeError, match="exited"):
            sidecar.start()
    finally:
        sidecar.stop()
    assert sidecar.process is not None
    assert sidecar.process.returncode not in (0, None)
    log = sidecar.log()
    assert "can be reached from other machines" in log
    assert words in log
    assert "Traceback" not in log
    assert ADMIN not in log


def test_a_loopback_tcp_listener_needs_a_token_or_a_logged_setting(tmp_path: Path) -> None:
    """Every user of the machine can dial loopback (the unix socket is 0600): without a
    token such a sidecar served every tenant's KV to all of them, and said nothing."""
    refused = SidecarProcess(tmp_path / "refused", settings(), listen="127.0.0.1:0")
    try:
        with pytest.raises(RuntimeError, match="exited"):
            refused.start()
    finally:
        refused.stop()
    assert refused.process is not None and refused.process.returncode not in (0, None)
    log = refused.log()
    assert "127.0.0.1:0 needs a token: every user of this machine" in log
    assert "sidecar.allow_tcp_without_token" in log
    assert "Traceback" not in log
    opted_out = settings(allow_tcp_without_token=True)
    with TcpSidecar(tmp_path / "opted-out", opted_out, listen="127.0.0.1:0") as sidecar:
        assert "every user of this machine can read and write every tenant's KV" in sidecar.log()
        assert_unharmed(sidecar)


@pytest.mark.parametrize("address", ["127.1:0", "busy"])
def test_a_listen_address_that_cannot_be_bound_is_a_one_line_error(
    tmp_path: Path, address: str
) -> None:
    """``127.1`` passes for loopback (the resolver reads it as 127.0.0.1) but gRPC cannot
    bind it, nor a port in use: the sidecar died with a traceback, after opening its
    pool. Now: one line, exit 2, and no pool file left behind."""
    with socket.create_server(("127.0.0.1", 0)) as busy:
        if address == "busy":
            address = f"127.0.0.1:{busy.getsockname()[1]}"
        shm = tmp_path / "shm"
        shm.mkdir()
        config = settings(auth_token=ADMIN, shm_dir=str(shm))
        sidecar = SidecarProcess(tmp_path, config, listen=address)
        try:
            with pytest.raises(RuntimeError, match="exited"):
                sidecar.start()
        finally:
            sidecar.stop()
    assert sidecar.process is not None and sidecar.process.returncode == 2
    log = sidecar.log()
    assert "Traceback" not in log
    assert "lmtier serve: error: sidecar.listen: " in log
    assert list(shm.iterdir()) == []


@pytest.fixture(scope="module")
def nobody() -> Iterator[OtherUser]:
    user = other_user()
    if isinstance(user, str):
        pytest.skip(user)
    yield user
    user.close()


@pytest.mark.parametrize("token", [None, ADMIN], ids=["no-token", "token"])
def test_another_local_user_reads_nothing_over_loopback_tcp(
    tmp_path: Path, nobody: OtherUser, token: str | None
) -> None:
    """A sidecar on loopback TCP, configured as a user would (with and without a token),
    holds a chunk; a client of another uid (``nobody``, without the token) dials it.
    Without a token the sidecar used to start, and that client read the chunk
    bit-exact; now it does not start, and with a token the client is refused."""
    config = settings() if token is None else settings(auth_token=token)
    sidecar = TcpSidecar(tmp_path, config, listen="127.0.0.1:0")
    try:
        try:
            sidecar.start()
        except RuntimeError:
            assert token is None, sidecar.log()
            assert "needs a token" in sidecar.log()
            return
        metadata = bearer(token) if token is not None else ()
        with grpc.insecure_channel(sidecar.target) as channel:
            stub = pb_grpc.SidecarStub(channel)
            with open_session(stub, metadata=metadata, client_name="owner") as owner:
                key = owner.key()
                data = chunk_for(key, seed=3)
                assert store_stream(stub, owner, [(key, data)]).stored == 1
                stolen = nobody.run(
                    {
                        "target": sidecar.target,
                        "namespace": NAMESPACE.SerializeToString().hex(),
                        "keys": bytes(key).hex(),
                    }
                )
        assert stolen["uid"] == NOBODY
        assert stolen["code"] == "UNAUTHENTICATED", stolen["code"]
        assert stolen["data"] == ""
    finally:
        sidecar.stop()


@pytest.fixture(scope="module")
def pem(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_self_signed(tmp_path_factory.mktemp("pki"))


HANDSHAKE_TIMEOUT_S = 2.0
"""``remote``'s ``sidecar.handshake_timeout_s`` (the default is 10 s): a connection
that never handshakes is closed within 2 s; a client's TLS handshake on loopback
takes milliseconds, seconds to spare on a loaded machine."""


@pytest.fixture(scope="module")
def remote(
    tmp_path_factory: pytest.TempPathFactory, pem: tuple[Path, Path]
) -> Iterator[TcpSidecar]:
    cert, key = pem
    config = settings(
        allow_remote=True,
        auth_token=ADMIN,
        tls_cert_file=str(cert),
        tls_key_file=str(key),
        slab_bytes="64KiB",
        handshake_timeout_s=HANDSHAKE_TIMEOUT_S,
    )
    config["cpu"] = {"capacity_bytes": "1MiB", "staging_bytes": "256KiB"}
    credentials = channel_credentials(cert)
    folder = tmp_path_factory.mktemp("remote")
    with TcpSidecar(folder, config, listen="0.0.0.0:0", credentials=credentials) as sidecar:
        yield sidecar


def test_tls_and_a_token_over_a_remote_listener(remote: TcpSidecar, pem: tuple[Path, Path]) -> None:
    credentials = channel_credentials(pem[0])
    assert "without TLS" not in remote.log()
    with grpc.secure_channel(remote.target, credentials) as channel:
        stub = pb_grpc.SidecarStub(channel)
        expect_code(Code.UNAUTHENTICATED, _calls(stub, b"")["OpenSession"], ())
        with open_session(stub, metadata=bearer(ADMIN)) as session:
            assert not session.info.HasField("shm")
            key = session.key()
            data = chunk_for(key, seed=5)
            assert store_stream(stub, session, [(key, data)]).stored == 1
            streamed = list(
                stub.LoadStream(
                    pb.LoadRequest(session_id=session.id, keys=key),
                    metadata=session.metadata,
                    timeout=CALL_TIMEOUT_S,
                )
            )
            assert b"".join(p.data for p in streamed) == data
    # A client that does not speak TLS gets no further than the handshake.
    with grpc.insecure_channel(remote.target) as plain:
        stub = pb_grpc.SidecarStub(plain)
        expect_code(Code.UNAVAILABLE, _calls(stub, b"")["OpenSession"], bearer(ADMIN))
    assert_unharmed(remote, metadata=bearer(ADMIN), credentials=credentials)


@pytest.mark.slow  # a real timer: the handshake timeout
def test_a_connection_that_never_handshakes_is_closed(remote: TcpSidecar) -> None:
    """A TCP connection that never starts its TLS handshake holds one of the sidecar's
    descriptors, and anyone can open thousands. grpc's default let each stay 120 s; the
    sidecar's listeners close it after ``sidecar.handshake_timeout_s`` (10 s by
    default; ``HANDSHAKE_TIMEOUT_S`` here)."""
    assert remote.port is not None
    with socket.create_connection(("127.0.0.1", remote.port)) as idle:
        idle.settimeout(60)  # a hang guard, well under grpc's 120 s
        assert idle.recv(4096) == b""  # closed by the server; it sends nothing before TLS
    assert_unharmed(remote, metadata=bearer(ADMIN), credentials=remote.credentials)


def test_lmtier_connect_over_tls_streams_bit_exact(
    remote: TcpSidecar, pem: tuple[Path, Path]
) -> None:
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16)
    config = LMTierConfig(chunk_size=16)
    tokens = list(range(5000, 5000 + 16 * 4 + 5))  # four full chunks and a tail
    kv = torch.randn(spec.shape(len(tokens)), generator=torch.Generator().manual_seed(7))
    cache = lmtier.connect(
        remote.target,
        config,
        kv=spec,
        model_id="tls/model",
        credentials=channel_credentials(pem[0]),
        token=ADMIN,
    )
    try:
        assert cache.store(tokens, kv) == 4
        cache.flush()
        assert cache.lookup(tokens).num_tokens == 64
        with cache.load(tokens) as loaded:
            assert loaded.num_tokens == 64
            out = loaded.kv()
            assert out is not None
            assert torch.equal(out, kv.narrow(spec.token_axis, 0, 64))
    finally:
        cache.close()
    # The client streamed: the sidecar offers no shared memory over TCP.
    assert "streaming" in remote.log()
    assert ADMIN not in remote.log()
