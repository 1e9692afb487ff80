"""Facade-level rows of the remote-tier benchmarks (bench_redis.py, bench_s3.py): store,
lookup and load through :class:`lmtier.LMTier`, each against a raw client baseline
measured in the same run, and N cold loads of 512 chunks at the default settings.

What each row times, on 2 MiB chunks (a 256-token chunk of a 4-layer, 4-head,
64-dim fp32 model):

* ``store``: ``LMTier.store(tokens, kv)`` then ``flush()`` (slicing, encoding,
  checksums, the queued write-through and its batches) against the raw client
  writing the same number of encoded-size values. Both overwrite keys written once
  before timing (a fresh key costs the server an allocation unrelated to the client).
  ``ratio_vs_copy_then_raw`` compares it with the least any store does: the copy of
  the KV out of the caller's tensor (torch ``copy_``, timed each round) plus the raw
  writes.
* ``lookup``: ``LMTier.lookup(tokens)`` of present chunks (hashing included) against
  the raw client's existence checks of as many keys.
* ``load``: ``LMTier.load(tokens)`` (reads the remote tier directly) against the
  raw client reading as many values into preallocated buffers; ``lookup`` +
  ``load_keys`` (what an engine that looked up first does) against the raw client's
  existence checks followed by its reads.

The timed rows use one cache each with the CPU tier off and staging memory for the
whole prompt, so every repetition goes to the remote tier and lands in slabs already
touched by the warm-up run, as the raw baseline's buffers are (first touches of fresh
memory run at 1.5 GB/s here). Remote-tier settings are the defaults. Cache and raw
runs alternate; medians are reported; a ratio is the cache's throughput over raw's.

``defaults``: the prompt is stored at the defaults in one ``store()`` with the CPU
tier on (the row counts the chunks its remote tier dropped: back-pressure should
leave none), then ``reps`` times a new
cache at the defaults (CPU tier on, empty) looks up the 512 chunks and loads them
(``load`` reads the remote tier itself, whatever the lookup found); the row lists
the chunks found and loaded each time. ``--contend N`` (the scripts) keeps N cores
busy (spinning processes) for the whole benchmark, as an inference engine beside the
cache does.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.config import CPUTierConfig, DiskTierConfig

SPEC = KVSpec(num_layers=4, num_kv_heads=4, head_dim=64)
CHUNK_TOKENS = 256
CHUNK_BYTES = SPEC.encoded_chunk_bytes(CHUNK_TOKENS)
DEFAULTS_CHUNKS = 512


@dataclass(frozen=True, slots=True)
class RawClient:
    """The baseline: plain client calls on ``count`` values of the chunks' size, under
    names of its own. ``put`` writes them all, ``get`` reads them all into buffers
    (the client's own, allocated once), ``exists`` checks them all."""

    put: Callable[[], None]
    get: Callable[[], None]
    exists: Callable[[], None]


Sections = Callable[[LMTierConfig], LMTierConfig]
"""Adds the remote tier's section(s) to a config: ``base.replace(redis=...)``."""


LOOKUP_ROUNDS = 10
"""Lookups timed per round (each side), against one store and one load."""


def _config(with_remote: Sections, num_chunks: int, *, cpu: bool) -> LMTierConfig:
    if cpu:
        memory = CPUTierConfig(capacity_bytes=(num_chunks + 8) * CHUNK_BYTES)
    else:  # every load goes to the remote tier, into slabs the warm-up touched; writes
        # queued for a tier may hold half the pool, so a whole prompt's writes fit
        memory = CPUTierConfig(enabled=False, staging_bytes=2 * (num_chunks + 8) * CHUNK_BYTES)
    base = LMTierConfig(chunk_size=CHUNK_TOKENS, cpu=memory, disk=DiskTierConfig(enabled=False))
    return with_remote(base)


def _prompt(num_chunks: int, seed: int) -> tuple[list[int], torch.Tensor]:
    tokens = list(range(seed * 10**7, seed * 10**7 + num_chunks * CHUNK_TOKENS))
    kv = torch.randn(SPEC.shape(len(tokens)), generator=torch.Generator().manual_seed(seed))
    return tokens, kv


def _seconds(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def facade_rows(
    with_remote: Sections, tier: str, raw: RawClient, num_chunks: int, reps: int
) -> dict[str, Any]:
    """Store, lookup and load through the facade against ``raw``; medians and ratios."""
    tokens, kv = _prompt(num_chunks, seed=1)
    nbytes = num_chunks * CHUNK_BYTES
    times: dict[str, list[float]] = {}
    with LMTier.open(_config(with_remote, num_chunks, cpu=False), kv=SPEC, model_id="b") as cache:

        def store() -> None:
            assert cache.store(tokens, kv) == num_chunks
            cache.flush()

        def lookup() -> None:
            assert cache.lookup(tokens).num_tokens == len(tokens)

        def load() -> None:
            with cache.load(tokens) as hit:
                assert hit.num_tokens == len(tokens), hit.num_tokens

        def lookup_load_keys() -> None:
            found = cache.lookup(tokens)
            with cache.load_keys(found.keys, found.lookup) as hit:
                assert hit.num_tokens == len(tokens), hit.num_tokens

        def raw_exists_get() -> None:
            raw.exists()
            raw.get()

        # What any store must do besides the raw writes: copy the KV out of the
        # caller's tensor (timed apart each round; the floor is copy + raw put).
        places = [torch.empty(SPEC.shape(CHUNK_TOKENS)) for _ in range(num_chunks)]

        def copy_out() -> None:
            for index, place in enumerate(places):
                place.copy_(kv.narrow(SPEC.token_axis, index * CHUNK_TOKENS, CHUNK_TOKENS))

        cases: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {
            "store": (store, raw.put),
            "lookup": (lookup, raw.exists),
            "load": (load, raw.get),
            "lookup_then_load_keys": (lookup_load_keys, raw_exists_get),
        }
        for facade, baseline in cases.values():  # warm-up: keys exist, slabs touched
            facade()
            baseline()
        copy_out()
        puts = cache.stats()[tier]["puts"]
        for _ in range(reps):
            for name, (facade, baseline) in cases.items():
                # A lookup takes under a millisecond: a few of them per round, or one
                # preemption by another process decides the median.
                for _ in range(LOOKUP_ROUNDS if name == "lookup" else 1):
                    times.setdefault(name, []).append(_seconds(facade))
                    times.setdefault(f"{name}_raw", []).append(_seconds(baseline))
            times.setdefault("copy_out", []).append(_seconds(copy_out))
        stats = cache.stats()[tier]
        assert stats["puts"] - puts == reps * num_chunks and stats["errors"] == 0, stats
    median = {name: statistics.median(values) for name, values in times.items()}
    rows: dict[str, Any] = {"chunks": num_chunks, "chunk_bytes": CHUNK_BYTES}
    for name in cases:
        facade_s, raw_s = median[name], median[f"{name}_raw"]
        rows[name] = {
            "facade_ms": round(facade_s * 1e3, 2),
            "raw_ms": round(raw_s * 1e3, 2),
            "ratio": round(raw_s / facade_s, 3),  # facade throughput over raw's
        }
        if name != "lookup":
            rows[name]["facade_gbps"] = round(nbytes / facade_s / 1e9, 3)
            rows[name]["raw_gbps"] = round(nbytes / raw_s / 1e9, 3)
    floor = [c + r for c, r in zip(times["copy_out"], times["store_raw"], strict=True)]
    rows["store"]["copy_then_raw_ms"] = round(statistics.median(floor) * 1e3, 2)
    rows["store"]["ratio_vs_copy_then_raw"] = round(statistics.median(floor) / median["store"], 3)
    return rows


def defaults_row(with_remote: Sections, tier: str, reps: int) -> dict[str, Any]:
    """``reps`` cold lookups and loads of 512 chunks by caches at the default settings."""
    tokens, kv = _prompt(DEFAULTS_CHUNKS, seed=2)
    # One store of the whole prompt into a CPU tier that holds it, the remote tier
    # behind it: its write queue takes at most half the pool, so the store waits for
    # room (write_wait_s) rather than drop what the tier is slower to take.
    config = _config(with_remote, DEFAULTS_CHUNKS, cpu=True)
    with LMTier.open(config, kv=SPEC, model_id="b") as cache:
        started = time.perf_counter()
        stored = cache.store(tokens, kv)
        cache.flush()
        store_s = time.perf_counter() - started
        stats = cache.stats()[tier]
        store_drops = int(stats["queue_drops"] or 0)
        assert stats["puts"] == stored == DEFAULTS_CHUNKS, (stored, stats)
    found, loaded, lookup_s, load_s, errors = [], [], [], [], []
    for _ in range(reps):  # a new cache each time: nothing in its CPU tier
        config = _config(with_remote, DEFAULTS_CHUNKS, cpu=True)
        with LMTier.open(config, kv=SPEC, model_id="b") as cache:
            started = time.perf_counter()
            found.append(cache.lookup(tokens).num_chunks)  # promotes nothing
            lookup_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            with cache.load(tokens) as result:
                load_s.append(time.perf_counter() - started)
                loaded.append(result.num_tokens // CHUNK_TOKENS)
            errors.append(cache.stats()[tier]["errors"])
    return {
        "chunks": DEFAULTS_CHUNKS,
        "store_dropped": store_drops,
        "store_s": round(store_s, 3),
        "found_each_time": found,
        "loaded_each_time": loaded,
        "errors_each_time": errors,  # failed or timed-out calls, lookup and load
        "all_complete": all(n == DEFAULTS_CHUNKS for n in found + loaded),
        "lookup_s_median": round(statistics.median(lookup_s), 3),
        "load_s_median": round(statistics.median(load_s), 3),
    }
