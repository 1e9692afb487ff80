"""Transfer engine: paged KV <-> chunk buffers, against a torch copy of the same bytes.

Measures, for a 4096-token request of the demo model's geometry (8 layers, 4 KV heads,
64 dims, fp32: 16 KiB/token, 64 MiB) cut into 16 chunks of 256 tokens (16 blocks of 16)
on a random block table in a 16k-token page pool:
  * CPU: gather (pages -> 16 chunk payloads in host pool slabs), scatter (the inverse),
    both again on a consecutive block table (a slice instead of an index op), and
    save_chunk_into_slab (gather + header checksum);
    baseline: ``dst.copy_(src)`` of the same 32 MiB, contiguous and preallocated.
  * CUDA (when present): start_load (H2D from pinned slabs) and a save (D2H) of the
    same request against a pinned <-> device copy of the same bytes; then layer-wise
    load overlap on an 8B-class geometry (32 layers, 8 KV heads, 128 dims, bf16, 4096
    tokens = 512 MiB): how much of the load hides behind a per-layer matmul (512 new
    tokens through a 4096 x 3*14336 MLP-sized weight).

Usage: python benchmarks/bench_transfer.py [--quick] [--device auto|cpu|cuda] [--threads N]
(last line: one JSON object)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from lmtier.chunks.format import ChunkMeta
from lmtier.chunks.keys import ChunkKey
from lmtier.kv_spec import KVSpec, payload_tensor
from lmtier.storage.host_pool import HostPool, SlabHandle
from lmtier_connector.device.paged_kv import PagedKVCache
from lmtier_connector.device.transfer import (
    TransferEngine,
    gather,
    save_chunk_into_slab,
    scatter,
)

TOKENS, CHUNK, BLOCK, POOL_BLOCKS = 4096, 256, 16, 1024
SPEC = KVSpec(8, 4, 64, "float32")  # the demo model: 2 x 8 x 4 x 64 x 4 B = 16 KiB per token
BIG = KVSpec(32, 8, 128, "bfloat16")  # 128 KiB per token: an 8B-class model


def median_s(
    fn: Callable[[], object], repeats: int, sync: Callable[[], None] = lambda: None
) -> float:
    fn()
    sync()  # warm up: first touches, kernel loads
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def request(spec: KVSpec, device: str, seed: int = 0) -> tuple[PagedKVCache, list[list[int]]]:
    """Random pages and the block runs of one 4096-token request (16 chunks)."""
    pages = PagedKVCache(spec, POOL_BLOCKS, BLOCK, device=device)
    assert pages.stacked is not None
    pages.stacked.normal_()
    table = random.Random(seed).sample(range(POOL_BLOCKS), TOKENS // BLOCK)
    per_chunk = CHUNK // BLOCK
    return pages, [table[i : i + per_chunk] for i in range(0, len(table), per_chunk)]


def chunk_slabs(spec: KVSpec) -> tuple[HostPool, list[tuple[SlabHandle, ChunkMeta]]]:
    """One pool slab (pinned when CUDA is present) and meta per chunk of the request."""
    count = TOKENS // CHUNK
    pool = HostPool(spec.encoded_chunk_bytes(CHUNK), count)
    handles = [handle for handle in (pool.acquire() for _ in range(count)) if handle is not None]
    metas = [spec.meta(ChunkKey(i.to_bytes(32, "little")), CHUNK) for i in range(count)]
    return pool, list(zip(handles, metas, strict=True))


def payloads(slabs: list[tuple[SlabHandle, ChunkMeta]]) -> list[torch.Tensor]:
    return [payload_tensor(handle, meta) for handle, meta in slabs]


def close(pool: HostPool, slabs: list[tuple[SlabHandle, ChunkMeta]]) -> None:
    for handle, _ in slabs:
        handle.release()
    pool.close()


def bench_cpu(repeats: int) -> dict[str, float]:
    pages, runs = request(SPEC, "cpu")
    per_chunk = CHUNK // BLOCK
    consecutive = [list(range(i, i + per_chunk)) for i in range(0, TOKENS // BLOCK, per_chunk)]
    pool, slabs = chunk_slabs(SPEC)
    outs = payloads(slabs)
    nbytes = TOKENS * SPEC.bytes_per_token
    src = torch.randn(nbytes // 4)
    dst = torch.zeros_like(src)

    def gather_all(table: list[list[int]]) -> None:
        for run, out in zip(table, outs, strict=True):
            gather(pages, run, out)

    def scatter_all(table: list[list[int]]) -> None:
        for run, out in zip(table, outs, strict=True):
            scatter(out, pages, run)

    def save_all() -> None:
        for run, (handle, meta) in zip(runs, slabs, strict=True):
            save_chunk_into_slab(pages, run, handle, meta)

    jobs: dict[str, Callable[[], object]] = {
        "copy": lambda: dst.copy_(src),
        "gather": lambda: gather_all(runs),
        "scatter": lambda: scatter_all(runs),
        "consecutive": lambda: gather_all(consecutive),
        "scatter_consecutive": lambda: scatter_all(consecutive),
        "save": save_all,
    }
    samples: dict[str, list[float]] = {name: [] for name in jobs}
    for job in jobs.values():
        job()  # warm up
    # Interleaved rounds: noise on the shared machine hits every figure alike.
    for _ in range(repeats):
        for name, job in jobs.items():
            start = time.perf_counter()
            job()
            samples[name].append(time.perf_counter() - start)
    close(pool, slabs)
    gbs = {name: nbytes / statistics.median(times) / 1e9 for name, times in samples.items()}
    return {
        "copy_gb_s": round(gbs["copy"], 2),
        "gather_gb_s": round(gbs["gather"], 2),
        "scatter_gb_s": round(gbs["scatter"], 2),
        "gather_consecutive_gb_s": round(gbs["consecutive"], 2),
        "scatter_consecutive_gb_s": round(gbs["scatter_consecutive"], 2),
        "save_into_slab_gb_s": round(gbs["save"], 2),
        "gather_vs_copy": round(gbs["gather"] / gbs["copy"], 3),
        "scatter_vs_copy": round(gbs["scatter"] / gbs["copy"], 3),
    }


def pinned_copy_s(nbytes: int, repeats: int) -> tuple[float, float]:
    """Seconds of a pinned host -> device and a device -> host copy of ``nbytes``,
    contiguous: the bus's bandwidth as torch sees it (the CUDA baseline)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    sync = torch.cuda.synchronize
    h2d = median_s(lambda: device.copy_(host, non_blocking=True), repeats, sync)
    d2h = median_s(lambda: host.copy_(device, non_blocking=True), repeats, sync)
    return h2d, d2h


def bench_cuda_bandwidth(repeats: int) -> dict[str, float]:
    pages, runs = request(SPEC, "cuda")
    engine = TransferEngine(pages)
    pool, slabs = chunk_slabs(SPEC)
    outs = payloads(slabs)
    nbytes = TOKENS * SPEC.bytes_per_token
    sync = torch.cuda.synchronize
    h2d, d2h = pinned_copy_s(nbytes, repeats)
    load = median_s(lambda: engine.start_load(outs, runs).wait(), repeats, sync)

    def save_all_layers() -> None:
        handle = engine.begin_save(runs, outs)
        handle.save_all()
        handle.wait()

    save = median_s(save_all_layers, repeats, sync)
    close(pool, slabs)
    return {
        "pinned_h2d_copy_gb_s": round(nbytes / h2d / 1e9, 2),
        "pinned_d2h_copy_gb_s": round(nbytes / d2h / 1e9, 2),
        "load_h2d_gb_s": round(nbytes / load / 1e9, 2),
        "save_d2h_gb_s": round(nbytes / save / 1e9, 2),
        "load_vs_copy": round(h2d / load, 3),
        "save_vs_copy": round(d2h / save, 3),
    }


def bench_cuda_overlap(repeats: int) -> dict[str, float]:
    """Layer-wise loading: load alone, compute alone, both layer by layer."""
    pages, runs = request(BIG, "cuda")
    engine = TransferEngine(pages)
    pool, slabs = chunk_slabs(BIG)
    chunks = payloads(slabs)
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4096, 3 * 14336, device="cuda", dtype=torch.bfloat16) / 64
    sync = torch.cuda.synchronize

    def compute() -> None:
        for _ in range(BIG.num_layers):
            torch.mm(x, weight)

    def overlapped() -> None:
        load = engine.start_load(chunks, runs)
        for layer in range(BIG.num_layers):
            load.wait_layer(layer)
            torch.mm(x, weight)

    load_s = median_s(lambda: engine.start_load(chunks, runs).synchronize(), repeats, sync)
    compute_s = median_s(compute, repeats, sync)
    both_s = median_s(overlapped, repeats, sync)
    close(pool, slabs)
    hidden = (load_s + compute_s - both_s) / load_s
    return {
        "overlap_load_ms": round(load_s * 1e3, 3),
        "overlap_compute_ms": round(compute_s * 1e3, 3),
        "overlap_both_ms": round(both_s * 1e3, 3),
        "overlap_load_gb_s": round(TOKENS * BIG.bytes_per_token / load_s / 1e9, 2),
        # Share of the load time that compute covers; it cannot exceed compute / load.
        "overlap_load_hidden_fraction": round(max(0.0, hidden), 3),
        "overlap_load_hidden_bound": round(min(1.0, compute_s / load_s), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (< 60 s)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads for ours and the baseline alike (default 1: on a shared "
        "2-core machine, OpenMP copies stall under contention, index_select does not)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeats = 9 if args.quick else 40
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.device == "cuda" and not cuda:
        parser.error("--device cuda: torch sees no CUDA device")
    results: dict[str, Any] = {
        "benchmark": "transfer",
        "tokens": TOKENS,
        "request_bytes": TOKENS * SPEC.bytes_per_token,
        "chunks": TOKENS // CHUNK,
        "block_size": BLOCK,
        "threads": args.threads,
    }
    if args.device != "cuda":
        results.update(bench_cpu(repeats))
        names = ("copy", "gather", "scatter", "gather_consecutive", "scatter_consecutive")
        for name in (*names, "save_into_slab"):
            print(f"{name:>20}: {results[name + '_gb_s']:7.2f} GB/s")
    results["cuda"] = None
    if cuda:
        figures = bench_cuda_bandwidth(repeats) | bench_cuda_overlap(max(3, repeats // 2))
        results["cuda"] = {"device": torch.cuda.get_device_name(), **figures}
        for name, value in figures.items():
            print(f"{name:>26}: {value}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
