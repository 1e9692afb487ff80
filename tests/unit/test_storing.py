"""lmtier.storing: slabs a store has in hand and those still coming (Reserved), and
when an embedded store hands its chunks over (after its copies, before it waits for
slabs, and on errors too)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.config import CPUTierConfig, DiskTierConfig
from lmtier.errors import InvalidKVError
from lmtier.kv_spec import ChunkFramer
from lmtier.storage.host_pool import HostPool, SlabHandle
from lmtier.storage.manager import StorageManager
from lmtier.store import Reserved

CHUNK = 16
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8)


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


def embedded(slabs: int) -> LMTier:
    """An embedded cache, CPU tier only, with host memory for ``slabs`` chunks."""
    slab = SPEC.encoded_chunk_bytes(CHUNK)
    cpu = CPUTierConfig(capacity_bytes=(slabs - 1) * slab, staging_bytes=slab)
    config = LMTierConfig(chunk_size=CHUNK, cpu=cpu, disk=DiskTierConfig(enabled=False))
    return LMTier(config, SPEC, model_id="m")


def test_an_embedded_store_hands_its_chunks_over_once_every_copy_is_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[str] = []
    write_many, put_many = ChunkFramer.write_many, StorageManager.put_many

    def copying(
        self: ChunkFramer, chunks: Sequence[Any], ctime: float, *, seal: bool = False
    ) -> list[int]:
        events.append("copy")
        return write_many(self, chunks, ctime, seal=seal)

    def handing(self: StorageManager, encoded: Sequence[Any], *, wait: bool = False) -> int:
        events.append("hand over")
        return put_many(self, encoded, wait=wait)

    monkeypatch.setattr(ChunkFramer, "write_many", copying)
    monkeypatch.setattr(StorageManager, "put_many", handing)
    with embedded(64) as cache:
        tokens = list(range(20 * CHUNK))
        assert cache.store(tokens, torch.randn(SPEC.shape(len(tokens)))) == 20
        batches = -(-20 // cache.chunk_store.store_batch)
        # no background write competes with the caller's copies for the CPUs
        assert events == ["copy"] * batches + ["hand over"] * batches
        assert cache.lookup(tokens).num_chunks == 20


def test_a_store_larger_than_host_memory_hands_over_before_it_takes_more_slabs() -> None:
    with embedded(8) as cache:  # room for 8 chunks; the prompt has 20
        tokens = list(range(20 * CHUNK))
        kv = torch.randn(SPEC.shape(len(tokens)))
        # every chunk was stored (the later ones evicted the earlier), none dropped for
        # want of slabs that the store itself held un-handed-over
        assert cache.store(tokens, kv) == 20
        assert cache.stats()["cpu"]["queue_drops"] == 0
        assert cache.host_memory().slabs_in_use == cache.host_memory().cached_chunks


def test_a_copy_that_fails_mid_store_hands_over_the_batches_before_and_leaks_no_slab(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    write_many, calls = ChunkFramer.write_many, [0]

    def failing(
        self: ChunkFramer, chunks: Sequence[Any], ctime: float, *, seal: bool = False
    ) -> list[int]:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("the KV went away mid-copy")
        return write_many(self, chunks, ctime, seal=seal)

    monkeypatch.setattr(ChunkFramer, "write_many", failing)
    with embedded(16) as cache:  # batches of 4: the third of five fails
        tokens = list(range(20 * CHUNK))
        with pytest.raises(RuntimeError, match="mid-copy"):
            cache.store(tokens, torch.randn(SPEC.shape(len(tokens))))
        step = cache.chunk_store.store_batch
        assert cache.lookup(tokens).num_chunks == 2 * step  # the batches copied before
        memory = cache.host_memory()
        assert memory.slabs_in_use == memory.cached_chunks == 2 * step


def test_hold_pages_stores_what_the_cache_lacks_and_says_what_it_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """hold_pages answers how many leading chunks are held after the call (held before
    or stored now), stores only the chunks the local tiers lack, and asks no lookup of
    its own (the store's reservation answers what is held)."""
    with embedded(64) as cache:
        keys = cache.keys(list(range(4 * CHUNK)))
        whole = torch.randn(SPEC.shape(4 * CHUNK))
        pages = [SPEC.narrow_tokens(whole, at * CHUNK, CHUNK) for at in range(4)]
        assert cache.store_pages(keys[:2], pages[:2]) == 2

        def no_lookup(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("hold_pages made a lookup of its own")

        monkeypatch.setattr(cache.chunk_store, "lookup", no_lookup)
        copied: list[int] = []
        write_many = ChunkFramer.write_many

        def counting(self: ChunkFramer, chunks: Any, *args: Any, **kwargs: Any) -> Any:
            copied.append(len(chunks))
            return write_many(self, chunks, *args, **kwargs)

        monkeypatch.setattr(ChunkFramer, "write_many", counting)
        assert cache.hold_pages(keys, pages) == 4
        assert copied == [2]  # the two held already were not copied again
        assert cache.hold_pages(keys, pages) == 4
        assert copied == [2]  # all held: nothing copied
        with cache.load_keys(keys) as hit:
            assert torch.equal(hit.kv(), whole)
        with pytest.raises(InvalidKVError, match="got 3 pages for 4 keys"):
            cache.hold_pages(cache.keys(list(range(100, 100 + 4 * CHUNK))), pages[:3])


def test_store_pages_takes_each_chunk_from_a_tensor_of_its_own() -> None:
    with embedded(64) as cache:
        keys = cache.keys(list(range(3 * CHUNK)))
        whole = torch.randn(SPEC.shape(4 * CHUNK))
        # pages apart and strided: every other chunk of a larger tensor, reversed
        pages = [SPEC.narrow_tokens(whole, at * CHUNK, CHUNK) for at in (3, 1, 0)]
        assert cache.store_pages(keys, pages) == 3
        assert cache.store_pages(keys, pages) == 0  # held: nothing stored again
        targets = [torch.empty(SPEC.shape(CHUNK)) for _ in keys]
        with cache.load_keys(keys) as hit:
            assert hit.copy_to(targets) == 3
        for target, page in zip(targets, pages, strict=True):
            assert torch.equal(target, page)
        bad: list[tuple[list[Any], str]] = [
            (pages[:2], "got 2 pages for 3 keys"),
            ([pages[0], "page", pages[2]], "page 1 is a str"),
            ([pages[0], whole, pages[2]], f"page 1 holds {4 * CHUNK} tokens"),
            ([pages[0], pages[1].double(), pages[2]], "dtype"),
        ]
        for given, message in bad:
            with pytest.raises(InvalidKVError, match=message):
                cache.store_pages(cache.keys(list(range(100, 100 + 3 * CHUNK))), given)
