"""Worker-side save and load throughput of the vLLM connector against a torch copy.

A 4096-token request, Llama-8B-like per-rank geometry scaled down (8 layers, 8 KV heads,
128 head dim, fp16: 32 KiB/token, 128 MiB for the request), KV in vLLM 0.33's layout
(strided ``[B, H, N, C]`` views of one buffer, block-outermost), stored in both chunk
layouts the connector offers: ``page`` (``LBHSC``, the pages' own order: block
copies; the default) and ``LKTHD`` (tokens before heads). *save*: gather the
request's pages into pool slabs, seal and store them (the connector's full save path,
background thread included); *load*: read the chunks from the CPU tier and scatter
them into other blocks. Baselines: ``torch`` copying the same bytes between two
preallocated buffers (``torch_copy``), and ``torch`` copying the request's pages into
one ``LKTHD`` buffer (``torch_relayout``: vLLM's ``[B, H, N, C]`` pages put heads
before tokens, an ``LKTHD`` chunk tokens before heads, so every gather or scatter is
this transposing copy of 256-byte rows, the floor for one copy in that layout).
The scheduler-step part (``vllm_step.py``; ``--no-step`` skips it) times the step
that admits a request with a 32k-token hit on disk, loading it synchronously and
asynchronously, against the steps of eight decoding requests.
Stages (median ms): save = ``prepare`` (keys, lookup, slabs) + ``gather`` (pages into
slabs, the forward-path part) + ``seal_store`` (checksum and CPU-tier put, on the save
thread); load = read + scatter. ``--threads`` sets ``torch.set_num_threads`` for
connector and baselines alike (default 1: this 2-core machine's 2-thread copies
are unstable against the save thread). Prints one JSON object as its last line.

``gpu_check_vllm_connector()`` runs the copies on CUDA pages (pinned slabs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from typing import Any

import torch

for _name in ("VLLM_TARGET_DEVICE",):
    os.environ.setdefault(_name, "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from lmtier.api import LMTier
    from lmtier.config import load_config
    from lmtier.kv_spec import KVSpec
    from lmtier_connector.vllm.common import ChunkRefs, LMTierConnectorMetadata, LoadSpec, SaveSpec
    from lmtier_connector.vllm.worker import WorkerHalf

LAYERS, HEADS, DIM, BLOCK, CHUNK, TOKENS = 8, 8, 128, 16, 256, 4096
WARMUP = 3


def _vllm_views(num_blocks: int, device: str) -> dict[str, torch.Tensor]:
    """Per-layer [B, H, N, 2D] fp16 views of one buffer, blocks outermost (BLHNC)."""
    raw = torch.zeros(num_blocks, LAYERS, HEADS, BLOCK, 2 * DIM, dtype=torch.float16, device=device)
    raw.normal_()
    return {f"layers.{i}": raw[:, i] for i in range(LAYERS)}


def _relayout(kv: dict[str, torch.Tensor], out: torch.Tensor) -> None:
    """The request's pages (blocks 0..) into one (L, 2, T, H, D) buffer, by torch."""
    raw = kv["layers.0"].as_strided(
        (TOKENS // BLOCK, LAYERS, HEADS, BLOCK, 2 * DIM),
        (LAYERS * HEADS * BLOCK * 2 * DIM, HEADS * BLOCK * 2 * DIM, BLOCK * 2 * DIM, 2 * DIM, 1),
    )
    pages = raw.view(*raw.shape[:-1], 2, DIM).permute(1, 4, 0, 3, 2, 5)
    out.view(LAYERS, 2, TOKENS // BLOCK, BLOCK, HEADS, DIM).copy_(pages)


def _run(device: str, repeats: int, layout: str = "page") -> dict[str, Any]:
    num_blocks = 2 * TOKENS // BLOCK + 8
    kv = _vllm_views(num_blocks, device)
    if layout == "page":  # what the connector stores by default: whole blocks, page order
        spec = KVSpec(LAYERS, HEADS, DIM, "float16", layout="LBHSC", block_size=BLOCK)
    else:
        spec = KVSpec(LAYERS, HEADS, DIM, "float16", layout=layout)
    config = load_config(
        overrides={
            "chunk_size": CHUNK,
            "disk": {"enabled": False},
            "cpu": {"capacity_bytes": "320MiB"},
        }
    )
    cache = LMTier(config, spec, model_id="bench-vllm-connector").start()
    worker = WorkerHalf(cache, BLOCK)
    worker.register_kv_caches(kv)
    nbytes = TOKENS * spec.bytes_per_token
    src_blocks = tuple(range(TOKENS // BLOCK))
    dst_blocks = tuple(range(TOKENS // BLOCK, 2 * TOKENS // BLOCK))
    save_s, load_s, copy_s, relayout_s = [], [], [], []
    stages: dict[str, list[float]] = {"prepare": [], "gather": [], "seal_store": []}
    chunk_buf = torch.empty((LAYERS, 2, TOKENS, HEADS, DIM), dtype=torch.float16, device=device)
    # Written once: a copy of never-written memory reads the kernel's zero page and
    # runs ~1.5x faster than any copy of real KV.
    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    b = torch.empty(nbytes, dtype=torch.uint8, device=device if device == "cpu" else "cpu")
    for rep in range(repeats):
        tokens = tuple((rep * 100_003 + i) % 32000 for i in range(TOKENS))
        refs = ChunkRefs("", 0, TOKENS // CHUNK, token_ids=tokens)
        started = time.perf_counter()
        worker.bind(LMTierConnectorMetadata(saves=[SaveSpec(f"r{rep}", refs, src_blocks)]))
        prepared = time.perf_counter()
        worker.wait_for_save()
        gathered = time.perf_counter()
        worker._writer.submit(lambda: None).result()
        stored = time.perf_counter()
        save_s.append(stored - started)
        stages["prepare"].append(prepared - started)
        stages["gather"].append(gathered - prepared)
        stages["seal_store"].append(stored - gathered)
        load = LoadSpec(f"l{rep}", refs, 0, TOKENS, dst_blocks)
        started = time.perf_counter()
        load_meta = LMTierConnectorMetadata(loads=[load])
        worker.bind(load_meta)
        worker.start_load(load_meta)
        worker.wait_for_save()
        if device != "cpu":
            torch.cuda.synchronize()
        load_s.append(time.perf_counter() - started)
        assert not worker.failed_block_ids()
        started = time.perf_counter()
        b.copy_(a)
        if device != "cpu":
            torch.cuda.synchronize()
        copy_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        _relayout(kv, chunk_buf)
        if device != "cpu":
            torch.cuda.synchronize()
        relayout_s.append(time.perf_counter() - started)
    # The first rounds touch fresh pool memory (1.5 GB/s here, DESIGN 10): drop them;
    # the 320 MiB CPU tier then recycles warm slabs, as a long-running server does.
    save_s, load_s, copy_s = save_s[WARMUP:], load_s[WARMUP:], copy_s[WARMUP:]
    relayout_s = relayout_s[WARMUP:]
    ms = {name: round(1e3 * statistics.median(x[WARMUP:]), 2) for name, x in stages.items()}
    first = kv["layers.0"]
    exact = torch.equal(first[list(src_blocks)], first[list(dst_blocks)])
    worker.shutdown()
    cache.close()
    gb = nbytes / 1e9
    save, load, copy, relayout = (
        gb / statistics.median(x) for x in (save_s, load_s, copy_s, relayout_s)
    )
    return {
        "device": device,
        "chunk_layout": spec.layout,
        "threads": torch.get_num_threads(),
        "tokens": TOKENS,
        "bytes": nbytes,
        "save_gbps": round(save, 2),
        "load_gbps": round(load, 2),
        "torch_copy_gbps": round(copy, 2),
        "torch_relayout_gbps": round(relayout, 2),
        "save_ms": {**ms, "total": round(1e3 * statistics.median(save_s), 2)},
        "load_ms": round(1e3 * statistics.median(load_s), 2),
        "save_vs_copy": round(save / copy, 3),
        "load_vs_copy": round(load / copy, 3),
        "save_vs_relayout": round(save / relayout, 3),
        "load_vs_relayout": round(load / relayout, 3),
        "bit_exact": exact,
    }


def gpu_check_vllm_connector() -> dict[str, Any]:
    """The same measurement on CUDA pages (for benchmarks/gpu_check.py)."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    return {layout: _run("cuda", WARMUP + 5, layout) for layout in ("page", "LKTHD")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (< 60 s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--no-step", action="store_true", help="skip the scheduler-step part (vllm_step.py)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeats = WARMUP + (3 if args.quick else 10)
    page, token_major = _run("cpu", repeats, "page"), _run("cpu", repeats, "LKTHD")
    result: dict[str, Any] = {
        "save_vs_copy": page["save_vs_copy"],
        "load_vs_copy": page["load_vs_copy"],
        "page": page,
        "LKTHD": token_major,
    }
    if not args.no_step:
        from vllm_step import step_bench  # noqa: PLC0415 - imports vLLM's scheduler

        result["step"] = step_bench(decode=10 if args.quick else 40)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
