"""The facade against hostile or careless callers: every bad argument is a typed lmtier
error with a one-line message and loses nothing; geometry and model identity keep
caches apart; host memory stays what the config says; leaks are reclaimed."""

from __future__ import annotations

import gc
import logging
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.config import CPUTierConfig, DiskTierConfig
from lmtier.errors import (
    CacheClosedError,
    CapacityError,
    ConfigError,
    InvalidKVError,
    InvalidRequestError,
    InvalidTokensError,
    LMTierError,
)

CHUNK = 32
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8)
SLAB = SPEC.encoded_chunk_bytes(CHUNK)


def config(cpu_chunks: int = 64, staging_chunks: int = 8, **cpu: Any) -> LMTierConfig:
    return LMTierConfig(
        chunk_size=CHUNK,
        cpu=CPUTierConfig(
            capacity_bytes=cpu_chunks * SLAB, staging_bytes=staging_chunks * SLAB, **cpu
        ),
        disk=DiskTierConfig(enabled=False),
    )


def kv_for(num_tokens: int, spec: KVSpec = SPEC, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(spec.shape(num_tokens), generator=gen).to(getattr(torch, spec.dtype))


@pytest.fixture
def cache() -> Iterator[LMTier]:
    with LMTier.open(config(), kv=SPEC, model_id="m") as opened:
        yield opened


PROMPT = list(range(96))
KV = kv_for(96)
LAYERS = [(KV[layer, 0], KV[layer, 1]) for layer in range(SPEC.num_layers)]

BAD_STORES: dict[str, tuple[Callable[[LMTier], object], type[LMTierError], str]] = {
    "another dtype": (lambda c: c.store(PROMPT, KV.double()), InvalidKVError, "dtype"),
    "bfloat16 for fp32": (lambda c: c.store(PROMPT, KV.bfloat16()), InvalidKVError, "dtype"),
    "smaller K broadcast": (
        lambda c: c.store(PROMPT, [(k[:1], v) for k, v in LAYERS]),
        InvalidKVError,
        "cover",
    ),
    "V shorter than K": (
        lambda c: c.store(PROMPT, [(k, v[:40]) for k, v in LAYERS]),
        InvalidKVError,
        "cover",
    ),
    "heads of another model": (
        lambda c: c.store(PROMPT, kv_for(96, KVSpec(2, 4, 8))),
        InvalidKVError,
        "shape",
    ),
    "numpy array": (lambda c: c.store(PROMPT, KV.numpy()), InvalidKVError, "torch.Tensor"),
    "None": (lambda c: c.store(PROMPT, None), InvalidKVError, "torch.Tensor"),  # type: ignore[arg-type]
    "meta tensor": (lambda c: c.store(PROMPT, KV.to("meta")), InvalidKVError, "meta"),
    "sparse tensor": (lambda c: c.store(PROMPT, KV.to_sparse()), InvalidKVError, "dense"),
    "too few tokens": (lambda c: c.store(PROMPT, KV[:, :, :50]), InvalidKVError, "covers"),
    "one layer": (lambda c: c.store(PROMPT, LAYERS[:1]), InvalidKVError, "layers"),
    "pairs of three": (
        lambda c: c.store(PROMPT, [(k, v, v) for k, v in LAYERS]),  # type: ignore[misc]
        InvalidKVError,
        "pair",
    ),
    "True as a token": (lambda c: c.store([True, *PROMPT[1:]], KV), InvalidTokensError, "bool"),
    "salt 123": (lambda c: c.store(PROMPT, KV, cache_salt=123), InvalidRequestError, "cache_salt"),  # type: ignore[arg-type]
    "extras dict": (lambda c: c.lookup(PROMPT, extras={"lora": 1}), InvalidRequestError, "extras"),  # type: ignore[arg-type]
    "max_tokens 1.5": (lambda c: c.load(PROMPT, max_tokens=1.5), InvalidRequestError, "max_tokens"),  # type: ignore[arg-type]
    "max_tokens True": (
        lambda c: c.lookup(PROMPT, max_tokens=True),
        InvalidRequestError,
        "max_tokens",
    ),
    "max_tokens -1": (lambda c: c.lookup(PROMPT, max_tokens=-1), InvalidRequestError, "max_tokens"),
    "skip_tokens '32'": (
        lambda c: c.lookup(PROMPT, skip_tokens="32"),
        InvalidRequestError,
        "skip_tokens",
    ),  # type: ignore[arg-type]
    "skip_tokens None": (
        lambda c: c.load(PROMPT, skip_tokens=None),
        InvalidRequestError,
        "skip_tokens",
    ),  # type: ignore[arg-type]
    "keys of 16 bytes": (lambda c: c.lookup_keys([b"x" * 16]), InvalidRequestError, "32 bytes"),
    "keys as bytes": (lambda c: c.load_keys(b"x" * 32), InvalidRequestError, "sequence"),  # type: ignore[arg-type]
    "acquire -1": (lambda c: c.acquire_slabs(-1), InvalidRequestError, "count"),
}


@pytest.mark.parametrize("case", sorted(BAD_STORES))
def test_bad_arguments_are_typed_one_line_errors_that_lose_nothing(
    cache: LMTier, case: str
) -> None:
    call, error, words = BAD_STORES[case]
    assert cache.store(PROMPT, KV) == 3
    before = cache.stats()["cpu"]
    with pytest.raises(error, match=words) as info:
        call(cache)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, (ValueError, TypeError))  # generic callers still catch it
    after = cache.stats()["cpu"]
    assert (after["puts"], after["evictions"]) == (before["puts"], before["evictions"])
    with cache.load(PROMPT) as hit:  # what was cached is still there, unchanged
        assert torch.equal(hit.kv(), KV)
    memory = cache.host_memory()
    assert memory.slabs_in_use == memory.cached_chunks


def test_numpy_bool_tokens_and_mixed_lists_are_refused() -> None:
    with LMTier.open(config(), kv=SPEC, model_id="m") as cache:
        for tokens in ([1, 2, False], np.array([True, False]), [np.True_, 1]):
            with pytest.raises(InvalidTokensError):
                cache.keys(tokens)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({}, "model_id is required"),
        ({"model_id": "  "}, "model_id is required"),
        ({"model_id": 123}, "model_id must be a str"),
        ({"model_id": "m", "model_revision": 7}, "model_revision must be a str"),
        ({"model_id": "m", "tp_size": 2, "tp_rank": 2}, "tp_rank"),
        ({"model_id": "m", "vocab_size": 0}, "vocab_size"),
    ],
)
def test_a_cache_needs_a_model_identity(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(LMTierError, match=words):
        LMTier(config(), SPEC, **kwargs)


def test_a_weights_fingerprint_names_a_model_too() -> None:
    with LMTier.open(config(), kv=SPEC, model_revision="sha256:ab12") as cache:
        assert cache.store(PROMPT, KV) == 3


def test_caches_of_other_geometries_never_share_keys() -> None:
    specs = [SPEC, KVSpec(3, 2, 8), KVSpec(2, 1, 8), KVSpec(2, 2, 16), KVSpec(2, 2, 8, "float16")]
    keys = set()
    for spec in specs:
        with LMTier.open(config(), kv=spec, model_id="same-name") as cache:
            keys.add(cache.keys(PROMPT)[0])
    assert len(keys) == len(specs)


def test_host_memory_is_capacity_plus_staging_and_nothing_more(tmp_path: Path) -> None:
    stride = -(-SLAB // 64) * 64  # the payload's alignment: no page per chunk
    with LMTier.open(config(cpu_chunks=10, staging_chunks=3), kv=SPEC, model_id="m") as cache:
        assert cache.host_memory().total_bytes == 13 * stride
    # Slabs that O_DIRECT reads land in are whole pages.
    direct = config(cpu_chunks=10, staging_chunks=3).replace(
        disk=DiskTierConfig(path=tmp_path, o_direct=True)
    )
    page = -(-SLAB // 4096) * 4096
    with LMTier.open(direct, kv=SPEC, model_id="m") as cache:
        assert cache.host_memory().slab_bytes == page
    off = config(cpu_chunks=10, staging_chunks=3, enabled=False)
    with LMTier.open(off, kv=SPEC, model_id="m") as cache:
        assert cache.host_memory().total_bytes == 3 * stride
        assert cache.store(PROMPT, KV) == 3  # staged, nothing cached in host memory
    with pytest.raises(ConfigError, match="staging_bytes"):
        LMTier.open(config(cpu_chunks=0, staging_chunks=0), kv=SPEC, model_id="m")


def test_more_host_memory_than_the_machine_has_is_a_capacity_error() -> None:
    huge = LMTierConfig(
        chunk_size=CHUNK,
        cpu=CPUTierConfig(capacity_bytes=2**55),
        disk=DiskTierConfig(enabled=False),
    )
    with pytest.raises(CapacityError, match="more than this machine"):
        LMTier.open(huge, kv=SPEC, model_id="m")


def test_per_tenant_state_is_bounded() -> None:
    with LMTier.open(config(), kv=SPEC, model_id="m") as cache:
        cache.namespace("warm-up")
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for tenant in range(30_000):
                cache.namespace(f"tenant-{tenant}")
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert grown < 2 << 20  # unbounded: ~250 bytes per tenant, 7.5 MB here


def test_use_after_close_is_a_cache_closed_error(cache: LMTier) -> None:
    cache.close()
    for call in (
        lambda: cache.lookup(PROMPT),
        lambda: cache.store(PROMPT, KV),
        lambda: cache.load(PROMPT),
        cache.stats,
        cache.start,
    ):
        with pytest.raises(CacheClosedError, match="closed"):
            call()


def test_a_dropped_load_result_gives_its_slabs_back(caplog: pytest.LogCaptureFixture) -> None:
    with LMTier.open(config(cpu_chunks=4, staging_chunks=2), kv=SPEC, model_id="m") as cache:
        prompts = [list(range(i * 1000, i * 1000 + 96)) for i in range(10)]
        with caplog.at_level(logging.WARNING, logger="lmtier"):
            for index, prompt in enumerate(prompts):
                cache.store(prompt, kv_for(96, seed=index))
                cache.load(prompt)  # never released
                gc.collect()
        assert cache.store(list(range(99_000, 99_096)), KV) == 3  # slabs came back
        leaks = [r for r in caplog.records if "never released" in r.getMessage()]
        assert leaks and __file__ in leaks[0].getMessage()


def test_views_of_a_dropped_load_result_keep_its_slabs() -> None:
    with LMTier.open(config(cpu_chunks=3, staging_chunks=1), kv=SPEC, model_id="m") as cache:
        cache.store(PROMPT, KV)
        views = cache.load(PROMPT).tensors()  # the result itself is dropped at once
        gc.collect()
        for seed in range(5):  # churn the pool: the viewed slabs must not be reused
            cache.store(list(range(5000 + 96 * seed, 5096 + 96 * seed)), kv_for(96, seed=seed))
        assert torch.equal(torch.cat(views, dim=2), KV)
        del views
        gc.collect()
        memory = cache.host_memory()
    assert memory.slabs_in_use == memory.cached_chunks


def test_host_memory_of_a_large_model_with_a_small_cpu_tier_stays_small() -> None:
    # Half an 8B model's KV geometry: 16 MiB chunks. With a 64 MiB CPU tier the pool
    # used to add 128 staging chunks (+2.1 GB); staging is now bytes, 256 MiB by default.
    spec = KVSpec(num_layers=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    cfg = LMTierConfig(
        cpu=CPUTierConfig(capacity_bytes=64 << 20), disk=DiskTierConfig(enabled=False)
    )
    with LMTier.open(cfg, kv=spec, model_id="llama-ish") as cache:
        assert cache.host_memory().total_bytes <= (64 << 20) + (256 << 20)
        assert cache.host_memory().total_bytes >= 4 * spec.encoded_chunk_bytes(256)
