"""CPU tier throughput against memcpy, and waterfall lookup latency, in one run.

Measures:
  * CPU tier put and get (``get_into``: a copy out) GB/s for 2 MiB chunks, against
    memcpy of the same bytes into preallocated, already touched memory (the bound);
    and the StorageManager's zero-copy get of CPU hits (no bytes move at all).
  * Lookup of a 32k-token prompt (128 chunks of 256, all present, half in the CPU
    tier and half on disk), hashing included: through the facade's thread-safe path
    and on the loop. Target <= 100 us (LMCache: ~350 us, DESIGN.md section 10).
  * Lookup of 512 chunks (no hashing), and index memory per chunk for both tiers.
  * What a user calls, ``LMTier`` on the CPU tier (2 MiB chunks of a KVSpec(8, 2, 64)
    fp32 model, 32 chunks a call): ``store()`` against ``copy_`` of the same strided
    source into preallocated tensors (target >= 0.85x); ``load()`` of the same prefix
    (zero-copy views), and ``load().kv(out=)`` (one copy into the caller's tensor)
    against ``copy_`` of the whole KV into that tensor;
    ``lookup()`` of a 32k-token prompt given as a Python list and as a numpy array,
    against LMCache's own list keying re-done here (a tuple and Python's ``hash`` per
    256-token chunk, its default "builtin" algorithm; no storage lookup included).

Usage: python benchmarks/bench_storage.py [--quick] [--contend N]   (last line: one JSON object)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import tracemalloc

import numpy as np
import torch
from bench_common import add_contend_argument, contend, contention_of, median_s, paired_median_s

from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.chunks.hashers import chunk_keys
from lmtier.chunks.keys import ChunkKey, Namespace
from lmtier.config import CPUTierConfig, DiskTierConfig
from lmtier.runtime import Runtime
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.host_pool import HostPool
from lmtier.storage.manager import StorageManager
from lmtier.testing import make_chunk, random_key
from lmtier_backends.disk.tier import DiskTier

CHUNK_TOKENS = 256
HIDDEN = 1024  # 2 (K, V) x 256 tokens x 1024 floats x 4 bytes = 2 MiB payload


def bench_cpu_tier(num_chunks: int, repeats: int) -> dict[str, float]:
    chunks = [make_chunk(num_tokens=CHUNK_TOKENS, hidden=HIDDEN, seed=i) for i in range(num_chunks)]
    size = len(chunks[0][1])
    total = size * num_chunks
    pool = HostPool(size, num_chunks + 1)  # zeroed at start: every slab already touched
    tier = CPUTier(pool)
    loop = asyncio.new_event_loop()
    dests = [memoryview(bytearray(size)) for _ in range(num_chunks)]
    sources = [memoryview(data) for _, data in chunks]

    def memcpy() -> None:
        for dest, src in zip(dests, sources, strict=True):
            dest[:] = src

    def put() -> None:
        loop.run_until_complete(tier.delete([key for key, _ in chunks]))
        loop.run_until_complete(tier.put(chunks))

    keys = [key for key, _ in chunks]
    put()

    def get_into() -> None:
        loop.run_until_complete(tier.get_into(keys, dests))

    manager = StorageManager(tier)

    def zero_copy_get() -> None:
        for chunk in loop.run_until_complete(manager.get(keys)):
            chunk.release()

    memcpy_s = median_s(memcpy, repeats)
    put_s = median_s(put, repeats)
    get_s = median_s(get_into, repeats)
    zero_s = median_s(zero_copy_get, repeats)
    loop.run_until_complete(tier.close())
    loop.close()
    pool.close()
    gbps = total / 1e9
    return {
        "chunk_bytes": size,
        "memcpy_gb_s": round(gbps / memcpy_s, 2),
        "cpu_put_gb_s": round(gbps / put_s, 2),
        "cpu_get_into_gb_s": round(gbps / get_s, 2),
        "cpu_put_vs_memcpy": round(memcpy_s / put_s, 3),
        "cpu_get_into_vs_memcpy": round(memcpy_s / get_s, 3),
        "zero_copy_get_us_per_chunk": round(zero_s / num_chunks * 1e6, 2),
    }


def bench_lookup(repeats: int) -> dict[str, float]:
    namespace = Namespace(model_id="bench", chunk_size=CHUNK_TOKENS)
    prompt = np.random.default_rng(0).integers(0, 128_000, size=32 * 1024, dtype=np.int64)
    keys = chunk_keys(prompt, namespace)
    workdir = tempfile.mkdtemp(prefix="lmtier-bench-")
    runtime = Runtime().start()
    small = [make_chunk(key, num_tokens=4, hidden=16) for key in keys]
    many = [random_key() for _ in range(512)]
    extra = [make_chunk(key, num_tokens=4, hidden=16) for key in many]

    async def setup() -> StorageManager:
        pool = HostPool(16 * 1024, 1200)
        cpu_tier = CPUTier(pool)
        disk = await DiskTier.open(workdir, 1 << 30, fsync=False)
        await cpu_tier.put(small[:64] + extra[:256])
        await disk.put(small[64:] + extra[256:])
        manager = StorageManager(cpu_tier, [disk])
        await manager.start()
        return manager

    manager = runtime.run(setup())

    def facade_path() -> None:
        found = manager.lookup_now(chunk_keys(prompt, namespace))
        assert found is not None
        assert found.num_chunks == 128

    async def on_loop(keys_: list[ChunkKey]) -> int:
        return (await manager.lookup(keys_)).num_chunks

    def loop_path() -> None:
        assert runtime.run(on_loop(chunk_keys(prompt, namespace))) == 128

    def lookup_512() -> None:
        found = manager.lookup_now(many)
        assert found is not None
        assert found.num_chunks == 512

    hash_s = median_s(lambda: chunk_keys(prompt, namespace), repeats)
    facade_s = median_s(facade_path, repeats)
    loop_s = median_s(loop_path, repeats)
    many_s = median_s(lookup_512, repeats)
    runtime.run(manager.close())
    runtime.stop()

    # CPU tier index memory per chunk: entries for 5000 cached (tiny) chunks.
    pool = HostPool(8192, 5000)
    tier = CPUTier(pool)
    handles = [pool.acquire() for _ in range(5000)]
    index_keys = [random_key() for _ in range(5000)]
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for key, handle in zip(index_keys, handles, strict=True):
        assert handle is not None
        tier.adopt(key, handle, 8192)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    cpu_index_bytes = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    asyncio.run(tier.close())
    pool.close()
    shutil.rmtree(workdir, ignore_errors=True)
    return {
        "lookup_32k_tokens_us": round(facade_s * 1e6, 1),
        "lookup_32k_tokens_on_loop_us": round(loop_s * 1e6, 1),
        "hash_32k_tokens_us": round(hash_s * 1e6, 1),
        "lookup_512_chunks_us": round(many_s * 1e6, 1),
        "cpu_index_bytes_per_chunk": round(cpu_index_bytes / len(index_keys), 1),
        "target_lookup_32k_us": 100,
    }


def lmcache_style_keys(tokens: list[int], chunk: int) -> list[int]:
    """LMCache's keys of a token list with its default ``builtin`` hash: per chunk, a
    tuple of the ids and ``hash((prefix hash, ids, extra keys))`` (its ChunkedTokenDatabase,
    re-done here as the baseline; LMCache itself is not installed)."""
    prefix, out = 0, []
    for start in range(0, len(tokens) - chunk + 1, chunk):
        prefix = hash((prefix, tuple(tokens[start : start + chunk]), ()))
        out.append(prefix)
    return out


def bench_facade(num_chunks: int, repeats: int) -> dict[str, float]:
    """``LMTier`` on the CPU tier: store, load and lookup against their baselines."""
    spec, chunk = KVSpec(num_layers=8, num_kv_heads=2, head_dim=64), CHUNK_TOKENS
    slab = spec.encoded_chunk_bytes(chunk)
    config = LMTierConfig(
        chunk_size=chunk,
        cpu=CPUTierConfig(capacity_bytes=4 * num_chunks * slab, staging_bytes=num_chunks * slab),
        disk=DiskTierConfig(enabled=False),
    )
    tokens = num_chunks * chunk
    kv = torch.randn(spec.shape(tokens))
    dests = [torch.empty(spec.shape(chunk)) for _ in range(num_chunks)]
    prompts = iter([np.arange(i * tokens, (i + 1) * tokens) for i in range(4 * repeats + 4)])
    rng = np.random.default_rng(1)
    long_list = rng.integers(0, 128_000, size=32 * 1024).tolist()
    long_array = np.asarray(long_list)
    with LMTier.open(config, kv=spec, model_id="bench") as cache:

        def copy() -> None:
            for i, dest in enumerate(dests):
                dest.copy_(kv.narrow(spec.token_axis, i * chunk, chunk))

        def store() -> None:  # a new prompt each time: every chunk is stored
            assert cache.store(next(prompts), kv) == num_chunks

        copy_s, store_s = paired_median_s(copy, store, repeats)
        cached = np.arange(tokens)
        cache.store(cached, kv)

        def load() -> None:
            with cache.load(cached) as loaded:
                assert loaded.num_tokens == tokens

        whole = torch.empty(spec.shape(tokens))

        def copy_whole() -> None:
            whole.copy_(kv)

        def load_kv() -> None:  # into the caller's tensor, as an engine copies into its KV
            with cache.load(cached) as loaded:
                assert loaded.kv(out=whole) is not None

        load_s = median_s(load, repeats)
        copy2_s, load_kv_s = paired_median_s(copy_whole, load_kv, repeats)
        list_s = median_s(lambda: cache.lookup(long_list), repeats * 10)
        array_s = median_s(lambda: cache.lookup(long_array), repeats * 10)
        lmcache_s = median_s(lambda: lmcache_style_keys(long_list, chunk), repeats * 10)
    return {
        "facade_chunk_bytes": slab,
        "facade_store_gb_s": round(tokens * spec.bytes_per_token / store_s / 1e9, 2),
        "facade_store_vs_copy": round(copy_s / store_s, 3),
        "facade_load_us_per_chunk": round(load_s / num_chunks * 1e6, 2),
        "facade_load_kv_vs_copy": round(copy2_s / load_kv_s, 3),
        "lookup_32k_list_us": round(list_s * 1e6, 1),
        "lookup_32k_array_us": round(array_s * 1e6, 1),
        "lmcache_keying_32k_list_us": round(lmcache_s * 1e6, 1),
        "lookup_list_vs_lmcache_keying": round(lmcache_s / list_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer chunks and repeats (< 60 s)")
    add_contend_argument(parser)
    args = parser.parse_args()
    num_chunks, repeats = (32, 7) if args.quick else (96, 15)
    results: dict[str, object] = {"benchmark": "storage", "contend": contention_of(args)}
    with contend(contention_of(args)):
        results.update(bench_cpu_tier(num_chunks, repeats))
        results.update(bench_lookup(repeats * 20))
        results.update(bench_facade(num_chunks, repeats * 3))
    results["target_met"] = (
        float(results["cpu_put_vs_memcpy"]) >= 0.9  # type: ignore[arg-type]
        and float(results["cpu_get_into_vs_memcpy"]) >= 0.9  # type: ignore[arg-type]
        and float(results["lookup_32k_tokens_us"]) <= 100  # type: ignore[arg-type]
        and float(results["facade_store_vs_copy"]) >= 0.85  # type: ignore[arg-type]
    )
    for name, value in results.items():
        print(f"{name:>32}: {value}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
