"""Each token's share of the sidecar's sessions and slabs (lmtier.sidecar.shares), as
sessions, leases (lmtier.sidecar.sessions) and streaming calls (lmtier.sidecar.holds)
count against it; and the default share a sidecar gives its tokens."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from lmtier.config import config_from_dict
from lmtier.errors import CapacityError
from lmtier.sidecar.auth import Principal
from lmtier.sidecar.holds import StreamHold
from lmtier.sidecar.namespaces import SessionSpace
from lmtier.sidecar.server import Sidecar
from lmtier.sidecar.sessions import Sessions
from lmtier.sidecar.shares import Shares
from lmtier.sidecar.transfers import clipped
from lmtier.storage.host_pool import HostPool
from lmtier.storage.lookup import Lookup, TierSpan
from lmtier.v1 import sidecar_pb2 as pb

ALICE = Principal("alice")
BOB = Principal("bob")
TWIN = Principal("alice")  # the same name and scope: another token all the same


def space() -> SessionSpace:
    wire = pb.Namespace(model_id="m", num_layers=2, num_kv_heads=2, head_dim=8, chunk_size=16)
    return SessionSpace.from_wire(wire)


@pytest.fixture
def pool() -> HostPool:
    return HostPool(8192, 8, align=64)


def test_a_share_is_rounded_down_and_at_least_one() -> None:
    shares = Shares.of(0.29, max_sessions=100, num_slabs=10)
    assert (shares.sessions_each, shares.slabs_each) == (29, 2)  # 0.29 * 100 is 28.999...
    assert Shares.of(0.01, max_sessions=10, num_slabs=10).slabs_each == 1
    whole = Shares.of(1.0, max_sessions=10, num_slabs=10)
    assert whole.take(ALICE, 1000) == 1000  # no bound of its own: the pool's answer


def test_sessions_past_the_share_are_refused_for_that_token_only() -> None:
    async def run() -> None:
        sessions = Sessions(max_sessions=8, lease_ttl_s=5, shares=Shares(2, 8))
        opened = [sessions.open(space(), ALICE, shared_memory=False, client_name="") for _ in "ab"]
        with pytest.raises(CapacityError, match="alice has 2 sessions open, its share"):
            sessions.open(space(), ALICE, shared_memory=False, client_name="")
        sessions.open(space(), BOB, shared_memory=False, client_name="")
        sessions.open(space(), TWIN, shared_memory=False, client_name="")
        sessions.close(opened[0])
        sessions.open(space(), ALICE, shared_memory=False, client_name="")

    asyncio.run(run())


def test_leases_count_until_they_end(pool: HostPool) -> None:
    """A lease holds its slab's count until it is released, committed, reaped or its
    session closes; a token at its share is refused, another is not."""

    async def run() -> None:
        shares = Shares(8, 3)
        sessions = Sessions(max_sessions=8, lease_ttl_s=5, shares=shares)
        mine = sessions.open(space(), ALICE, shared_memory=True, client_name="")
        leases = []
        for _ in range(3):
            assert shares.take(ALICE, 1) == 1
            handle = pool.acquire()
            assert handle is not None
            leases.append(sessions.grant(mine, handle, writable=True))
        assert shares.take(ALICE, 1) == 0 and shares.refusals == 1
        with pytest.raises(CapacityError, match="alice holds 3 slabs, its share of the pool"):
            shares.take_some(ALICE, 1)
        assert shares.take(BOB, 5) == 3
        shares.give(BOB, 3)
        taken = sessions.take(mine, leases[0], writable=True)  # a commit
        assert taken is not None
        taken.release()
        assert shares.slabs_held(ALICE) == 2
        assert sessions.release(mine, [leases[1]]) == 1
        assert shares.slabs_held(ALICE) == 1
        sessions.close(mine)
        assert shares.slabs_held(ALICE) == 0 and pool.num_in_use == 0

    asyncio.run(run())


async def _until(condition: object, what: str) -> None:
    for _ in range(1000):  # 10 s at most: a bound for a hang, not a speed check
        if callable(condition) and condition():
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"timed out waiting for {what}")


def test_a_stream_that_stops_moving_loses_its_slabs(pool: HostPool) -> None:
    async def run() -> None:
        shares = Shares(8, 2)
        hold = StreamHold(shares, ALICE, stall_s=0.05, ttl_s=60)
        assert hold.reserve(5) == 2
        handles = [pool.acquire(), pool.acquire()]
        for handle in handles:
            assert handle is not None
            hold.hold(handle)
        assert shares.slabs_held(ALICE) == 2
        await _until(lambda: not any(hold.holds(h) for h in handles if h), "the reclaim")
        assert pool.num_in_use == 0 and shares.slabs_held(ALICE) == 0
        assert shares.reclaimed == 2
        hold.close()
        assert shares.slabs_held(ALICE) == 0

    asyncio.run(run())


def test_a_slab_held_past_the_lease_ttl_goes_even_while_the_stream_moves(
    pool: HostPool,
) -> None:
    async def run() -> None:
        shares = Shares(8, 2)
        hold = StreamHold(shares, ALICE, stall_s=60, ttl_s=0.05)
        assert hold.reserve(1) == 1
        handle = pool.acquire()
        assert handle is not None
        hold.hold(handle)

        def reclaimed() -> bool:
            hold.moved()
            return not hold.holds(handle)

        await _until(reclaimed, "the reclaim at the lease ttl")
        assert handle.released and shares.slabs_held(ALICE) == 0

    asyncio.run(run())


def test_a_handed_over_slab_stops_counting_and_stays_the_new_owners(pool: HostPool) -> None:
    async def run() -> None:
        shares = Shares(8, 2)
        hold = StreamHold(shares, ALICE, stall_s=60, ttl_s=60)
        assert hold.reserve(2) == 2
        handle = pool.acquire()
        assert handle is not None
        hold.hold(handle)
        hold.unreserve()  # the second was not used
        assert hold.hand_over(handle) and not handle.released
        assert not hold.hand_over(handle)  # once
        hold.close()
        assert shares.slabs_held(ALICE) == 0 and not handle.released
        handle.release()

    asyncio.run(run())


def test_a_lookup_is_clipped_to_each_batch_of_keys() -> None:
    found = Lookup(5, (TierSpan("cpu", 0, 2), TierSpan("disk", 2, 5)))
    assert clipped(found, 0, 3) == Lookup(3, (TierSpan("cpu", 0, 2), TierSpan("disk", 2, 3)))
    assert clipped(found, 3, 6) == Lookup(2, (TierSpan("disk", 0, 2),))
    assert clipped(found, 5, 8) == Lookup(0, ())
    assert clipped(None, 0, 3) is None


def _sidecar(tmp_path: Path, **sidecar: object) -> Sidecar:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("- {token: t-1-abcdefgh}\n- {token: t-2-abcdefgh, salts: [s]}\n")
    tokens.chmod(0o600)
    config = config_from_dict(
        {"disk": {"enabled": False}, "sidecar": {"tokens_file": str(tokens), **sidecar}}
    )
    return Sidecar(config, f"unix://{tmp_path}/s.sock")


def test_each_token_gets_an_equal_share_unless_configured(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        equal = _sidecar(tmp_path, max_sessions=10)._shares(num_slabs=9)
    assert (equal.sessions_each, equal.slabs_each) == (5, 4)
    assert "each of 2 tokens may hold 5 sessions and 4 of 9 slabs" in caplog.text
    assert "together" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        wide = _sidecar(tmp_path, max_sessions=10, token_share=0.8)._shares(num_slabs=9)
    assert (wide.sessions_each, wide.slabs_each) == (8, 7)
    assert "together they can take them all" in caplog.text


def test_the_share_is_a_fraction() -> None:
    for bad in (0, 1.5, -0.1, "half"):
        with pytest.raises(ValueError, match="token_share"):
            config_from_dict({"sidecar": {"token_share": bad}})
