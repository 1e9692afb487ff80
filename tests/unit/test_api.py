"""The LMTier facade on the CPU tier alone: store, lookup, load, isolation, threads."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.config import CPUTierConfig, DiskTierConfig
from lmtier.errors import CacheClosedError, InvalidTokensError

CHUNK = 32
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8)
STAGING = 8 << 20
"""Staging slabs: enough for the tests' loads, and a pool touched at open in a blink
(the default 256 MiB took most of a test's time)."""


def config(cpu_bytes: int = 8 << 20) -> LMTierConfig:
    return LMTierConfig(
        chunk_size=CHUNK,
        cpu=CPUTierConfig(capacity_bytes=cpu_bytes, staging_bytes=STAGING),
        disk=DiskTierConfig(enabled=False),
    )


@pytest.fixture
def cache() -> Iterator[LMTier]:
    with LMTier.open(config(), kv=SPEC, model_id="tiny") as opened:
        yield opened


def kv_for(num_tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(SPEC.shape(num_tokens), generator=torch.Generator().manual_seed(seed))


def test_store_then_load_returns_the_same_kv(cache: LMTier) -> None:
    prompt = list(range(100))
    kv = kv_for(100)
    assert cache.lookup(prompt).num_tokens == 0
    assert cache.store(prompt, kv) == 3
    found = cache.lookup(prompt)
    assert found.num_tokens == 96
    assert found.tokens_by_tier(CHUNK) == {"cpu": 96}
    with cache.load(prompt) as loaded:
        assert loaded.num_tokens == 96
        assert torch.equal(loaded.kv(), kv[:, :, :96])
        assert loaded.tokens_by_tier() == {"cpu": 96}
        into = torch.empty(SPEC.shape(96))
        assert loaded.kv(out=into) is into
        assert torch.equal(into, kv[:, :, :96])


def test_a_miss_loads_the_kv_of_no_tokens(cache: LMTier) -> None:
    """Code that uses the loaded prefix (compares it, concatenates the rest to it) runs
    unchanged when nothing is cached: kv() is 0 tokens of the spec's shape, not None."""
    prompt = list(range(100))
    with cache.load(prompt) as loaded:
        assert loaded.num_tokens == 0
        empty = loaded.kv()
        assert empty.shape == SPEC.shape(0) and empty.dtype == torch.float32
        assert torch.equal(empty, kv_for(100)[:, :, : loaded.num_tokens])
        into = torch.empty(SPEC.shape(0))
        assert loaded.kv(out=into).shape == SPEC.shape(0)
    paged = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, layout="LBHSC", block_size=16)
    with LMTier.open(config(), kv=paged, model_id="tiny") as blocks, blocks.load(prompt) as hit:
        assert hit.kv().shape == paged.shape(0)


def test_store_skips_chunks_already_cached(cache: LMTier) -> None:
    prompt = list(range(64))
    assert cache.store(prompt, kv_for(64)) == 2
    longer = [*prompt, *range(500, 532)]
    assert cache.store(longer, kv_for(96, seed=1)) == 1
    assert cache.lookup(longer).num_tokens == 96


def test_max_tokens_keeps_the_last_token_for_recompute(cache: LMTier) -> None:
    prompt = list(range(64))
    cache.store(prompt, kv_for(64))
    assert cache.lookup(prompt, max_tokens=63).num_tokens == 32
    with cache.load(prompt, max_tokens=63) as loaded:
        assert loaded.num_tokens == 32


def test_cache_salt_isolates_tenants(cache: LMTier) -> None:
    prompt = list(range(64))
    cache.store(prompt, kv_for(64), cache_salt="tenant-a")
    assert cache.lookup(prompt, cache_salt="tenant-a").num_tokens == 64
    assert cache.lookup(prompt, cache_salt="tenant-b").num_tokens == 0
    assert cache.lookup(prompt).num_tokens == 0


def test_another_model_never_matches() -> None:
    prompt = list(range(64))
    with LMTier.open(config(), kv=SPEC, model_id="a") as a:
        a.store(prompt, kv_for(64))
        keys_a = a.keys(prompt)
    with LMTier.open(config(), kv=SPEC, model_id="b") as b:
        assert set(b.keys(prompt)).isdisjoint(keys_a)


def test_bad_inputs_are_clear_errors(cache: LMTier) -> None:
    with pytest.raises(InvalidTokensError):
        cache.lookup([1, -1])
    with pytest.raises(ValueError, match="covers 10 tokens"):
        cache.store(list(range(64)), kv_for(10))
    with pytest.raises(ValueError, match="shape"):
        cache.store(list(range(32)), torch.zeros(3, 2, 32, 2, 8))


def test_loads_pin_slabs_until_released() -> None:
    # CPU tier of 2 chunks: a held load keeps its chunks; new stores evict others.
    slab = SPEC.encoded_chunk_bytes(CHUNK)
    with LMTier.open(config(cpu_bytes=2 * slab + 4096), kv=SPEC, model_id="m") as cache:
        first = list(range(32))
        cache.store(first, kv_for(32))
        held = cache.load(first)
        for seed in range(1, 4):
            cache.store(list(range(seed * 1000, seed * 1000 + 32)), kv_for(32, seed))
        assert cache.lookup(first).num_tokens == 32  # in use: never evicted
        assert torch.equal(held.kv(), kv_for(32)[:, :, :32])
        held.release()
        held.release()  # idempotent


def test_many_threads_store_and_load_without_torn_chunks(cache: LMTier) -> None:
    prompts = [list(range(i * 7, i * 7 + 96)) for i in range(6)]  # overlapping token ranges
    kvs = [kv_for(96, seed=i) for i in range(6)]
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            for round_ in range(15):
                which = (index + round_) % 6
                cache.store(prompts[which], kvs[which])
                with cache.load(prompts[which]) as loaded:
                    assert loaded.num_tokens == 96
                    assert torch.equal(loaded.kv(), kvs[which][:, :, :96])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    memory = cache.host_memory()
    assert memory.slabs_in_use == memory.cached_chunks  # every load released


def test_closed_cache_refuses_work() -> None:
    cache = LMTier.open(config(), kv=SPEC, model_id="m")
    cache.close()
    cache.close()
    with pytest.raises(CacheClosedError, match="closed"):
        cache.lookup(list(range(32)))
    assert issubclass(CacheClosedError, RuntimeError)  # generic callers keep working


def test_store_from_per_layer_pairs_equals_store_from_one_tensor() -> None:
    prompt = list(range(64))
    kv = kv_for(64)
    # Per-layer (K, V) views shaped (tokens, heads, dim), as an engine's cache holds them.
    pairs = [(kv[layer, 0], kv[layer, 1]) for layer in range(SPEC.num_layers)]
    with LMTier.open(config(), kv=SPEC, model_id="pairs") as cache:
        assert cache.store(prompt, pairs) == 2
        with cache.load(prompt) as loaded:
            assert torch.equal(loaded.kv(), kv)
    with (
        LMTier.open(config(), kv=SPEC, model_id="pairs") as cache,
        pytest.raises(ValueError, match="layers"),
    ):
        cache.store(prompt, pairs[:1])


def test_skip_tokens_starts_the_walk_at_a_chunk(cache: LMTier) -> None:
    prompt = list(range(128))
    kv = kv_for(128)
    cache.store(prompt, kv)
    assert cache.lookup(prompt, skip_tokens=64).num_tokens == 64
    with cache.load(prompt, skip_tokens=32, max_tokens=127) as loaded:
        assert loaded.num_tokens == 64  # chunks 1 and 2; chunk 3 holds the last token
        assert torch.equal(loaded.kv(), kv[:, :, 32:96])
    with pytest.raises(ValueError, match="multiple of the chunk size"):
        cache.lookup(prompt, skip_tokens=10)
