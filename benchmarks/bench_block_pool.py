"""Operations per second of the device prefix-cache block pool, against vLLM's in the same run.

Measures, on a pool of 100k usable blocks, in requests of 16 blocks (256 tokens at
block size 16), blocks per second for:
  allocate        get_new_blocks on a fresh pool (no block cached yet),
  cache           cache_full_blocks of every allocated block under a distinct hash,
  lookup          get_cached_block of every cached hash (all hits),
  free            free_blocks of every request, tail first (all go to the queue back),
  allocate_evict  get_new_blocks again: every block handed out evicts a cached hash,
against the same operations on vLLM's ``BlockPool`` when vLLM imports, and always on a
plain dict + deque allocator without ref counts (the floor for a Python pool); each
ratio is our rate over the baseline's.

Also the hashing cost behind lmtier_connector.device.block_pool's choice of block
hashes, on a 32k-token prompt: the 256-token chunk-key chain, the 16-token block chain
(same code), that chain as one bare loop, vLLM's sha256-CBOR block hashes, and
copying 8 KiB of KV per token into preallocated memory.

Usage: python benchmarks/bench_block_pool.py [--quick]   (last line: one JSON object)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import types
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import xxhash

from lmtier.chunks.hashers import chunk_keys
from lmtier.chunks.keys import Namespace
from lmtier.chunks.vllm_hash import vllm_block_hashes
from lmtier_connector.device.block_pool import BlockHash, BlockPool, block_hashes

NUM_BLOCKS = 100_000
BLOCKS_PER_REQUEST = 16
BLOCK_SIZE = 16
PROMPT_TOKENS = 32 * 1024
KV_BYTES_PER_TOKEN = 8192  # the demo model, fp32 (DESIGN 10)
OPERATIONS = ("allocate", "cache", "lookup", "free", "allocate_evict")


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up
    return statistics.median(timed(fn) for _ in range(repeats))


def run_ours(hashes: Sequence[BlockHash]) -> dict[str, float]:
    pool = BlockPool(NUM_BLOCKS + 1)  # + the null block
    requests: list[list[Any]] = []
    num_requests = NUM_BLOCKS // BLOCKS_PER_REQUEST
    chunks = [
        hashes[i * BLOCKS_PER_REQUEST : (i + 1) * BLOCKS_PER_REQUEST] for i in range(num_requests)
    ]

    def allocate() -> None:
        requests.clear()
        for _ in range(num_requests):
            requests.append(pool.get_new_blocks(BLOCKS_PER_REQUEST) or [])

    def cache() -> None:
        for blocks, chunk in zip(requests, chunks, strict=True):
            pool.cache_full_blocks(blocks, chunk, 0, BLOCKS_PER_REQUEST)

    def lookup() -> None:
        get = pool.get_cached_block
        for block_hash in hashes:
            get(block_hash)

    def free() -> None:
        for blocks in requests:
            pool.free_blocks(reversed(blocks))

    seconds = {"allocate": timed(allocate), "cache": timed(cache), "lookup": timed(lookup)}
    seconds["free"] = timed(free)
    seconds["allocate_evict"] = timed(allocate)
    assert len(pool.cached_blocks) == 0 and pool.get_num_free_blocks() == 0
    return seconds


def run_vllm(vllm_pool_class: Any, hashes: Sequence[BlockHash]) -> dict[str, float]:
    pool = vllm_pool_class(NUM_BLOCKS + 1, enable_caching=True, hash_block_size=BLOCK_SIZE)
    requests: list[list[Any]] = []
    num_requests = NUM_BLOCKS // BLOCKS_PER_REQUEST
    stand_ins = [
        types.SimpleNamespace(
            block_hashes=list(hashes[i * BLOCKS_PER_REQUEST : (i + 1) * BLOCKS_PER_REQUEST])
        )
        for i in range(num_requests)
    ]

    def allocate() -> None:
        requests.clear()
        for _ in range(num_requests):
            requests.append(pool.get_new_blocks(BLOCKS_PER_REQUEST))

    def cache() -> None:
        for blocks, request in zip(requests, stand_ins, strict=True):
            pool.cache_full_blocks(request, blocks, 0, BLOCKS_PER_REQUEST, BLOCK_SIZE, 0)

    def lookup() -> None:
        get = pool.get_cached_block
        groups = [0]
        for block_hash in hashes:
            get(block_hash, groups)

    def free() -> None:
        for blocks in requests:
            pool.free_blocks(reversed(blocks))

    seconds = {"allocate": timed(allocate), "cache": timed(cache), "lookup": timed(lookup)}
    seconds["free"] = timed(free)
    seconds["allocate_evict"] = timed(allocate)
    return seconds


def run_dict_deque(hashes: Sequence[BlockHash]) -> dict[str, float]:
    """The floor: ids in a deque, a hash -> id dict and its reverse; no ref counts."""
    free_ids: deque[int] = deque(range(1, NUM_BLOCKS + 1))
    by_hash: dict[bytes, int] = {}
    hash_of: dict[int, bytes] = {}
    requests: list[list[int]] = []
    num_requests = NUM_BLOCKS // BLOCKS_PER_REQUEST

    def allocate() -> None:
        requests.clear()
        popleft = free_ids.popleft
        for _ in range(num_requests):
            blocks = [popleft() for _ in range(BLOCKS_PER_REQUEST)]
            for block_id in blocks:
                old = hash_of.pop(block_id, None)
                if old is not None:
                    del by_hash[old]
            requests.append(blocks)

    def cache() -> None:
        for index, blocks in enumerate(requests):
            for offset, block_id in enumerate(blocks):
                block_hash = hashes[index * BLOCKS_PER_REQUEST + offset]
                by_hash[block_hash] = block_id
                hash_of[block_id] = block_hash

    def lookup() -> None:
        get = by_hash.get
        for block_hash in hashes:
            get(block_hash)

    def free() -> None:
        for blocks in requests:
            free_ids.extend(reversed(blocks))

    seconds = {"allocate": timed(allocate), "cache": timed(cache), "lookup": timed(lookup)}
    seconds["free"] = timed(free)
    seconds["allocate_evict"] = timed(allocate)
    return seconds


def import_vllm_block_pool() -> Any | None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            from vllm.v1.core.block_pool import BlockPool as VllmBlockPool  # noqa: PLC0415
        except ImportError:
            return None
    return VllmBlockPool


def median_rates(runs: list[dict[str, float]]) -> dict[str, float]:
    return {op: NUM_BLOCKS / statistics.median(run[op] for run in runs) for op in OPERATIONS}


def specialized_chain16(token_bytes: bytes, seed: bytes) -> list[bytes]:
    """The 16-token chain as one bare loop: the rejected hand-specialized alternative."""
    view, parent, keys = memoryview(token_bytes), seed, []
    digest = xxhash.xxh3_128_digest
    stride = BLOCK_SIZE * 4
    for start in range(0, len(token_bytes), stride):
        parent = digest(parent + b"\x04" + view[start : start + stride])
        keys.append(seed + parent)
    return keys


def hashing_figures(repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 128_000, size=PROMPT_TOKENS, dtype=np.int64)
    namespace = Namespace(model_id="bench", chunk_size=256)
    chain_256 = median_seconds(lambda: chunk_keys(prompt, namespace), repeats)
    chain_16 = median_seconds(lambda: block_hashes(prompt, namespace, BLOCK_SIZE), repeats)
    token_bytes = prompt.astype("<i4").tobytes()
    seed = namespace.digest
    bare_16 = median_seconds(lambda: specialized_chain16(token_bytes, seed), repeats)
    vllm_16 = median_seconds(lambda: vllm_block_hashes(prompt), max(3, repeats // 5))
    kv_src = np.ones(PROMPT_TOKENS * KV_BYTES_PER_TOKEN, dtype=np.uint8)
    kv_dst = np.zeros_like(kv_src)  # preallocated and touched: the pool's steady state
    copy = median_seconds(lambda: np.copyto(kv_dst, kv_src), max(5, repeats // 3))

    def ns_per_token(seconds: float) -> float:
        return round(seconds / PROMPT_TOKENS * 1e9, 3)

    return {
        "chain256_ns_per_token": ns_per_token(chain_256),
        "chain16_ns_per_token": ns_per_token(chain_16),
        "chain16_bare_loop_ns_per_token": ns_per_token(bare_16),
        "vllm_sha256_16_ns_per_token": ns_per_token(vllm_16),
        "kv_copy_ns_per_token": ns_per_token(copy),
        "chain16_vs_chain256": round(chain_16 / chain_256, 2),
        "chain16_vs_kv_copy": round(chain_16 / copy, 4),
        "chain16_ms_per_32k_prompt": round(chain_16 * 1e3, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (< 60 s)")
    args = parser.parse_args()
    repeats = 7 if args.quick else 21

    rng = np.random.default_rng(1)
    raw = rng.bytes(32 * NUM_BLOCKS)
    hashes = [BlockHash(raw[i * 32 : (i + 1) * 32]) for i in range(NUM_BLOCKS)]

    # Interleaved repeats, so that a noisy neighbour slows every implementation alike.
    vllm_pool_class = import_vllm_block_pool()
    runs: dict[str, list[dict[str, float]]] = {"ours": [], "dict_deque": [], "vllm": []}
    for _ in range(repeats):
        runs["ours"].append(run_ours(hashes))
        runs["dict_deque"].append(run_dict_deque(hashes))
        if vllm_pool_class is not None:
            runs["vllm"].append(run_vllm(vllm_pool_class, hashes))
    ours = median_rates(runs.pop("ours"))
    baselines = {name: median_rates(found) for name, found in runs.items() if found}

    results: dict[str, Any] = {
        "benchmark": "block_pool",
        "num_blocks": NUM_BLOCKS,
        "blocks_per_call": BLOCKS_PER_REQUEST,
        "vllm_compared": vllm_pool_class is not None,
    }
    for op in OPERATIONS:
        results[f"{op}_blocks_per_s"] = round(ours[op])
        line = f"{op:>17}: {ours[op] / 1e6:6.2f} M blocks/s"
        for name, rates in baselines.items():
            results[f"{op}_{name}_blocks_per_s"] = round(rates[op])
            results[f"{op}_vs_{name}"] = round(ours[op] / rates[op], 3)
            line += f"  ({name} {rates[op] / 1e6:.2f} M, x{ours[op] / rates[op]:.2f})"
        print(line)
    results.update(hashing_figures(5 if args.quick else 30))
    for name in ("chain256", "chain16", "chain16_bare_loop", "vllm_sha256_16", "kv_copy"):
        print(f"{name:>17}: {results[name + '_ns_per_token']:9.3f} ns/token")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
