"""``lmtier demo``: a real transformer skipping its prefill, on the embedded default.

The workload is what prefix caching is for: requests sharing a long system prompt,
a multi-turn conversation (each turn's prompt holds the previous turns and replies),
and RAG-style questions over one shared document. Every request runs twice: through
lmtier, and as a plain full prefill, so the table shows the time to first token
(TTFT) saved and the largest logit difference (zero expected: the cache serves the
same KV the model would compute).

The tiers are the whole waterfall: a small device prefix cache (paged KV with
vLLM-style block caching, 4096 tokens by default), then lmtier's CPU and disk tiers.
The RAG document pushes the system prompt out of the device tier, so the last
request is served from the CPU tier; run the demo again in a new process and the
first requests are served from the disk tier.

With ``--sidecar URL`` the cache is a client of that ``lmtier serve``
(:func:`lmtier.connect`): its tiers, CPU tier included, outlive the demo
process, so a second run is served from the sidecar's CPU tier. The device tier
stays in the demo's process.

torch's threads are sized to the CPUs the process may use (:mod:`.threads`), and
``--plot FILE.png`` draws the table's TTFT columns (:mod:`.plot`). :func:`set_up`,
:func:`open_cache` and :func:`sidecar_problem` are shared with ``lmtier demo serve``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmtier.api import LMTier
from lmtier.config import LMTierConfig, parse_size
from lmtier.kv_spec import KVSpec
from lmtier_apps.command_cache import open_command_cache, sidecar_problem
from lmtier_apps.demo.demo_model import DemoModel, build_demo_model, load_local_model
from lmtier_apps.demo.plot import matplotlib_problem, write_ttft_plot
from lmtier_apps.demo.rows import DemoRow
from lmtier_apps.threads import set_torch_threads
from lmtier_connector.device.prefix_cache import DevicePrefixCache
from lmtier_connector.hf.adapter import CachedCausalLM, kv_spec_of

__all__ = [
    "DemoRow",
    "DemoSetup",
    "cmd_demo",
    "open_cache",
    "run_demo",
    "set_up",
    "sidecar_problem",
    "tier_config",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DemoRequest:
    """One request of the workload: a scenario label, the prompt, tokens to generate."""

    name: str
    prompt: list[int]
    reply_tokens: int = 0


class Workload:
    """Builds the demo's prompts from a seeded generator (random token ids)."""

    def __init__(self, vocab_size: int, seed: int, scale: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.vocab_size = vocab_size
        self.scale = scale

    def tokens(self, count: int) -> list[int]:
        size = max(1, int(count * self.scale))
        ids: list[int] = self.rng.integers(0, self.vocab_size, size=size).tolist()
        return ids

    def fixed_requests(self) -> list[DemoRequest]:
        system = self.tokens(1536)
        document = self.tokens(2560)
        requests = [
            DemoRequest(f"system prompt, user {i + 1}", system + self.tokens(96 + 48 * i))
            for i in range(3)
        ]
        requests += [
            DemoRequest(f"RAG document, question {i + 1}", document + self.tokens(80 + 40 * i))
            for i in range(2)
        ]
        requests.append(DemoRequest("system prompt, user 4", system + self.tokens(120)))
        return requests


def run_demo(
    demo: DemoModel,
    cache: LMTier,
    *,
    device_cache: DevicePrefixCache | None = None,
    seed: int = 0,
    scale: float = 1.0,
) -> list[DemoRow]:
    """Run the workload through lmtier and without it; one row per request."""
    llm = CachedCausalLM(demo.model, cache, device_cache=device_cache)
    plain = CachedCausalLM(demo.model, None)
    plain.prefill(list(range(32)), store=False)  # warm up kernels outside the timings
    workload = Workload(demo.vocab_size, seed, scale)
    requests = workload.fixed_requests()
    rows = [_measure(llm, plain, request) for request in requests[:3]]
    # The conversation: prompts grow with the model's real replies.
    history = workload.tokens(512) + workload.tokens(200)
    for turn in range(3):
        request = DemoRequest(f"chat, turn {turn + 1}", list(history), reply_tokens=24)
        row, reply = _measure_turn(llm, plain, request)
        rows.append(row)
        history = history + reply + workload.tokens(150)
    rows += [_measure(llm, plain, request) for request in requests[3:]]
    return rows


def _measure(llm: CachedCausalLM, plain: CachedCausalLM, request: DemoRequest) -> DemoRow:
    cached = llm.prefill(request.prompt)
    baseline = plain.prefill(request.prompt, store=False)
    return _row(request, cached.logits, baseline.logits, cached, baseline.ttft_s)


def _measure_turn(
    llm: CachedCausalLM, plain: CachedCausalLM, request: DemoRequest
) -> tuple[DemoRow, list[int]]:
    reply, cached = llm.generate(request.prompt, request.reply_tokens)
    baseline = plain.prefill(request.prompt, store=False)
    return _row(request, cached.logits, baseline.logits, cached, baseline.ttft_s), reply


def _row(
    request: DemoRequest, logits: torch.Tensor, reference: torch.Tensor, result: Any, plain_s: float
) -> DemoRow:
    return DemoRow(
        request=request.name,
        prompt_tokens=result.num_prompt_tokens,
        cached_tokens=result.num_cached_tokens,
        tiers=dict(result.tokens_by_tier),
        ttft_ms=result.ttft_s * 1e3,
        ttft_no_cache_ms=plain_s * 1e3,
        max_logit_diff=float((logits - reference).abs().max()),
    )


def summarize(rows: list[DemoRow]) -> dict[str, Any]:
    """Totals over the workload: TTFT speedup, tokens served per tier, largest difference."""
    by_tier: dict[str, int] = {}
    for row in rows:
        for tier, tokens in row.tiers.items():
            by_tier[tier] = by_tier.get(tier, 0) + tokens
    total = sum(r.ttft_ms for r in rows)
    total_plain = sum(r.ttft_no_cache_ms for r in rows)
    return {
        "requests": len(rows),
        "prompt_tokens": sum(r.prompt_tokens for r in rows),
        "cached_tokens": sum(r.cached_tokens for r in rows),
        "cached_tokens_by_tier": by_tier,
        "ttft_ms_total": round(total, 1),
        "ttft_no_cache_ms_total": round(total_plain, 1),
        "ttft_speedup": round(total_plain / total, 2) if total else 0.0,
        "max_logit_diff": max((r.max_logit_diff for r in rows), default=0.0),
    }


def print_table(rows: list[DemoRow], summary: dict[str, Any], out: Any = sys.stdout) -> None:
    """The human-readable report."""
    header = (
        f"{'request':<26} {'prompt':>6} {'cached':>6}  {'served by':<22} "
        f"{'TTFT ms':>8} {'no cache':>8} {'speedup':>7} {'max |dlogit|':>12}"
    )
    print(header, file=out)
    print("-" * len(header), file=out)
    for row in rows:
        tiers = ", ".join(f"{t} {n}" for t, n in row.tiers.items()) or "-"
        print(
            f"{row.request:<26} {row.prompt_tokens:>6} {row.cached_tokens:>6}  {tiers:<22} "
            f"{row.ttft_ms:>8.1f} {row.ttft_no_cache_ms:>8.1f} {row.speedup:>6.1f}x "
            f"{row.max_logit_diff:>12.2e}",
            file=out,
        )
    print("-" * len(header), file=out)
    print(
        f"{summary['cached_tokens']} of {summary['prompt_tokens']} prompt tokens served from "
        f"the cache {summary['cached_tokens_by_tier']}; TTFT {summary['ttft_ms_total']:.0f} ms "
        f"vs {summary['ttft_no_cache_ms_total']:.0f} ms without lmtier "
        f"({summary['ttft_speedup']}x); largest logit difference {summary['max_logit_diff']:.1e}",
        file=out,
    )


def tier_config(args: argparse.Namespace, base: LMTierConfig) -> LMTierConfig:
    """``base`` with the command line's tier options (``--cpu-capacity``, ``--cache-dir``,
    ``--no-disk``) applied."""
    cpu = base.cpu.replace(capacity_bytes=parse_size(args.cpu_capacity))
    disk = base.disk
    if args.cache_dir is not None:
        disk = disk.replace(path=Path(args.cache_dir))
    if args.no_disk:
        disk = disk.replace(enabled=False)
    return base.replace(cpu=cpu, disk=disk)


@dataclass(frozen=True, slots=True)
class DemoSetup:
    """What ``lmtier demo`` and ``lmtier demo serve`` build from their shared options,
    before the cache opens: the model, the effective config, the model's KV geometry,
    the device tier (None with ``--device-blocks 0``) and torch's intra-op threads."""

    demo: DemoModel
    config: LMTierConfig
    spec: KVSpec
    device_cache: DevicePrefixCache | None
    threads: int


def set_up(args: argparse.Namespace, config: LMTierConfig) -> DemoSetup:
    """Size torch's threads (``--threads``, else the CPUs this process may use), load the
    model (``--model DIR`` or the random demo Llama from ``--seed``) and its device tier."""
    threads = set_torch_threads(args.threads)
    torch.set_grad_enabled(False)
    demo = load_local_model(args.model) if args.model else build_demo_model(args.seed)
    spec = kv_spec_of(demo.model)
    device = next(demo.model.parameters()).device
    device_cache = (
        DevicePrefixCache(spec, args.device_blocks, device=device) if args.device_blocks else None
    )
    return DemoSetup(demo, tier_config(args, config), spec, device_cache, threads)


def cmd_demo(args: argparse.Namespace, config: LMTierConfig) -> int:
    problem = matplotlib_problem() if args.plot else None
    if problem is not None:  # before the run, not after a minute of it
        print(f"lmtier demo: error: {problem}", file=sys.stderr)
        return 2
    setup = set_up(args, config)
    demo, config = setup.demo, setup.config
    with open_cache(args, setup, client_name="lmtier demo") as cache:
        problem = sidecar_problem(args, cache, command="lmtier demo", cache_salt="")
        if problem is not None:
            print(problem, file=sys.stderr)
            return 1
        rows = run_demo(
            demo, cache, device_cache=setup.device_cache, seed=args.seed, scale=args.scale
        )
        cache.flush()
    summary = summarize(rows)
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "summary": summary}))
    else:
        where = "off" if not config.disk.enabled else str(config.disk.path)
        tiers = f"sidecar: {args.sidecar}" if args.sidecar else f"disk tier: {where}"
        chunk = config.chunk_size
        threads = f"{setup.threads} torch thread{'s' if setup.threads > 1 else ''}"
        head = f"model {demo.model_id} ({demo.revision}), chunk {chunk} tokens"
        print(f"{head}, {tiers}, {threads}\n")
        print_table(rows, summary)
    if args.plot:
        title = (
            f"TTFT per request: {summary['ttft_ms_total']:.0f} ms with lmtier, "
            f"{summary['ttft_no_cache_ms_total']:.0f} ms without ({summary['ttft_speedup']}x)"
        )
        write_ttft_plot(rows, args.plot, title=title, sidecar=bool(args.sidecar))
        print(f"lmtier demo: wrote {args.plot}", file=sys.stderr)  # stdout stays the report
    return 0


def open_cache(args: argparse.Namespace, setup: DemoSetup, *, client_name: str) -> LMTier:
    """The embedded cache, or a client of the sidecar at ``--sidecar`` (``client_name``
    is how the sidecar's logs and metrics name this process)."""
    demo = setup.demo
    return open_command_cache(
        args,
        setup.config,
        setup.spec,
        model_id=demo.model_id,
        revision=demo.revision,
        vocab_size=demo.vocab_size or None,  # 0: unknown
        client_name=client_name,
    )
