"""Sessions and leases (lmtier.sidecar.sessions) and the namespaces sessions describe
(lmtier.sidecar.namespaces), on a real host pool, with a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from lmtier.chunks.format import DecodedChunk, decode
from lmtier.errors import CapacityError, InvalidRequestError
from lmtier.kv_spec import KVSpec, encode_kv_into
from lmtier.sidecar.auth import Principal
from lmtier.sidecar.namespaces import (
    NamespaceCheck,
    SessionSpace,
    parse_keys,
)
from lmtier.sidecar.sessions import SessionNotFound, Sessions
from lmtier.storage.host_pool import HostPool
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.wire.namespaces import to_wire

ALICE = Principal("alice")
BOB = Principal("bob")


def space(**changes: object) -> SessionSpace:
    fields: dict[str, object] = {
        "model_id": "m",
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 8,
        "chunk_size": 16,
    }
    fields.update(changes)
    return SessionSpace.from_wire(pb.Namespace(**fields))  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pool() -> HostPool:
    return HostPool(8192, 8, align=64)


def test_closing_a_session_returns_every_slab(pool: HostPool) -> None:
    async def run() -> None:
        sessions = Sessions(max_sessions=4, lease_ttl_s=10)
        session = sessions.open(space(), ALICE, shared_memory=True, client_name="c")
        for _ in range(3):
            handle = pool.acquire()
            assert handle is not None
            sessions.grant(session, handle, writable=False)
        assert pool.num_in_use == 3 and sessions.num_leases == 3
        assert sessions.close(session) == 3
        assert pool.num_in_use == 0 and len(sessions) == 0
        assert sessions.close(session) == 0  # idempotent
        with pytest.raises(SessionNotFound):
            sessions.get(session.id, ALICE)

    asyncio.run(run())


def test_leases_are_per_session_and_per_principal(pool: HostPool) -> None:
    async def run() -> None:
        sessions = Sessions(max_sessions=4, lease_ttl_s=10)
        mine = sessions.open(space(), ALICE, shared_memory=True, client_name="a")
        theirs = sessions.open(space(), BOB, shared_memory=True, client_name="b")
        handle = pool.acquire()
        assert handle is not None
        lease = sessions.grant(mine, handle, writable=True)
        assert sessions.release(theirs, [lease]) == 0  # ids mean nothing elsewhere
        assert sessions.take(mine, lease, writable=False) is None  # not a loaded chunk
        with pytest.raises(SessionNotFound):
            sessions.get(mine.id, BOB)  # the same answer as for an unknown id
        taken = sessions.take(mine, lease, writable=True)
        assert taken is handle and sessions.num_leases == 0
        taken.release()

    asyncio.run(run())


def test_only_expired_leases_are_reclaimed(pool: HostPool) -> None:
    """A late lease ends; its session and that session's fresh leases (another load,
    still being read) stay."""

    async def run() -> None:
        clock = Clock()
        sessions = Sessions(max_sessions=4, lease_ttl_s=5, clock=clock)
        stuck = sessions.open(space(), ALICE, shared_memory=True, client_name="stuck")
        fine = sessions.open(space(), ALICE, shared_memory=True, client_name="fine")
        first, second, third = pool.acquire(), pool.acquire(), pool.acquire()
        assert first is not None and second is not None and third is not None
        late = sessions.grant(stuck, first, writable=False)
        clock.now = 4.0
        fresh = sessions.grant(stuck, second, writable=False)
        sessions.grant(fine, third, writable=False)
        assert sessions.reap() == 0
        clock.now = 5.0
        assert sessions.reap() == 1
        assert not stuck.closed and not fine.closed and sessions.expired == 1
        assert late not in stuck.leases and fresh in stuck.leases
        assert pool.num_in_use == 2 and not second.released

    asyncio.run(run())


def test_max_sessions_is_enforced() -> None:
    async def run() -> None:
        sessions = Sessions(max_sessions=1, lease_ttl_s=5)
        sessions.open(space(), ALICE, shared_memory=False, client_name="")
        with pytest.raises(CapacityError):
            sessions.open(space(), ALICE, shared_memory=False, client_name="")

    asyncio.run(run())


def test_a_principal_may_commit_into_namespaces_it_opened_only() -> None:
    async def run() -> None:
        sessions = Sessions(max_sessions=4, lease_ttl_s=5)
        tenant_a, tenant_b = space(cache_salt="a"), space(cache_salt="b")
        session = sessions.open(tenant_a, ALICE, shared_memory=True, client_name="")
        assert sessions.space_for(ALICE, tenant_a.digest) == tenant_a
        assert sessions.space_for(ALICE, tenant_b.digest) is None
        assert sessions.space_for(BOB, tenant_a.digest) is None
        sessions.close(session)
        assert sessions.space_for(ALICE, tenant_a.digest) is None

    asyncio.run(run())


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_id": ""}, "model_id"),
        ({"num_layers": 0}, "num_layers"),
        ({"head_dim": 1 << 30}, "head_dim"),
        ({"chunk_size": 7}, "chunk_size"),
        ({"tp_size": 2, "tp_rank": 2}, "tp_rank"),
        ({"kv_dtype": "float128"}, "dtype"),
        ({"kv_layout": "XYZ"}, "layout"),
        ({"kv_layout": "LBHSC"}, "block_size"),
        ({"kv_layout": "LBHSC", "kv_block_size": 3}, "does not divide chunk_size"),
        ({"kv_layout": "LBSHC", "kv_block_size": 32}, "does not divide chunk_size"),
        ({"kv_block_size": 16}, "block_size"),
        ({"kv_page_interior": "flash"}, "page_interior"),
        ({"kv_layout": "LBHSC", "kv_block_size": 16, "kv_page_interior": "rocm"}, "interior"),
    ],
)
def test_bad_namespaces_are_refused(changes: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        space(**changes)


def test_the_wire_namespace_keys_chunks_like_the_embedded_facade() -> None:
    built = space(model_revision="r1", cache_salt="t", tp_size=2, tp_rank=1)
    assert SessionSpace.from_wire(to_wire(built.namespace)).digest == built.digest
    assert space().digest != space(cache_salt="t").digest


def test_a_paged_namespace_carries_its_block_size_both_ways() -> None:
    built = space(kv_layout="LBSHC", kv_block_size=8, cache_salt="t")
    assert (built.spec.layout, built.spec.block_size) == ("LBSHC", 8)
    assert built.namespace.kv_block_size == 8 and to_wire(built.namespace).kv_block_size == 8
    assert SessionSpace.from_wire(to_wire(built.namespace)).digest == built.digest
    assert built.geometry.shape == (2, 2, 8, 2, 16)  # L, B, S, H, C of 16 tokens
    assert built.digest != space(kv_layout="LBSHC", kv_block_size=16, cache_salt="t").digest
    assert to_wire(space().namespace).kv_block_size == 0


def test_a_paged_namespace_carries_its_page_interior_both_ways() -> None:
    cpu = space(kv_layout="LBHSC", kv_block_size=16, kv_page_interior="cpu_attn")
    assert cpu.spec.page_interior == "cpu_attn"
    assert to_wire(cpu.namespace).kv_page_interior == "cpu_attn"
    assert SessionSpace.from_wire(to_wire(cpu.namespace)).digest == cpu.digest
    gpu = space(kv_layout="LBHSC", kv_block_size=16, kv_page_interior="flash")
    unset = space(kv_layout="LBHSC", kv_block_size=16)  # an older client
    assert len({cpu.digest, gpu.digest, unset.digest}) == 3
    assert to_wire(space().namespace).kv_page_interior == ""


def test_keys_must_be_whole_and_of_the_session_namespace() -> None:
    digest = space().digest
    keys = parse_keys(digest + bytes(16) + digest + b"\x01" * 16, digest)
    assert len(keys) == 2
    with pytest.raises(InvalidRequestError, match="32 bytes"):
        parse_keys(digest + bytes(15), digest)
    with pytest.raises(PermissionError, match="namespace"):
        parse_keys(space(cache_salt="x").digest + bytes(16), digest)


def test_namespace_check_serves_chunks_of_registered_geometries_only(pool: HostPool) -> None:
    check = NamespaceCheck()
    small = space()
    spec = KVSpec(2, 2, 8)
    handle = pool.acquire()
    assert handle is not None
    key = small.digest + bytes(16)
    meta = spec.meta(key, 16)
    length = encode_kv_into(handle, meta, spec_kv(spec))
    chunk: DecodedChunk = decode(handle.view[:length])
    assert not check.fits(chunk)  # no session described this namespace yet
    check.register(small)
    assert check.fits(chunk)
    check.register(space(num_layers=3))  # another model: does not change this one
    assert check.fits(chunk)
    handle.release()


def spec_kv(spec: KVSpec) -> object:
    import torch

    return torch.zeros(spec.shape(16))
