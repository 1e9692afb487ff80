"""One tenant against another inside a real ``lmtier serve`` process: each token's
share of the sessions and slabs (``sidecar.token_share``, by default an equal share).

One sidecar serves the module: four tokens (an admin and an ops token that reach
every namespace, two tenants scoped to a salt each), 16 sessions and 16 slabs, so
each token may hold 4 of each, and ``stream_stall_s`` 1 s (``lease_ttl_s`` stays 60 s:
what a stalled stream holds must come back long before a lease would). Before the
shares, one tenant opened every session and another's OpenSession failed, and one
tenant's stalled streams held every slab and another stored nothing.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from lmtier.testing.sidecar import SidecarProcess
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.v1 import sidecar_pb2_grpc as pb_grpc
from support.sidecar_helpers import (
    CALL_TIMEOUT_S,
    TENANT_MODEL,
    Session,
    bearer,
    chunk_for,
    expect_code,
    namespace,
    open_session,
    pieces,
    store_stream,
    tenant,
    wait_for,
    write_tokens,
)

pytestmark = pytest.mark.integration

Code = grpc.StatusCode
ADMIN = "admin-" + secrets.token_hex(16)
OPS = "ops-" + secrets.token_hex(16)
TENANT_A = "tenant-a-" + secrets.token_hex(16)
TENANT_B = "tenant-b-" + secrets.token_hex(16)
MAX_SESSIONS = 16
NUM_SLABS = 16
SHARE = 4  # of each, per token: 1/4 (four tokens)
STALLED = 20


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    folder = tmp_path_factory.mktemp("shares")
    tokens = write_tokens(
        folder,
        [
            {"token": OPS, "name": "ops"},
            {"token": TENANT_A, "name": "tenant-a", "models": [TENANT_MODEL], "salts": ["a"]},
            {"token": TENANT_B, "name": "tenant-b", "models": [TENANT_MODEL], "salts": ["b"]},
        ],
    )
    settings: dict[str, Any] = {
        "cpu": {"capacity_bytes": "192KiB", "staging_bytes": "64KiB"},
        "sidecar": {
            "slab_bytes": "16KiB",
            "auth_token": ADMIN,
            "tokens_file": str(tokens),
            "max_sessions": MAX_SESSIONS,
            "stream_stall_s": 1,
        },
    }
    with SidecarProcess(folder, settings) as process:
        assert f"each of 4 tokens may hold {SHARE} sessions and {SHARE} of 16 slabs" in (
            process.log()
        )
        yield process


@pytest.fixture(scope="module")
def stub(sidecar: SidecarProcess) -> Iterator[pb_grpc.SidecarStub]:
    with grpc.insecure_channel(sidecar.target) as channel:
        yield pb_grpc.SidecarStub(channel)


@pytest.fixture(scope="module")
def control(stub: pb_grpc.SidecarStub) -> Iterator[Session]:
    """The admin's session for the module: Stats and purges go through it."""
    with open_session(stub, metadata=bearer(ADMIN), client_name="control") as session:
        assert session.info.shm.num_slabs == NUM_SLABS
        yield session


def counters(stub: pb_grpc.SidecarStub, session: Session) -> dict[str, float]:
    """The sidecar's gauges, and the CPU tier's ``queue_drops`` (chunks a store could
    not keep for want of a free slab)."""
    reply = stub.Stats(
        pb.StatsRequest(session_id=session.id), metadata=session.metadata, timeout=CALL_TIMEOUT_S
    )
    out = dict(reply.sidecar.values)
    out["queue_drops"] = reply.tiers["cpu"].values["queue_drops"]
    return out


@pytest.fixture
def quiet(stub: pb_grpc.SidecarStub, control: Session) -> dict[str, float]:
    """A clean slate: earlier tests' sessions closed, nothing cached (each tenant's
    namespace purged), no slab in use; the counters then."""
    for salt in ("a", "b"):
        with open_session(
            stub, namespace(model_id=TENANT_MODEL, cache_salt=salt), metadata=bearer(ADMIN)
        ) as admin:
            stub.Purge(pb.PurgeRequest(session_id=admin.id), metadata=admin.metadata)

    def settled() -> dict[str, float] | None:
        now = counters(stub, control)
        return now if now["sessions"] == 1 and now["slabs_in_use"] == 0 else None

    return wait_for(settled, "the sessions and slabs of earlier tests to go")


def chunks(session: Session, count: int) -> list[tuple[bytes, bytes]]:
    return [
        (key, chunk_for(key, seed=i)) for i, key in enumerate(session.key() for _ in range(count))
    ]


def test_one_tenant_cannot_lock_the_others_out_of_sessions(
    stub: pb_grpc.SidecarStub, quiet: dict[str, float]
) -> None:
    """Tenant A opens sessions until it is refused: it gets its share, 4 of the 16
    (before: all 16), and tenant B still opens its own."""
    held: list[Session] = []
    refused: grpc.RpcError | None = None
    try:
        for _ in range(MAX_SESSIONS):
            try:
                held.append(tenant(stub, TENANT_A, "a"))
            except grpc.RpcError as exc:
                refused = exc
                break
        with tenant(stub, TENANT_B, "b") as b:
            reply = stub.Lookup(
                pb.LookupRequest(session_id=b.id, keys=b.key()), metadata=b.metadata
            )
            assert reply.num_chunks == 0
    finally:
        for session in held:
            session.close()
    assert refused is not None, f"tenant A opened {len(held)} sessions"
    assert refused.code() == Code.RESOURCE_EXHAUSTED
    assert "tenant-a has 4 sessions open, its share" in (refused.details() or "")
    assert "sidecar.token_share" in (refused.details() or "")
    assert len(held) == SHARE


def _stall(stub: pb_grpc.SidecarStub, session: Session, release: threading.Event) -> grpc.Future:
    """A StoreStream that sends the first piece of a chunk, then waits for ``release``
    (a client stalled in the middle of a chunk)."""
    key = session.key()

    def messages() -> Iterator[pb.ChunkPiece]:
        first, *rest = pieces(session.id, [(key, chunk_for(key))], piece_bytes=4096)
        yield first
        release.wait(CALL_TIMEOUT_S)
        yield from rest

    return stub.StoreStream.future(messages(), metadata=session.metadata, timeout=CALL_TIMEOUT_S)


def _settled_count(
    stub: pb_grpc.SidecarStub, control: Session, base: dict[str, float]
) -> Callable[[], float]:
    """How many chunk starts the sidecar has dealt with since ``base``: each took a slab
    (held now, or reclaimed since), found none free, or was refused by its share."""

    def count() -> float:
        now = counters(stub, control)
        return sum(
            now.get(name, 0) - base.get(name, 0)
            for name in ("slabs_in_use", "queue_drops", "share_refusals", "stream_slabs_reclaimed")
        )

    return count


def test_one_tenants_stalled_streams_cannot_starve_anothers_stores(
    stub: pb_grpc.SidecarStub, control: Session, quiet: dict[str, float]
) -> None:
    """20 StoreStreams of tenant A stall inside a chunk: they hold at most A's share of
    the slabs (4 of 16), and tenant B stores 4 of 4 meanwhile (before: A's streams
    held all 16 slabs, and B stored 0)."""
    release = threading.Event()
    with tenant(stub, TENANT_A, "a") as a, tenant(stub, TENANT_B, "b") as b:
        stalled = [_stall(stub, a, release) for _ in range(STALLED)]
        try:
            settled = _settled_count(stub, control, quiet)
            wait_for(lambda: settled() == STALLED, "every stalled stream's first piece")
            assert counters(stub, control)["slabs_in_use"] <= SHARE
            assert store_stream(stub, b, chunks(b, 4)).stored == 4
        finally:
            release.set()
        replies = [future.result() for future in stalled]
    assert sum(reply.stored for reply in replies) <= STALLED
    assert all(reply.stored + reply.dropped == 1 for reply in replies)


def test_a_stalled_stream_gives_its_slab_back_within_stream_stall_s(
    stub: pb_grpc.SidecarStub, control: Session, quiet: dict[str, float]
) -> None:
    """A StoreStream stopped mid-chunk loses its slab after ``stream_stall_s`` (1 s
    here), not ``lease_ttl_s`` (60 s): the wait below gives up at 30 s. The chunk is
    dropped."""
    release = threading.Event()
    with tenant(stub, TENANT_A, "a") as a:
        future = _stall(stub, a, release)
        try:
            in_use = lambda: counters(stub, control)["slabs_in_use"]  # noqa: E731
            wait_for(lambda: in_use() == 1, "the stalled stream to take a slab")
            wait_for(lambda: in_use() == 0, "the stalled stream's slab to be reclaimed")
        finally:
            release.set()
        reply = future.result()
    assert (reply.stored, reply.dropped) == (0, 1)
    assert counters(stub, control)["stream_slabs_reclaimed"] >= 1


def test_leases_are_bounded_by_the_share(
    stub: pb_grpc.SidecarStub, control: Session, quiet: dict[str, float]
) -> None:
    """Shared-memory leases count too: the admin token acquires 4 slabs of the 16 it asks
    for and is then refused, and the ops token still acquires its 4; a Load leases at
    most the share (a shorter hit), while a LoadStream serves every chunk in batches
    of the share."""
    with (
        open_session(stub, metadata=bearer(ADMIN)) as admin,
        open_session(stub, metadata=bearer(OPS)) as ops,
    ):

        def acquire(session: Session) -> list[pb.SlabGrant]:
            request = pb.AcquireSlabsRequest(session_id=session.id, count=NUM_SLABS)
            reply = stub.AcquireSlabs(request, metadata=session.metadata, timeout=CALL_TIMEOUT_S)
            return list(reply.slabs)

        grants = acquire(admin)
        assert len(grants) == SHARE
        details = expect_code(
            Code.RESOURCE_EXHAUSTED,
            stub.AcquireSlabs,
            pb.AcquireSlabsRequest(session_id=admin.id, count=1),
            metadata=admin.metadata,
        )
        assert "auth_token holds 4 slabs, its share of the pool" in details
        theirs = acquire(ops)
        assert len(theirs) == SHARE
        for session, given in ((admin, grants), (ops, theirs)):
            stub.Release(
                pb.ReleaseRequest(session_id=session.id, leases=[g.lease for g in given]),
                metadata=session.metadata,
            )

        stored = chunks(ops, 6)
        assert store_stream(stub, ops, stored).stored == 6
        keys = b"".join(key for key, _ in stored)
        loaded = stub.Load(
            pb.LoadRequest(session_id=ops.id, keys=keys), metadata=ops.metadata
        ).chunks
        assert len(loaded) == SHARE
        stub.Release(
            pb.ReleaseRequest(session_id=ops.id, leases=[c.lease for c in loaded]),
            metadata=ops.metadata,
        )
        streamed = stub.LoadStream(
            pb.LoadRequest(session_id=ops.id, keys=keys),
            metadata=ops.metadata,
            timeout=CALL_TIMEOUT_S,
        )
        assert b"".join(p.data for p in streamed) == b"".join(data for _, data in stored)
        assert counters(stub, control)["leases"] == 0
