"""lmtier.storing.Reserved: slabs a store has in hand and those still coming."""

from __future__ import annotations

import pytest

from lmtier.storage.host_pool import HostPool, SlabHandle
from lmtier.store import Reserved


@pytest.fixture
def pool() -> HostPool:
    return HostPool(num_slabs=8, slab_bytes=64)


def test_take_uses_slabs_in_hand_then_waits_for_those_coming(pool: HostPool) -> None:
    asked: list[str] = []

    def coming(name: str, count: int) -> list[SlabHandle]:
        asked.append(name)
        return [handle for handle in (pool.acquire() for _ in range(count)) if handle]

    reserved = Reserved(
        [pool.acquire(), pool.acquire()],  # type: ignore[list-item]
        [lambda: coming("second", 3), lambda: coming("third", 2)],
    )
    first = reserved.take(2)
    assert len(first) == 2 and asked == []  # nothing waited for while slabs are in hand
    second = reserved.take(2)
    assert len(second) == 2 and asked == ["second"]
    third = reserved.take(4)  # one left of the second, then the third
    assert len(third) == 3 and asked == ["second", "third"]
    assert reserved.take(1) == []  # run out: the caller acquires more itself
    for handle in first + second + third:
        handle.release()
    assert pool.num_in_use == 0


def test_release_waits_for_what_is_coming_and_gives_every_slab_back(pool: HostPool) -> None:
    settled: list[bool] = []

    def coming() -> list[SlabHandle]:
        settled.append(True)
        return [pool.acquire(), pool.acquire()]  # type: ignore[list-item]

    reserved = Reserved([pool.acquire()], [coming])  # type: ignore[list-item]
    kept = reserved.take(1)
    reserved.release()
    assert settled == [True]  # an answer in flight is read, its slabs not left held
    assert pool.num_in_use == 1
    kept[0].release()
    assert pool.num_in_use == 0


def test_release_gives_back_what_it_holds_when_an_answer_fails(pool: HostPool) -> None:
    def broken() -> list[SlabHandle]:
        raise RuntimeError("the call failed")

    reserved = Reserved([pool.acquire(), pool.acquire()], [broken])  # type: ignore[list-item]
    with pytest.raises(RuntimeError):
        reserved.release()
    assert pool.num_in_use == 0
