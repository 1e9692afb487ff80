"""Worker-side save and load throughput of the vLLM connector against a torch copy.

A 4096-token request, Llama-8B-like per-rank geometry scaled down (8 layers, 8 KV heads,
128 head dim, fp16: 32 KiB/token, 128 MiB for the request), KV in vLLM 0.33's layout
(strided ``[B, H, N, C]`` views of one buffer, block-outermost). *save*: gather the
request's pages into pool slabs, seal and store them (the connector's full save path,
background thread included); *load*: read the chunks from the CPU tier and scatter
them into other blocks. Baseline: ``torch`` copying the same bytes between two
preallocated buffers. Prints one JSON object as its last line.

``gpu_check_vllm_connector()`` runs the same on CUDA pages (pinned slabs).
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
    from lmtier_connector.vllm_meta import ChunkRefs, LMTierConnectorMetadata, LoadSpec, SaveSpec
    from lmtier_connector.vllm_worker import WorkerHalf

LAYERS, HEADS, DIM, BLOCK, CHUNK, TOKENS = 8, 8, 128, 16, 256, 4096
WARMUP = 3


def _vllm_views(num_blocks: int, device: str) -> dict[str, torch.Tensor]:
    """Per-layer [B, H, N, 2D] fp16 views of one buffer, blocks outermost (BLHNC)."""
    raw = torch.zeros(num_blocks, LAYERS, HEADS, BLOCK, 2 * DIM, dtype=torch.float16, device=device)
    raw.normal_()
    return {f"layers.{i}": raw[:, i] for i in range(LAYERS)}


def _run(device: str, repeats: int) -> dict[str, Any]:
    num_blocks = 2 * TOKENS // BLOCK + 8
    kv = _vllm_views(num_blocks, device)
    spec = KVSpec(LAYERS, HEADS, DIM, "float16")
    config = load_config(
        overrides={
            "chunk_size": CHUNK,
            "disk": {"enabled": False},
            "cpu": {"capacity_bytes": "320MiB"},
        }
    )
    cache = LMTier(config, spec).start()
    worker = WorkerHalf(cache, BLOCK)
    worker.register_kv_caches(kv)
    nbytes = TOKENS * spec.bytes_per_token
    src_blocks = tuple(range(TOKENS // BLOCK))
    dst_blocks = tuple(range(TOKENS // BLOCK, 2 * TOKENS // BLOCK))
    save_s, load_s, copy_s = [], [], []
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty(nbytes, dtype=torch.uint8, device=device if device == "cpu" else "cpu")
    for rep in range(repeats):
        tokens = tuple((rep * 100_003 + i) % 32000 for i in range(TOKENS))
        refs = ChunkRefs("", 0, TOKENS // CHUNK, token_ids=tokens)
        started = time.perf_counter()
        worker.start_load(LMTierConnectorMetadata(saves=[SaveSpec(f"r{rep}", refs, src_blocks)]))
        worker.wait_for_save()
        worker._writer.submit(lambda: None).result()
        save_s.append(time.perf_counter() - started)
        load = LoadSpec(f"l{rep}", refs, 0, TOKENS, dst_blocks)
        started = time.perf_counter()
        worker.start_load(LMTierConnectorMetadata(loads=[load]))
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
    # The first rounds touch fresh pool memory (1.5 GB/s here, DESIGN 10): drop them;
    # the 320 MiB CPU tier then recycles warm slabs, as a long-running server does.
    save_s, load_s, copy_s = save_s[WARMUP:], load_s[WARMUP:], copy_s[WARMUP:]
    first = kv["layers.0"]
    exact = torch.equal(first[list(src_blocks)], first[list(dst_blocks)])
    worker.shutdown()
    cache.close()
    gb = nbytes / 1e9
    save, load, copy = (gb / statistics.median(x) for x in (save_s, load_s, copy_s))
    return {
        "device": device,
        "tokens": TOKENS,
        "bytes": nbytes,
        "save_gbps": round(save, 2),
        "load_gbps": round(load, 2),
        "torch_copy_gbps": round(copy, 2),
        "save_vs_copy": round(save / copy, 3),
        "load_vs_copy": round(load / copy, 3),
        "bit_exact": exact,
    }


def gpu_check_vllm_connector() -> dict[str, Any]:
    """The same measurement on CUDA pages (for benchmarks/gpu_check.py)."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    return _run("cuda", WARMUP + 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (< 60 s)")
    args = parser.parse_args()
    result = _run("cpu", WARMUP + (3 if args.quick else 10))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
