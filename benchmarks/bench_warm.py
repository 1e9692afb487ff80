"""``lmtier warm --model`` throughput against the model's own prefill, and what a warm
buys the first request (demo model, CPU, fp32).

Measured in one run, on the same prompts (distinct, so nothing is cached between them):
  * prefill: the model's forward pass over each prompt with ``use_cache=True``, what
    any engine pays to compute the KV: the physical baseline;
  * warm: the warm-up loop (:class:`lmtier_apps.warm.run.Warm`: one lookup per
    prompt, the prefill, the store into the CPU tier, the disk tier's background
    writes flushed at the end) into a fresh cache directory each round.
  Ratio = warm tokens/s over prefill tokens/s, rounds interleaved, median of the
  per-round ratios. Target >= 0.9: storing must not slow warming.
  * TTFT of the first request after a warm (a new cache over the warmed disk directory:
    a new engine process would see the same) against a cold start (no cache).

Usage: python benchmarks/bench_warm.py [--quick]   (last line: one JSON object)
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lmtier import LMTier, LMTierConfig
from lmtier.config import CPUTierConfig, DiskTierConfig
from lmtier_apps.demo.demo_model import DemoModel, build_demo_model
from lmtier_apps.warm.compute import ModelWarmer
from lmtier_apps.warm.inputs import Prompt
from lmtier_apps.warm.progress import Progress, Tally
from lmtier_apps.warm.run import Warm
from lmtier_connector.hf.adapter import CachedCausalLM, kv_spec_of

CHUNK = 256


def prompts(count: int, length: int, round_: int) -> list[list[int]]:
    """Distinct prompts (a different seed per round: each round warms from nothing)."""
    generator = torch.Generator().manual_seed(1000 * round_ + 7)
    return [torch.randint(5, 32_000, (length,), generator=generator).tolist() for _ in range(count)]


def config_for(directory: Path, total_tokens: int, spec_bytes: int) -> LMTierConfig:
    chunks = total_tokens // CHUNK + 8
    return LMTierConfig(
        chunk_size=CHUNK,
        cpu=CPUTierConfig(capacity_bytes=chunks * spec_bytes, staging_bytes=8 * spec_bytes),
        disk=DiskTierConfig(path=directory, capacity_bytes=4 * chunks * spec_bytes),
    )


def prefill_s(demo: DemoModel, batch: list[list[int]]) -> float:
    started = time.perf_counter()
    with torch.inference_mode():
        for ids in batch:
            demo.model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    return time.perf_counter() - started


def warm_s(demo: DemoModel, batch: list[list[int]], config: LMTierConfig) -> tuple[float, Tally]:
    spec = kv_spec_of(demo.model)
    tally = Tally("model")
    progress = Progress(tally, len(batch), enabled=False, stream=io.StringIO())
    items = [Prompt(source=f"bench:{i}", tokens=tuple(ids)) for i, ids in enumerate(batch)]
    with LMTier.open(
        config, kv=spec, model_id=demo.model_id, model_revision=demo.revision
    ) as cache:
        warm = Warm(cache, None, tally, progress, warmer=ModelWarmer(demo.model, cache))
        started = time.perf_counter()
        warm.run(items)  # flushes the disk writes before it returns
        seconds = time.perf_counter() - started
    return seconds, tally


def ttft_ms(demo: DemoModel, ids: list[int], config: LMTierConfig | None) -> tuple[float, int]:
    """The first request's TTFT: with a new cache over ``config``'s tiers, or none."""
    spec = kv_spec_of(demo.model)
    if config is None:
        result = CachedCausalLM(demo.model, None).prefill(ids, store=False)
        return result.ttft_s * 1e3, 0
    with LMTier.open(
        config, kv=spec, model_id=demo.model_id, model_revision=demo.revision
    ) as cache:
        result = CachedCausalLM(demo.model, cache).prefill(ids, store=False)
    return result.ttft_s * 1e3, result.num_cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter prompts")
    args = parser.parse_args()
    count, length, rounds = (4, 1024, 5) if args.quick else (8, 2048, 7)
    torch.set_num_threads(1)  # both sides alike; a loaded 2-core machine stays fair
    demo = build_demo_model(0)
    spec = kv_spec_of(demo.model)
    slab = spec.encoded_chunk_bytes(CHUNK) + 4096
    root = Path(tempfile.mkdtemp(prefix="lmtier-bench-warm-"))
    ratios, warm_rates, prefill_rates = [], [], []
    try:
        prefill_s(demo, prompts(1, CHUNK, 999))  # first-call costs out of the figures
        for round_ in range(rounds):
            batch = prompts(count, length, round_)
            tokens = count * length
            base = prefill_s(demo, batch)
            directory = root / f"round{round_}"
            seconds, tally = warm_s(demo, batch, config_for(directory, tokens, slab))
            assert tally.warmed == count and tally.failed == 0, tally
            prefill_rates.append(tokens / base)
            warm_rates.append(tokens / seconds)
            ratios.append(base / seconds)
        # TTFT of the first request after the last round's warm vs a cold start.
        first = prompts(count, length, rounds - 1)[0] + [11, 12, 13]
        cold, _ = ttft_ms(demo, first, None)
        warmed, cached = ttft_ms(demo, first, config_for(directory, count * length, slab))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratio = statistics.median(ratios)
    result: dict[str, Any] = {
        "benchmark": "warm",
        "quick": args.quick,
        "prompts": count,
        "prompt_tokens": length,
        "rounds": rounds,
        "prefill_tokens_per_s": round(statistics.median(prefill_rates)),
        "warm_tokens_per_s": round(statistics.median(warm_rates)),
        "warm_vs_prefill": round(ratio, 3),
        "warm_vs_prefill_rounds": [round(r, 3) for r in ratios],
        "target": 0.9,
        "met": ratio >= 0.9,
        "ttft_cold_ms": round(cold, 1),
        "ttft_after_warm_ms": round(warmed, 1),
        "ttft_cached_tokens": cached,
        "ttft_speedup": round(cold / warmed, 2) if warmed else None,
    }
    for name, value in result.items():
        print(f"{name:>24}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
