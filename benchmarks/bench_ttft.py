"""TTFT of a cached prefix: lmtier against the ideal, on the demo model (CPU, fp32).

A 3840-token prefix is cached and a 256-token suffix follows. Measured in one run:
  * ideal: the suffix prefill with the prefix KV already in the model's cache object
    (a ``DynamicCache`` built from tensors in memory), no lmtier: the bound;
  * lmtier, prefix served from the CPU tier;
  * lmtier, prefix served from the disk tier (CPU tier off), page cache warm, and cold
    (every chunk file dropped from the page cache before each run);
  * a full 4096-token prefill, for the speedup, next to the FLOP-count ratio.
Targets: overhead <= 10% of the ideal from the CPU tier, <= 25% from disk.

``--sweep`` adds TTFT against the cached prefix's length: the same 4096-token prompt
with 0, 25, 50, 75 and 100% of it cached (whole chunks; at 100% the last chunk, which
holds the last token, is computed), served from the CPU tier, each against the ideal
with the same prefix already in the model's cache (at 0%: a plain prefill). The JSON
gets a ``sweep`` entry; everything else is unchanged.

Usage: python benchmarks/bench_ttft.py [--quick] [--sweep]   (last line: one JSON object)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeAlias

import torch
from transformers import DynamicCache

from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.config import CPUTierConfig, DiskTierConfig
from lmtier_apps.demo.demo_model import build_demo_model
from lmtier_connector.hf.adapter import CachedCausalLM, kv_spec_of
from lmtier_connector.hf.compat import call_with_cache

PREFIX, SUFFIX = 3840, 256
Layers: TypeAlias = "list[tuple[torch.Tensor, torch.Tensor]]"


def median_s(fn: Callable[[], float], repeats: int) -> float:
    fn()
    return statistics.median(fn() for _ in range(repeats))


def flop_ratio(config: object, prefix: int, suffix: int) -> float:
    """FLOPs of a full prefill over FLOPs of the suffix prefill (matmuls and attention)."""
    hidden = config.hidden_size  # type: ignore[attr-defined]
    layers = config.num_hidden_layers  # type: ignore[attr-defined]
    heads, head_dim = config.num_attention_heads, config.head_dim  # type: ignore[attr-defined]
    kv_heads, inter = config.num_key_value_heads, config.intermediate_size  # type: ignore[attr-defined]
    per_token_linear = (
        2
        * layers
        * (hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * inter)
    )

    def attention(start: int, stop: int) -> float:  # causal: query i sees i + 1 keys
        keys = (stop * (stop + 1) - start * (start + 1)) / 2
        return 4 * layers * heads * head_dim * keys

    total = prefix + suffix
    full = per_token_linear * total + attention(0, total)
    part = per_token_linear * suffix + attention(prefix, total)
    return full / part


def drop_page_cache(root: Path) -> None:
    for path in root.rglob("*.lmtc"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


SWEEP = (0.0, 0.25, 0.5, 0.75, 1.0)
"""--sweep: the fractions of the prompt cached."""


def sweep(
    model: Any, spec: KVSpec, ident: dict[str, str], ids: list[int], layers: Layers, repeats: int
) -> dict[str, Any]:
    """TTFT of the whole prompt with each fraction of it cached in the CPU tier (one
    cache salt a level, so each finds exactly its prefix), against the ideal of the
    same level; interleaved rounds, medians, overheads are medians of per-round ratios."""
    config = LMTierConfig(
        cpu=CPUTierConfig(capacity_bytes=256 << 20), disk=DiskTierConfig(enabled=False)
    )
    with LMTier.open(config, kv=spec, **ident) as cache:
        size, via = cache.chunk_size, CachedCausalLM(model, cache)
        longest = (len(ids) - 1) // size * size  # the last token is always computed
        levels = [min(round(f * len(ids)) // size * size, longest) for f in SWEEP]
        prefixes = [  # the ideal's cache: the prefix KV as tensors in memory
            [(k[:, :, :n].contiguous(), v[:, :, :n].contiguous()) for k, v in layers]
            for n in levels
        ]
        for n in levels:
            if n:
                via.prefill(ids[:n], cache_salt=f"sweep-{n}")
            result = via.prefill(ids, cache_salt=f"sweep-{n}", store=False)
            assert result.tokens_by_tier == ({"cpu": n} if n else {}), result.tokens_by_tier

        def ideal(index: int) -> float:
            n = levels[index]
            past = DynamicCache(prefixes[index]) if n else DynamicCache()
            start = time.perf_counter()
            call_with_cache(model, torch.tensor([ids[n:]]), past, use_cache=True, logits_to_keep=1)
            return time.perf_counter() - start

        rounds = [
            [
                (ideal(i), via.prefill(ids, cache_salt=f"sweep-{n}", store=False).ttft_s)
                for i, n in enumerate(levels)
            ]
            for _ in range(repeats)
        ]
    points = []
    for i, (fraction, n) in enumerate(zip(SWEEP, levels, strict=True)):
        pairs = [r[i] for r in rounds]
        points.append(
            {
                "fraction": fraction,
                "cached_tokens": n,
                "computed_tokens": len(ids) - n,
                "ideal_ms": round(statistics.median(p[0] for p in pairs) * 1e3, 1),
                "cpu_tier_ms": round(statistics.median(p[1] for p in pairs) * 1e3, 1),
                "overhead_vs_ideal": round(statistics.median(p[1] / p[0] - 1 for p in pairs), 3),
            }
        )
    return {"prompt_tokens": len(ids), "tier": "cpu", "rounds": repeats, "points": points}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (< 60 s)")
    parser.add_argument(
        "--sweep", action="store_true", help="also TTFT with 0-100%% of the prompt cached"
    )
    args = parser.parse_args()
    repeats = 5 if args.quick else 15
    torch.set_grad_enabled(False)
    demo = build_demo_model(0)
    model, spec = demo.model, kv_spec_of(demo.model)
    ids: list[int] = torch.randint(0, demo.vocab_size, (PREFIX + SUFFIX,)).tolist()
    plain = CachedCausalLM(model, None)
    plain.prefill(ids[:64], store=False)

    full_s = median_s(lambda: plain.prefill(ids, store=False).ttft_s, max(1, repeats // 2))
    prefix_kv = plain.prefill(ids[:PREFIX], store=False).past_key_values
    layers = [(layer.keys, layer.values) for layer in prefix_kv.layers]
    suffix = torch.tensor([ids[PREFIX:]])

    def ideal() -> float:
        cache = DynamicCache(layers)  # the KV is already in the model's cache object
        start = time.perf_counter()
        call_with_cache(model, suffix, cache, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start

    workdir = Path(tempfile.mkdtemp(prefix="lmtier-ttft-"))
    base = LMTierConfig(
        cpu=CPUTierConfig(capacity_bytes=256 << 20),
        disk=DiskTierConfig(path=workdir, fsync=False),
    )
    ident = {"model_id": demo.model_id, "model_revision": demo.revision}
    with LMTier.open(base, kv=spec, **ident) as cache:
        CachedCausalLM(model, cache).prefill(ids[:PREFIX])
    # Two caches on the same files: CPU tier + disk, and disk alone (CPU tier off).
    disk_only = base.replace(cpu=CPUTierConfig(enabled=False))
    with (
        LMTier.open(base, kv=spec, **ident) as cpu_cache,
        LMTier.open(disk_only, kv=spec, **ident) as disk_cache,
    ):
        via_cpu, via_disk = CachedCausalLM(model, cpu_cache), CachedCausalLM(model, disk_cache)
        assert via_disk.prefill(ids, store=False).tokens_by_tier == {"disk": PREFIX}
        via_cpu.prefill(ids[: PREFIX + 16], store=False)  # promotes the prefix to the CPU tier
        assert via_cpu.prefill(ids, store=False).tokens_by_tier == {"cpu": PREFIX}

        def cold() -> float:
            drop_page_cache(workdir)
            return via_disk.prefill(ids, store=False).ttft_s

        # Interleaved, so a burst of noise hits every variant of one round alike;
        # overheads are medians of per-round ratios.
        rounds = [
            (
                ideal(),
                via_cpu.prefill(ids, store=False).ttft_s,
                via_disk.prefill(ids, store=False).ttft_s,
                cold(),
            )
            for _ in range(repeats)
        ]
    ideal_s, cpu_s, disk_warm_s, disk_cold_s = (
        statistics.median(r[i] for r in rounds) for i in range(4)
    )

    def overhead(index: int) -> float:
        return round(statistics.median(r[index] / r[0] - 1 for r in rounds), 3)

    results = {
        "benchmark": "ttft",
        "prefix_tokens": PREFIX,
        "suffix_tokens": SUFFIX,
        "full_prefill_ms": round(full_s * 1e3, 1),
        "ideal_ms": round(ideal_s * 1e3, 1),
        "cpu_tier_ms": round(cpu_s * 1e3, 1),
        "disk_warm_ms": round(disk_warm_s * 1e3, 1),
        "disk_cold_ms": round(disk_cold_s * 1e3, 1),
        "cpu_overhead_vs_ideal": overhead(1),
        "disk_warm_overhead_vs_ideal": overhead(2),
        "disk_cold_overhead_vs_ideal": overhead(3),
        "rounds": repeats,
        "speedup_cpu_vs_full": round(full_s / cpu_s, 2),
        "speedup_ideal_vs_full": round(full_s / ideal_s, 2),
        "flop_ratio_full_vs_suffix": round(flop_ratio(model.config, PREFIX, SUFFIX), 2),
        "targets": {"cpu_overhead": 0.10, "disk_overhead": 0.25},
    }
    results["target_met"] = (
        results["cpu_overhead_vs_ideal"] <= 0.10 and results["disk_cold_overhead_vs_ideal"] <= 0.25
    )
    for name, value in results.items():
        print(f"{name:>30}: {value}")
    if args.sweep:
        results["sweep"] = sweep(model, spec, ident, ids, layers, 3 if args.quick else 7)
        print(f"{'cached tokens':>30}  {'ideal ms':>9}  {'CPU tier ms':>11}  overhead")
        for point in results["sweep"]["points"]:
            print(
                f"{point['cached_tokens']:>30}  {point['ideal_ms']:>9}  "
                f"{point['cpu_tier_ms']:>11}  {point['overhead_vs_ideal']:+.1%}"
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
