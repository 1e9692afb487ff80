"""A benchmark report with plots: runs the benchmarks, writes report.md and PNGs.

Runs each benchmark below as a subprocess (``--quick``; ``--full`` for their full
runs), one at a time, reads the JSON object each prints as its last line, and writes
``report.md`` and ``report/*.png`` under ``--out`` (default: benchmarks/):
  1. each tier against its physical baseline (the ratios bench_storage, bench_disk,
     bench_redis and bench_s3 measure against memcpy, raw file I/O, raw redis-py and
     raw boto3 in the same run), with the targets the benchmarks state;
  2. TTFT against the cached prefix's length (bench_ttft.py --sweep);
  3. token hit ratio against CPU tier capacity on a replayed chat workload
     (bench_trace.py --capacities).
Each benchmark's JSON is saved as ``report/NAME.json``; ``--from-json DIR`` builds the
report from such files (or whole saved outputs) without running anything. A benchmark
that cannot run here (no redis-server, no moto server) gets a line saying why.

Usage: python benchmarks/report.py [--full] [--only storage,ttft] [--from-json DIR]
       [--out DIR]   (last line: one JSON object)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from report_plots import Ratio, capacity_plot, pyplot, tiers_plot, ttft_plot

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CAPACITIES = "0.01,0.02,0.05,0.1,0.2,0.5,1"
BENCHMARKS: dict[str, tuple[str, ...]] = {
    "storage": (),
    "disk": (),
    "redis": (),
    "s3": (),
    "ttft": ("--sweep",),
    "trace": ("--capacities", CAPACITIES, "--load", "0.25"),
}
"""Name (benchmarks/bench_NAME.py) -> arguments after --quick."""


def missing_requirement(name: str) -> str | None:
    """Why ``name`` cannot run on this machine, or None."""
    if name == "redis" and shutil.which("redis-server") is None:
        return "redis-server not found on PATH (apt-get install redis-server)"
    if name == "s3" and not all(importlib.util.find_spec(m) for m in ("moto", "flask")):
        return "no moto server here (pip install 'moto[server]')"
    if name == "ttft" and importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install -e '.[hf]')"
    return None


def last_json(text: str) -> dict[str, Any]:
    """The JSON object on the last non-empty line of a benchmark's output."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError("no output")
    value = json.loads(lines[-1])
    if not isinstance(value, dict):
        raise ValueError("the last line is not a JSON object")
    return value


def run_benchmark(name: str, quick: bool) -> tuple[dict[str, Any] | None, str | None, float]:
    """(the JSON, None) or (None, why not), and the seconds it ran."""
    command = [sys.executable, str(HERE / f"bench_{name}.py")]
    command += ["--quick", *BENCHMARKS[name]] if quick else list(BENCHMARKS[name])
    paths = [str(REPO), str(REPO / "backends"), str(REPO / "connector")]  # this checkout's code
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]))
    started = time.perf_counter()
    try:
        limit = 900 if quick else 3600
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=limit, check=False
        )
    except subprocess.TimeoutExpired as exc:
        return None, f"did not finish within {exc.timeout:.0f} s", time.perf_counter() - started
    seconds = time.perf_counter() - started
    with contextlib.suppress(ValueError):
        if done.returncode == 0:
            return last_json(done.stdout), None, seconds
    tail = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["no error output"]
    return None, f"failed (exit {done.returncode}): {tail[0].strip()[:300]}", seconds


def machine() -> dict[str, Any]:
    """Where and when the benchmarks ran."""
    git = ["git", "-C", str(REPO)]
    rev = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, check=False)
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD", "--"], check=False).returncode
    commit = rev.stdout.decode().strip() + (" (with uncommitted changes)" if dirty else "")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "git_commit": commit if rev.returncode == 0 else "unknown",
    }


# --- figures out of each benchmark's JSON ---------------------------------------------

TIERS = {
    "storage": ("CPU tier", "memcpy / torch copy_ of the same bytes"),
    "disk": ("Disk tier", "the best raw file I/O"),
    "redis": ("Redis tier", "raw redis-py"),
    "s3": ("S3 tier (moto)", "raw boto3 with the tier's client settings"),
}
FACADE = """\
LMTier.store() + flush() | {r[facade][store][ratio]} | {t} | {r[facade][store][facade_ms]} vs \
{r[facade][store][raw_ms]} ms
LMTier.lookup() | {r[facade][lookup][ratio]} | | {r[facade][lookup][facade_ms]} vs \
{r[facade][lookup][raw_ms]} ms
LMTier.load() | {r[facade][load][ratio]} | 0.9 | {r[facade][load][facade_ms]} vs \
{r[facade][load][raw_ms]} ms
lookup() + load_keys() | {r[facade][lookup_then_load_keys][ratio]} | 0.9 | \
{r[facade][lookup_then_load_keys][facade_ms]} vs {r[facade][lookup_then_load_keys][raw_ms]} ms
"""
RATIOS = {
    # what | ratio | target | figures: "{r[key]}" fields of the benchmark's JSON. The
    # targets are those the benchmarks state (JSON, docstrings; the disk tier's default,
    # unsynced writes have none: benchmarks/README.md); a blank target: none.
    "storage": """\
put, 2 MiB chunks | {r[cpu_put_vs_memcpy]} | 0.9 | {r[cpu_put_gb_s]} vs {r[memcpy_gb_s]} GB/s
get into a buffer | {r[cpu_get_into_vs_memcpy]} | 0.9 | {r[cpu_get_into_gb_s]} GB/s
LMTier.store() | {r[facade_store_vs_copy]} | 0.85 | {r[facade_store_gb_s]} GB/s
LMTier.load().kv(out=) | {r[facade_load_kv_vs_copy]} | |
""",
    "disk": """\
write (page cache, default) | {r[tier_write_vs_best_raw_paired]} | | {r[tier_write_gbps]} vs \
{r[best_raw_write_gbps]} GB/s
durable write (fsync: true) | {r[tier_durable_write_vs_best_raw_durable_paired]} | 0.9 | \
{r[tier_durable_write_gbps]} vs {r[best_raw_durable_write_gbps]} GB/s
cold read | {r[tier_read_vs_best_raw_paired]} | 0.9 | {r[tier_read_gbps]} vs \
{r[best_raw_read_gbps]} GB/s
LMTier.store() + flush() | {r[facade_store_vs_best_raw_write_paired]} | | \
{r[facade_store_flush_gbps]} vs {r[facade_store_baseline_gbps]} GB/s
LMTier.load(), cold, new process | {r[facade_load_cold_vs_best_raw_paired]} | 0.9 | \
{r[facade_load_cold_new_process_gbps]} vs {r[facade_load_baseline_gbps]} GB/s
""",
    "redis": """\
put, 2 MiB chunks | {r[2MiB][put_ratio]} | 0.9 | {r[2MiB][put_gbps][tier]} vs \
{r[2MiB][put_gbps][raw_redis_py]} GB/s
get, 2 MiB chunks | {r[2MiB][get_ratio]} | 0.9 | {r[2MiB][get_gbps][tier]} vs \
{r[2MiB][get_gbps][raw_redis_py]} GB/s
put, 8 MiB chunks | {r[8MiB][put_ratio]} | 0.9 | {r[8MiB][put_gbps][tier]} vs \
{r[8MiB][put_gbps][raw_redis_py]} GB/s
get, 8 MiB chunks | {r[8MiB][get_ratio]} | 0.9 | {r[8MiB][get_gbps][tier]} vs \
{r[8MiB][get_gbps][raw_redis_py]} GB/s
lookup, 512 keys (1 / time ratio) | 1/{r[lookup_ratio]} | 0.833 | {r[lookup_512_ms][tier]} vs \
{r[lookup_512_ms][redis_py_pipeline]} ms
"""
    + FACADE.replace("{t}", "0.9"),
    "s3": """\
put, 2 MiB chunks (paired) | {r[chunk_2mib][put_paired_ratio_vs_raw_same_settings]} | 0.9 | \
best {r[chunk_2mib][best_gbps][put_tier]} vs {r[chunk_2mib][best_gbps][put_raw_same_settings]} GB/s
get, 2 MiB chunks (paired) | {r[chunk_2mib][get_paired_ratio_vs_raw_same_settings]} | 0.9 | \
best {r[chunk_2mib][best_gbps][get_tier]} vs {r[chunk_2mib][best_gbps][get_raw_same_settings]} GB/s
put, 8 MiB chunks (paired) | {r[chunk_8mib][put_paired_ratio_vs_raw_same_settings]} | 0.9 | \
best {r[chunk_8mib][best_gbps][put_tier]} vs {r[chunk_8mib][best_gbps][put_raw_same_settings]} GB/s
get, 8 MiB chunks (paired) | {r[chunk_8mib][get_paired_ratio_vs_raw_same_settings]} | 0.9 | \
best {r[chunk_8mib][best_gbps][get_tier]} vs {r[chunk_8mib][best_gbps][get_raw_same_settings]} GB/s
"""
    + FACADE.replace("{t}", ""),
}


def tier_ratios(results: dict[str, dict[str, Any]]) -> list[Ratio]:
    """Plot 1's bars, from RATIOS."""
    out = []
    for name, (tier, baseline) in TIERS.items():
        for line in RATIOS[name].splitlines() if name in results else ():
            what, value, target, figures = (cell.strip() for cell in line.split("|"))
            number = value.format(r=results[name])
            ratio = 1 / float(number[2:]) if number.startswith("1/") else float(number)
            goal = float(target) if target else None
            figures = figures.format(r=results[name])
            out.append(Ratio(tier, what, round(ratio, 3), baseline, goal, figures))
    return out


def ttft_points(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The sweep's points, or (without ``--sweep``) the two the plain run measures."""
    if "sweep" in r:
        return list(r["sweep"]["points"])
    keys = ("cached_tokens", "computed_tokens", "ideal_ms", "cpu_tier_ms", "overhead_vs_ideal")
    total, full = r["prefix_tokens"] + r["suffix_tokens"], r["full_prefill_ms"]
    cached = (r["prefix_tokens"], r["suffix_tokens"], r["ideal_ms"], r["cpu_tier_ms"])
    rows = ((0, total, full, full, 0.0), (*cached, r["cpu_overhead_vs_ideal"]))
    return [dict(zip(keys, values, strict=True)) for values in rows]


# --- the markdown: templates filled from the JSON ---------------------------------------

INTRO = """\
# lmtier benchmark report

Generated by `benchmarks/report.py` ({mode}); the benchmarks ran on {i[date]}: {i[cpus]} CPUs
({i[cpus_usable]} usable), {i[platform]}, Python {i[python]}, git commit {i[git_commit]}.
Each benchmark measures its physical baseline in the same run (benchmarks/README.md). Rerun
with `python benchmarks/report.py`, rebuild from the saved JSON with
`python benchmarks/report.py --from-json {pictures}`.

| benchmark | arguments | time | status |
|---|---|---|---|
"""
TIERS_TEXT = """\
## 1. Each tier against its physical baseline

Each figure is the tier's throughput over its physical baseline's, measured in the same run
(memcpy, the best raw file I/O, raw redis-py, raw boto3): 1.0x is as fast as the hardware and
the plain client go. Bars start at the baseline (log scale); a black tick is the target the
benchmark states.

![Each tier against its physical baseline]({img})

| tier, against | what | ratio | figures (tier vs baseline) | target |
|---|---|---|---|---|
"""
TIERS_ROW = "| {tier} | {r.what} | {r.value:.3f}x | {r.figures} | {target} |"
DEFAULTS_LINE = (
    "* {name}: {d[chunks]}-chunk lookups + loads by new caches at the default settings: found "
    "{d[found_each_time]}, loaded {d[loaded_each_time]} ({complete})."
)
STORAGE_LINE = (
    "* CPU tier: lookup of a 32k-token prompt {r[lookup_32k_tokens_us]} us (target <= "
    "{r[target_lookup_32k_us]} us); `LMTier.load()` {r[facade_load_us_per_chunk]} us a chunk."
)
TTFT_TEXT = """\
## 2. Time to first token against the cached prefix

The demo model (57M parameters, random weights, fp32 on the CPU) prefills a {total}-token
prompt whose leading chunks are cached: lmtier loads them from the CPU tier and the model
computes the rest. The ideal has the same prefix's KV already in the model's cache object (no
lmtier at all); with nothing cached both are a plain prefill. From {source} of
`bench_ttft.py`; the last chunk is always computed (it holds the prompt's last token).

![TTFT against the cached prefix]({img})

| cached tokens | share | computed | ideal ms | lmtier ms | overhead | speedup vs no cache |
|---|---|---|---|---|---|---|
"""
TTFT_ROW = (
    "| {p[cached_tokens]} | {share:.0%} | {p[computed_tokens]} | {p[ideal_ms]} | "
    "{p[cpu_tier_ms]} | {p[overhead_vs_ideal]:+.1%} | {speedup:.1f}x |"
)
TTFT_END = """
* {r[prefix_tokens]} cached + {r[suffix_tokens]} new tokens: CPU tier {r[cpu_tier_ms]} ms \
({r[cpu_overhead_vs_ideal]:+.1%} vs the ideal's {r[ideal_ms]} ms; target <= +10%); disk tier, \
page cache warm {r[disk_warm_ms]} ms ({r[disk_warm_overhead_vs_ideal]:+.1%}), cold \
{r[disk_cold_ms]} ms ({r[disk_cold_overhead_vs_ideal]:+.1%}; target <= +25%).
* Speedup: against a plain prefill of the whole prompt (the first row's ideal). In the \
benchmark's own rounds, a full prefill took {r[full_prefill_ms]} ms: {r[speedup_cpu_vs_full]}x \
the CPU tier's TTFT, where the FLOP ratio is {r[flop_ratio_full_vs_suffix]}x.
"""
TRACE_TEXT = """\
## 3. Hit ratio against capacity on a replayed chat workload

`bench_trace.py` replays {r[requests]} requests of {r[conversations]} conversations \
({r[workload]}; {r[chunk_tokens]}-token chunks of {kib} KiB; a working set of \
{r[working_set_chunks]} chunks). {sweep}"""
SWEEP_TEXT = """\
Here the same trace goes through the CPU tier alone (disk off), as fast as it goes, at each \
capacity; the baselines are an LRU cache of as many chunks, simulated on the same trace, and \
the ideal cache, which never evicts.

![Hit ratio against capacity]({img})

| capacity | chunks | MiB | lmtier hit ratio | LRU | vs LRU | requests/s |
|---|---|---|---|---|---|---|
"""
SWEEP_ROW = (
    "| {share:g}% | {c[capacity_chunks]} | {c[capacity_mib]} | {c[token_hit_ratio]} | "
    "{c[lru_hit_ratio]} | {c[hit_vs_lru]}x | {c[requests_per_s]} |"
)
TRACE_END = """
* The benchmark's own setup (CPU tier {r[cpu_capacity_chunks]} + disk {r[disk_capacity_chunks]} \
chunks), paced at {r[target_load]:g} of its ceiling: token hit ratio {r[token_hit_ratio]}, \
{r[hit_vs_lru]}x the LRU's {r[lru_hit_ratio]} (target >= {r[target_hit_vs_lru]}x), \
{r[disk_queue_drops]} disk write drops; the ideal: {r[ideal_hit_ratio]}.
"""
RAW = """\
<details><summary>bench_{name}.py: its last line</summary>

```json
{json}
```

</details>
"""


def tiers_section(results: dict[str, dict[str, Any]], pictures: Path) -> tuple[str, list[Path]]:
    if not (ratios := tier_ratios(results)):
        return "## 1. Each tier against its physical baseline\n\nNo tier benchmark ran.\n", []
    tiers_plot(ratios, path := pictures / "tiers_vs_baseline.png")
    text = TIERS_TEXT.format(img=f"{pictures.name}/{path.name}")
    for before, r in zip([None, *ratios], ratios, strict=False):
        mark = {"met": " (met)", "missed": " (**below**)", "none": ""}[r.verdict]
        target = "" if r.target is None else f">= {r.target:g}x{mark}"
        first = before is None or before.tier != r.tier
        tier = f"**{r.tier}**, against {r.baseline}" if first else ""
        text += TIERS_ROW.format(r=r, tier=tier, target=target) + "\n"
    text += "\n"
    for name in ("redis", "s3"):
        if name in results and (d := results[name]["facade"].get("defaults")):
            complete = "all, every time" if d["all_complete"] else "**not all every time**"
            text += DEFAULTS_LINE.format(name=TIERS[name][0], d=d, complete=complete) + "\n"
    if "storage" in results:
        text += STORAGE_LINE.format(r=results["storage"]) + "\n"
    return text, [path]


def ttft_section(r: dict[str, Any], pictures: Path) -> tuple[str, list[Path]]:
    points = ttft_points(r)
    total = points[0]["cached_tokens"] + points[0]["computed_tokens"]
    warm = {"lmtier, disk tier, page cache warm": (r["prefix_tokens"], r["disk_warm_ms"])}
    extras = {**warm, "lmtier, disk tier, cold": (r["prefix_tokens"], r["disk_cold_ms"])}
    title = f"TTFT of a {total}-token prompt against its cached prefix (demo model, CPU)"
    ttft_plot(points, extras, title, path := pictures / "ttft_vs_cached_prefix.png")
    source = "the sweep (`--sweep`)" if "sweep" in r else "a run without `--sweep` (two points)"
    text = TTFT_TEXT.format(total=total, source=source, img=f"{pictures.name}/{path.name}")
    for p in points:
        share, speedup = p["cached_tokens"] / total, points[0]["ideal_ms"] / p["cpu_tier_ms"]
        text += TTFT_ROW.format(p=p, share=share, speedup=speedup) + "\n"
    return text + TTFT_END.format(r=r), [path]


def trace_section(r: dict[str, Any], pictures: Path) -> tuple[str, list[Path]]:
    kib = r["chunk_file_bytes"] // 1024
    if not (rows := r.get("capacities")):
        text = TRACE_TEXT.format(r=r, kib=kib, sweep="It ran without `--capacities`: no sweep.\n")
        return text + TRACE_END.format(r=r), []
    title = f"Token hit ratio against CPU tier capacity ({r['requests']} replayed chat requests)"
    capacity_plot(rows, r["ideal_hit_ratio"], title, path := pictures / "hit_ratio_vs_capacity.png")
    text = TRACE_TEXT.format(
        r=r, kib=kib, sweep=SWEEP_TEXT.format(img=f"{pictures.name}/{path.name}")
    )
    for c in rows:
        text += SWEEP_ROW.format(c=c, share=100 * c["capacity_fraction"]) + "\n"
    return text + TRACE_END.format(r=r), [path]


def render(
    results: dict[str, dict[str, Any]],
    info: dict[str, Any],
    status: dict[str, str],
    seconds: dict[str, float],
    out: Path,
    quick: bool,
) -> list[Path]:
    """report.md and its PNGs under ``out``; returns the PNGs."""
    pictures = out / "report"
    quick = info.get("quick", quick)
    saved = pictures.resolve()
    saved_at = saved.relative_to(REPO) if saved.is_relative_to(REPO) else saved
    text = INTRO.format(mode="--quick" if quick else "full runs", i=info, pictures=saved_at)
    for name, state in status.items():
        arguments = " ".join(["--quick"] * quick + list(BENCHMARKS[name]))
        took = f"{seconds[name]:.0f} s" if name in seconds else ""
        text += f"| `bench_{name}.py` | {arguments} | {took} | {state} |\n"
    text += "\n" + (part := tiers_section(results, pictures))[0]
    plots = part[1]
    for number, name, section in ((2, "ttft", ttft_section), (3, "trace", trace_section)):
        missing = f"## {number}. bench_{name}.py did not run\n", []
        part, drawn = section(results[name], pictures) if name in results else missing
        text += "\n" + part
        plots += drawn
    text += "\n## Raw results\n\n"
    for name, result in results.items():
        text += RAW.format(name=name, json=json.dumps(result, indent=1)) + "\n"
    (out / "report.md").write_text(text)
    return plots


def gather(names: list[str], args: argparse.Namespace) -> tuple[dict[str, Any], ...]:
    """(results, machine info, status and seconds per benchmark): run or read."""
    results: dict[str, dict[str, Any]] = {}
    status: dict[str, str] = {}
    seconds: dict[str, float] = {}
    if args.from_json:
        saved = args.from_json / "machine.json"
        unknown = {"date": "an unknown date (no machine.json there: this machine below)"}
        info = json.loads(saved.read_text()) if saved.exists() else {**machine(), **unknown}
        for name in names:
            path = args.from_json / f"{name}.json"
            try:
                results[name] = last_json(path.read_text())
                status[name] = f"from {path}"
            except FileNotFoundError:
                status[name] = f"not in the report: no {path}"
            except (OSError, ValueError) as exc:
                status[name] = f"not in the report: {path}: {exc}"
        return results, info, status, seconds
    info = {**machine(), "quick": args.quick}
    for name in names:
        if reason := missing_requirement(name):
            status[name] = f"not run: {reason}"
        else:
            print(f"running bench_{name}.py ...", file=sys.stderr, flush=True)
            result, reason, seconds[name] = run_benchmark(name, args.quick)
            status[name] = f"not run: {reason}" if result is None else "ran"
            results.update({name: result} if result is not None else {})
        print(f"bench_{name}.py: {status[name]}", file=sys.stderr, flush=True)
    return results, info, status, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    quick = "run each benchmark with --quick (the default)"
    group.add_argument("--quick", dest="quick", action="store_true", default=True, help=quick)
    group.add_argument("--full", dest="quick", action="store_false", help="their full runs")
    parser.add_argument("--only", help=f"a comma-separated subset of {','.join(BENCHMARKS)}")
    parser.add_argument("--from-json", type=Path, help="report DIR/NAME.json, running nothing")
    parser.add_argument("--out", type=Path, default=HERE, help="for report.md and report/")
    args = parser.parse_args()
    names = list(BENCHMARKS)
    if args.only:
        names = [n.strip().removeprefix("bench_").removesuffix(".py") for n in args.only.split(",")]
        if unknown := [n for n in names if n not in BENCHMARKS]:
            parser.error(f"unknown benchmark {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}")
    pyplot()  # no matplotlib: say so now, not after minutes of benchmarks
    started = time.perf_counter()
    results, info, status, seconds = gather(names, args)
    pictures = args.out / "report"
    pictures.mkdir(parents=True, exist_ok=True)
    for name, result in results.items():  # the report's own copy, for --from-json
        (pictures / f"{name}.json").write_text(json.dumps(result) + "\n")
    (pictures / "machine.json").write_text(json.dumps(info) + "\n")
    plots = render(results, info, status, seconds, args.out, args.quick)
    summary = {
        "benchmark": "report",
        "ran": list(results),
        "not_run": {n: s for n, s in status.items() if n not in results},
        "from_json": None if args.from_json is None else str(args.from_json),
        "quick": info.get("quick", args.quick),
        "report": str(args.out / "report.md"),
        "plots": [str(p) for p in plots],
        "seconds": {n: round(s, 1) for n, s in seconds.items()},
        "total_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
