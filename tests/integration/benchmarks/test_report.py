"""benchmarks/report.py: a report built from saved JSON lines shaped like each benchmark's
real output (``--from-json``), and one cheap benchmark run through it end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support import ROOT

pytest.importorskip("matplotlib")

pytestmark = pytest.mark.integration

REPORT = ROOT / "benchmarks" / "report.py"
PNG = b"\x89PNG\r\n\x1a\n"
PLOTS = ("tiers_vs_baseline", "ttft_vs_cached_prefix", "hit_ratio_vs_capacity")
SECTIONS = (
    "## 1. Each tier against its physical baseline",
    "## 2. Time to first token against the cached prefix",
    "## 3. Hit ratio against capacity on a replayed chat workload",
    "## Raw results",
)

# The last lines of real --quick runs (2026-12-01, 2 cores), trimmed to fewer keys.
FACADE = """{"chunks": 64, "chunk_bytes": 2097408,
 "store": {"facade_ms": 159.05, "raw_ms": 67.54, "ratio": 0.425},
 "lookup": {"facade_ms": 1.17, "raw_ms": 1.05, "ratio": 0.901},
 "load": {"facade_ms": 90.76, "raw_ms": 115.38, "ratio": 1.271},
 "lookup_then_load_keys": {"facade_ms": 83.73, "raw_ms": 107.21, "ratio": 1.28},
 "defaults": {"chunks": 512, "found_each_time": [512, 512, 512],
  "loaded_each_time": [512, 512, 512], "all_complete": true}}"""
SIZE_S3 = """{"best_gbps": {"put_raw_same_settings": 0.383, "get_raw_same_settings": 0.673,
 "put_tier": 0.352, "get_tier": 0.692}, "put_paired_ratio_vs_raw_same_settings": 0.944,
 "get_paired_ratio_vs_raw_same_settings": 1.105}"""
SIZE_REDIS = """{"chunk_bytes": 2097408, "put_gbps": {"tier": 2.309, "raw_redis_py": 2.128},
 "put_ratio": 1.085, "get_gbps": {"tier": 1.923, "raw_redis_py": 0.936}, "get_ratio": 2.055}"""
SAMPLES: dict[str, str] = {
    "storage": """{"benchmark": "storage", "memcpy_gb_s": 13.28, "cpu_put_gb_s": 12.46,
 "cpu_get_into_gb_s": 14.62, "cpu_put_vs_memcpy": 0.938, "cpu_get_into_vs_memcpy": 1.101,
 "lookup_32k_tokens_us": 53.5, "target_lookup_32k_us": 100, "facade_store_gb_s": 14.05,
 "facade_store_vs_copy": 0.843, "facade_load_us_per_chunk": 4.0,
 "facade_load_kv_vs_copy": 0.831, "target_met": false}""",
    "disk": """{"benchmark": "disk", "best_raw_write_gbps": 6.708,
 "best_raw_durable_write_gbps": 1.511, "best_raw_read_gbps": 1.611, "tier_write_gbps": 3.936,
 "tier_durable_write_gbps": 1.667, "tier_read_gbps": 1.278,
 "tier_write_vs_best_raw_paired": 0.591, "tier_durable_write_vs_best_raw_durable_paired": 1.096,
 "tier_read_vs_best_raw_paired": 0.98, "target_vs_best_raw": 0.9,
 "facade_store_flush_gbps": 1.283, "facade_store_baseline_gbps": 3.077,
 "facade_store_vs_best_raw_write_paired": 0.465, "facade_load_cold_new_process_gbps": 1.18,
 "facade_load_baseline_gbps": 1.841, "facade_load_cold_vs_best_raw_paired": 0.641}""",
    "redis": f"""{{"bench": "redis", "2MiB": {SIZE_REDIS}, "8MiB": {SIZE_REDIS},
 "lookup_512_ms": {{"tier": 0.549, "redis_py_pipeline": 4.428}}, "lookup_ratio": 0.124,
 "facade": {FACADE}}}""",
    "s3": f"""{{"bench": "s3", "chunk_2mib": {SIZE_S3}, "chunk_8mib": {SIZE_S3},
 "facade": {FACADE}}}""",
    "ttft": """{"benchmark": "ttft", "prefix_tokens": 3840, "suffix_tokens": 256,
 "full_prefill_ms": 2061.0, "ideal_ms": 184.0, "cpu_tier_ms": 191.0, "disk_warm_ms": 195.0,
 "disk_cold_ms": 206.0, "cpu_overhead_vs_ideal": 0.035, "disk_warm_overhead_vs_ideal": 0.064,
 "disk_cold_overhead_vs_ideal": 0.119, "speedup_cpu_vs_full": 10.8,
 "flop_ratio_full_vs_suffix": 11.56, "targets": {"cpu_overhead": 0.1, "disk_overhead": 0.25},
 "sweep": {"prompt_tokens": 4096, "tier": "cpu", "rounds": 3, "points": [
  {"fraction": 0.0, "cached_tokens": 0, "computed_tokens": 4096, "ideal_ms": 2048.5,
   "cpu_tier_ms": 2050.5, "overhead_vs_ideal": 0.001},
  {"fraction": 0.5, "cached_tokens": 2048, "computed_tokens": 2048, "ideal_ms": 1040.1,
   "cpu_tier_ms": 1066.1, "overhead_vs_ideal": 0.018},
  {"fraction": 1.0, "cached_tokens": 3840, "computed_tokens": 256, "ideal_ms": 184.0,
   "cpu_tier_ms": 191.0, "overhead_vs_ideal": 0.035}]}}""",
    "trace": """{"benchmark": "trace", "workload": "synthetic(seed=0)", "requests": 3000,
 "conversations": 407, "working_set_chunks": 3878, "chunk_tokens": 512,
 "chunk_file_bytes": 33024, "disk_capacity_chunks": 194, "cpu_capacity_chunks": 39,
 "ideal_hit_ratio": 0.8434, "lru_hit_ratio": 0.3296, "target_load": 0.25,
 "token_hit_ratio": 0.3284, "hit_vs_lru": 0.996, "disk_queue_drops": 0,
 "target_hit_vs_lru": 0.98, "capacities": [
  {"capacity_fraction": 0.01, "capacity_chunks": 39, "capacity_mib": 1.2,
   "token_hit_ratio": 0.1407, "lru_hit_ratio": 0.1407, "hit_vs_lru": 1.0,
   "requests_per_s": 5138.2},
  {"capacity_fraction": 0.2, "capacity_chunks": 776, "capacity_mib": 24.4,
   "token_hit_ratio": 0.6379, "lru_hit_ratio": 0.6379, "hit_vs_lru": 1.0,
   "requests_per_s": 5077.0}]}""",
}


def report(*args: str) -> dict[str, Any]:
    """Run report.py; its last line, parsed."""
    done = subprocess.run(
        [sys.executable, str(REPORT), *args], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def save(directory: Path, names: tuple[str, ...] = tuple(SAMPLES)) -> Path:
    """Each benchmark's output as saved: a table, then its JSON line last."""
    directory.mkdir()
    for name in names:
        (directory / f"{name}.json").write_text(
            f"  some: table\n{SAMPLES[name]}\n".replace("\n ", " ")
        )
    return directory


def test_samples_are_json() -> None:
    for text in SAMPLES.values():
        assert isinstance(json.loads(text), dict)


def test_report_from_saved_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    summary = report("--from-json", str(save(tmp_path / "saved")), "--out", str(out))
    assert summary["ran"] == list(SAMPLES) and summary["not_run"] == {}
    assert summary["report"] == str(out / "report.md")
    text = (out / "report.md").read_text()
    for heading in SECTIONS:
        assert heading in text
    for name in PLOTS:
        assert f"](report/{name}.png)" in text
        assert (out / "report" / f"{name}.png").read_bytes()[:8] == PNG
    for name in SAMPLES:
        assert f"<summary>bench_{name}.py" in text
    assert "| **Redis tier**, against raw redis-py | put, 2 MiB chunks | 1.085x" in text
    assert "| 2048 | 50% | 2048 |" in text  # the TTFT sweep's table
    assert "| 20% | 776 | 24.4 | 0.6379 |" in text  # the capacity sweep's

    # The report keeps each benchmark's JSON beside its plots: it rebuilds from them.
    again = report("--from-json", str(out / "report"), "--out", str(tmp_path / "again"))
    assert again["ran"] == list(SAMPLES)


def test_missing_benchmarks_get_a_line(tmp_path: Path) -> None:
    saved = save(tmp_path / "saved", ("storage",))
    out = tmp_path / "out"
    summary = report("--from-json", str(saved), "--out", str(out), "--only", "storage,ttft")
    assert summary["ran"] == ["storage"] and list(summary["not_run"]) == ["ttft"]
    text = (out / "report.md").read_text()
    assert "not in the report: no " in text
    assert "## 2. bench_ttft.py did not run" in text
    assert (out / "report" / "tiers_vs_baseline.png").read_bytes()[:8] == PNG
    assert not (out / "report" / "ttft_vs_cached_prefix.png").exists()


def test_unknown_benchmark_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPORT), "--only", "nope", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and "unknown benchmark nope" in done.stderr


@pytest.mark.slow
def test_one_real_benchmark_end_to_end(tmp_path: Path) -> None:
    """bench_storage.py --quick (a few seconds here) run by the report."""
    summary = report("--only", "storage", "--out", str(tmp_path))
    assert summary["ran"] == ["storage"], summary["not_run"]
    assert json.loads((tmp_path / "report" / "storage.json").read_text())["benchmark"] == "storage"
    assert (tmp_path / "report" / "tiers_vs_baseline.png").read_bytes()[:8] == PNG
    assert "| `bench_storage.py` | --quick |" in (tmp_path / "report.md").read_text()
