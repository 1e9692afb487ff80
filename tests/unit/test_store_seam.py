"""The seam under the facade (lmtier/store.py): LMTier over any ChunkStore.

A store only ever sees what the facade checked; both stores implement the whole
protocol with its signatures; the facade's namespace book resolves every key it
hands out.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest
import torch

from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier import namespaces as namespaces_module
from lmtier.chunks.keys import ChunkKey, Namespace
from lmtier.config import CPUTierConfig, DiskTierConfig
from lmtier.errors import CacheClosedError, InvalidKVError, InvalidRequestError
from lmtier.local_store import LocalStore
from lmtier.namespaces import Namespaces
from lmtier.results import HostMemory
from lmtier.storage.events import ChunkName
from lmtier.storage.host_pool import HostPool, SlabHandle
from lmtier.storage.lookup import LoadedChunk, Lookup, TierSpan
from lmtier.store import ChunkStore, Encoded, Reserved, StoreLayout

CHUNK = 16
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8)


def config() -> LMTierConfig:
    return LMTierConfig(
        chunk_size=CHUNK,
        cpu=CPUTierConfig(capacity_bytes=4 << 20, staging_bytes=8 << 20),
        disk=DiskTierConfig(enabled=False),
    )


class RecordingStore:
    """A ChunkStore over one private pool that records every call it gets."""

    store_batch = 2
    holds_writes = False
    seal_on_copy = False

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.layout: StoreLayout | None = None
        self.pool: HostPool | None = None
        self.held: dict[ChunkKey, int] = {}

    def _log(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def start(self, layout: StoreLayout) -> None:
        self._log("start")
        self.layout = layout
        slab = layout.kv_spec.encoded_chunk_bytes(layout.chunk_size)
        self.pool = HostPool.for_chunks(slab, 8 * slab)

    def close(self, timeout_s: float | None) -> None:
        self._log("close", timeout_s)
        assert self.pool is not None
        self.pool.close()

    def check(self, namespace: Namespace) -> None:
        self._log("check", namespace)

    def lookup(self, keys: Sequence[ChunkKey], *, local_only: bool) -> Lookup:
        self._log("lookup", list(keys), local_only)
        count = 0
        while count < len(keys) and keys[count] in self.held:
            count += 1
        return Lookup(count, (TierSpan("rec", 0, count),) if count else ())

    def lookup_now(self, keys: Sequence[ChunkKey]) -> Lookup | None:
        self._log("lookup_now", list(keys))
        return None

    def load(self, keys: Sequence[ChunkKey], lookup: Lookup | None) -> list[LoadedChunk]:
        self._log("load", list(keys), lookup)
        return []

    refuse = False
    """Answer every reservation refused, as a sidecar's client does when it is down."""

    def reserve(
        self, keys: Sequence[ChunkKey], skip: int | None, count: int
    ) -> tuple[int, Reserved]:
        self._log("reserve", list(keys), skip, count)
        if self.refuse:
            return (skip or 0), Reserved(refused=True)
        present = skip if skip is not None else self.lookup(keys, local_only=True).num_chunks
        return present, Reserved()

    def acquire_slabs(self, count: int, *, wait: bool = True) -> list[SlabHandle]:
        self._log("acquire_slabs", count)
        assert self.pool is not None
        handles = [self.pool.acquire() for _ in range(count)]
        return [handle for handle in handles if handle is not None]

    def hand_over(self, encoded: Encoded) -> Callable[[], int]:
        self._log("hand_over", [key for key, _, _ in encoded])
        for key, handle, length in encoded:
            self.held[key] = length
            handle.release()
        return lambda: len(encoded)

    def name_chunks(self, names: Mapping[ChunkKey, ChunkName]) -> None:
        if names:
            self._log("name_chunks", len(names))

    def host_memory(self) -> HostMemory:
        return HostMemory(0, 0, 0, 0, 0, 0)

    def in_memory(self, key: ChunkKey) -> bool:
        return key in self.held

    def add_evict_listener(self, callback: Callable[[ChunkKey], None]) -> None:
        self._log("add_evict_listener")

    def remove_evict_listener(self, callback: Callable[[ChunkKey], None]) -> None:
        self._log("remove_evict_listener")

    def flush(self) -> None:
        self._log("flush")

    def stats(self) -> dict[str, dict[str, object]]:
        return {"rec": {"held": len(self.held)}}

    def purge(self, namespace: Namespace, *, dry_run: bool) -> dict[str, int]:
        self._log("purge", namespace, dry_run)
        return {"rec": 0}

    def pin(self, keys: Sequence[ChunkKey]) -> dict[str, int]:
        self._log("pin", list(keys))
        return {"rec": len(keys)}

    def unpin(self, keys: Sequence[ChunkKey] | None) -> dict[str, int]:
        self._log("unpin", keys)
        return {"rec": 0}


def protocol_methods() -> list[str]:
    return [
        name
        for name, value in vars(ChunkStore).items()
        if callable(value) and not name.startswith("_")
    ]


@pytest.mark.parametrize("store", ["LocalStore", "SidecarStore", "RecordingStore"])
def test_every_store_has_every_method_of_the_protocol_with_its_signature(store: str) -> None:
    if store == "SidecarStore":
        pytest.importorskip("grpc")
        from lmtier.remote.client import SidecarStore

        cls: type = SidecarStore
    else:
        cls = {"LocalStore": LocalStore, "RecordingStore": RecordingStore}[store]
    assert len(protocol_methods()) == 19
    for name in protocol_methods():
        want = inspect.signature(getattr(ChunkStore, name))
        got = inspect.signature(getattr(cls, name))
        assert list(got.parameters) == list(want.parameters), f"{store}.{name}"
    assert isinstance(getattr(cls, "store_batch", None), int) or store == "SidecarStore"
    assert isinstance(cls.holds_writes, bool)
    assert isinstance(getattr(cls, "seal_on_copy", None), bool | property)


def test_a_facade_over_any_store_stores_through_reserve_acquire_and_hand_over() -> None:
    store = RecordingStore()
    with LMTier(config(), SPEC, store=store, model_id="m") as cache:
        assert cache.chunk_store is store
        tokens = list(range(5 * CHUNK + 3))
        kv = torch.randn(SPEC.shape(len(tokens)))
        assert cache.store(tokens, kv) == 5
        names = store.names()
        assert names[:2] == ["start", "reserve"]
        # batches of store_batch (2) chunks: 2 + 2 + 1
        assert names.count("hand_over") == 3
        assert names.count("acquire_slabs") == 3
        assert sorted(store.held) == sorted(cache.keys(tokens))
        # the same prompt again: the store's lookup says it is all there: no slab taken
        before = len(store.calls)
        assert cache.store(tokens, kv) == 0
        assert store.names()[before:] == ["reserve", "lookup"]
        assert cache.lookup(tokens).num_tokens == 5 * CHUNK
    assert store.names()[-1] == "close"


def test_a_refused_reservation_stores_nothing_and_claims_nothing_held() -> None:
    store = RecordingStore()
    with LMTier(config(), SPEC, store=store, model_id="m") as cache:
        tokens = list(range(3 * CHUNK))
        kv = torch.randn(SPEC.shape(len(tokens)))
        keys = cache.keys(tokens)
        pages = [SPEC.narrow_tokens(kv, at * CHUNK, CHUNK) for at in range(3)]
        store.refuse = True
        before = len(store.calls)
        assert cache.store(tokens, kv) == 0
        assert cache.hold_pages(keys, pages) == 0  # a cache that did not answer holds none
        assert cache.store_pages(keys, pages, skip=1) == 0
        assert store.names()[before:] == ["reserve"] * 3  # no slab asked for, none handed
        assert store.held == {}
        store.refuse = False
        assert cache.hold_pages(keys, pages) == 3
        assert cache.hold_pages(keys, pages) == 3  # held now: stored once
        assert store.names().count("hand_over") == 2  # batches of 2 + 1


def test_bad_arguments_never_reach_the_store() -> None:
    store = RecordingStore()
    with LMTier(config(), SPEC, store=store, model_id="m") as cache:
        before = len(store.calls)
        bad: list[Callable[[], object]] = [
            lambda: cache.lookup_keys([b"short"]),
            lambda: cache.lookup_keys(b"x" * 32),  # bytes, not a sequence of keys
            lambda: cache.load_keys([b"k" * 31]),
            lambda: cache.acquire_slabs(-1),
            lambda: cache.acquire_slabs(True),
            lambda: cache.store_keys([b"k" * 32], torch.zeros(SPEC.shape(CHUNK)), skip=-2),
            lambda: cache.pin_keys("not keys"),
            lambda: cache.unpin_keys([1, 2]),  # type: ignore[list-item]
            lambda: cache.purge(cache_salt=7),  # type: ignore[arg-type]
            lambda: cache.lookup(list(range(40)), skip_tokens=3),
            lambda: cache.lookup(list(range(40)), max_tokens=-1),
        ]
        for call in bad:
            with pytest.raises(InvalidRequestError):
                call()
        with pytest.raises(InvalidKVError):  # kv too short for the chunks
            cache.store(list(range(3 * CHUNK)), torch.zeros(SPEC.shape(CHUNK)))
        assert [n for n in store.names()[before:] if n != "reserve"] == []
        assert cache.acquire_slabs(0) == [] and cache.lookup_keys([]).num_chunks == 0
        assert store.names()[before:].count("reserve") == 0
        assert "acquire_slabs" not in store.names()[before:]


def test_a_closed_or_unstarted_cache_calls_its_store_never_again() -> None:
    store = RecordingStore()
    cache = LMTier(config(), SPEC, store=store, model_id="m")
    with pytest.raises(CacheClosedError, match="not started"):
        cache.lookup(list(range(CHUNK)))
    assert store.calls == []
    cache.start()
    cache.start()  # idempotent: one start
    cache.close()
    cache.close()  # idempotent: one close
    assert store.names() == ["start", "close"]
    for call in (
        lambda: cache.lookup(list(range(CHUNK))),
        lambda: cache.store(list(range(CHUNK)), torch.zeros(SPEC.shape(CHUNK))),
        cache.flush,
        cache.stats,
        cache.check,
        cache.start,
    ):
        with pytest.raises(CacheClosedError):
            call()
    cache.remove_evict_listener(print)  # a no-op once closed
    assert store.names() == ["start", "close"]


def test_check_and_purge_name_the_namespace_of_the_salt() -> None:
    store = RecordingStore()
    with LMTier(config(), SPEC, store=store, model_id="m") as cache:
        assert cache.check("tenant-a") is cache
        cache.purge("tenant-b", dry_run=True)
        (_, (checked,)), (_, (purged, dry)) = store.calls[-2:]
        assert checked == cache.namespace("tenant-a") and checked.cache_salt == "tenant-a"
        assert purged == cache.namespace("tenant-b") and dry is True


def test_the_layout_resolves_every_key_the_facade_made(monkeypatch: pytest.MonkeyPatch) -> None:
    store = RecordingStore()
    with LMTier(config(), SPEC, store=store, model_id="m") as cache:
        assert store.layout is not None
        key = cache.keys(list(range(CHUNK)), cache_salt="s")[0]
        assert store.layout.namespace_of(key[:16]) == cache.namespace("s")
        assert store.layout.base == cache.namespace()
        assert store.layout.chunk_size == CHUNK and store.layout.kv_spec == SPEC
        with pytest.raises(InvalidRequestError, match="no namespace"):
            store.layout.namespace_of(b"\0" * 16)


def test_the_namespace_book_keeps_its_two_views_of_the_same_entries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(namespaces_module, "NAMESPACE_CACHE", 3)
    base = Namespace(model_id="m", num_layers=1, num_kv_heads=1, head_dim=8, chunk_size=16)
    book = Namespaces(base)
    hot = book.get("hot")
    for salt in [f"cold-{i}" for i in range(10)]:
        book.get(salt)
        assert book.get("hot") is hot  # used again: kept, and so is its digest
        assert book.of_digest(hot.digest) is hot
    with pytest.raises(InvalidRequestError):
        book.of_digest(replace(base, cache_salt="cold-0").digest)  # dropped long ago
    assert book.of_digest(book.get("cold-9").digest).cache_salt == "cold-9"
