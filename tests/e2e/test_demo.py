"""`lmtier demo`, the main job: runs, matches the no-cache logits, and a second process
is served from the disk tier; over a sidecar (``--sidecar``), from the sidecar's CPU
tier.

Each run is kept cheap rather than given long to finish: prompts scaled to a tenth,
chunks of 64 tokens, one torch thread (threads of one matmul stall each other on a
busy machine) and a small CPU tier; a run takes seconds on an idle machine, and the
time limits (:data:`demo_server.HANG_S` a run) only catch a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.demo_server import HANG_S

# Two demo runs per test: the suite's per-test limit (pyproject) is for one.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(2 * HANG_S + 120)]


def run_demo(*args: str) -> dict[str, object]:
    env = {**os.environ, "LMTIER_CHUNK_SIZE": "64", "PYTHONHASHSEED": "random"}
    command = [sys.executable, "-m", "lmtier.cli", "demo", "--json", "--scale", "0.1"]
    result = subprocess.run(
        [*command, "--threads", "1", *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=HANG_S,
    )
    assert result.returncode == 0, f"lmtier demo failed:\n{result.stderr[-6000:]}"
    parsed: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return parsed


def disk_demo(cache_dir: Path) -> dict[str, object]:
    return run_demo("--cache-dir", str(cache_dir), "--cpu-capacity", "64MiB")


def test_demo_twice_second_run_is_served_from_disk(tmp_path: Path) -> None:
    first = disk_demo(tmp_path)
    summary = first["summary"]
    assert isinstance(summary, dict)
    assert summary["requests"] == 9
    assert summary["max_logit_diff"] <= 1e-5
    assert summary["cached_tokens"] > 0
    assert set(summary["cached_tokens_by_tier"]) <= {"device", "cpu", "disk"}
    rows = first["rows"]
    assert isinstance(rows, list)
    assert rows[0]["cached_tokens"] == 0  # a fresh cache: nothing to serve yet

    second = disk_demo(tmp_path)
    rows = second["rows"]
    assert isinstance(rows, list)
    assert rows[0]["cached_tokens"] > 0
    assert rows[0]["tiers"].get("disk", 0) == rows[0]["cached_tokens"]
    assert second["summary"]["max_logit_diff"] <= 1e-5  # type: ignore[index]


def test_demo_over_a_sidecar_second_process_is_served_from_its_cpu_tier(tmp_path: Path) -> None:
    """Two demo processes, each an adapter over one sidecar: the KV the first stored
    serves the second (CPU tier hits; the device tier is per process), with the logits
    of a full prefill."""
    pytest.importorskip("grpc")
    from lmtier.testing.sidecar import SidecarProcess

    token = tmp_path / "token"
    token.write_text("demo-token\n")
    token.chmod(0o600)
    settings = {"cpu": {"capacity_bytes": "64MiB"}, "sidecar": {"auth_token": "demo-token"}}
    with SidecarProcess(tmp_path / "sidecar", settings) as sidecar:
        args = ("--sidecar", sidecar.target, "--sidecar-token-file", str(token))
        first = run_demo(*args)
        rows = first["rows"]
        assert isinstance(rows, list)
        assert rows[0]["cached_tokens"] == 0  # a fresh sidecar
        assert first["summary"]["max_logit_diff"] <= 1e-5  # type: ignore[index]

        second = run_demo(*args)
        rows = second["rows"]
        assert isinstance(rows, list)
        assert rows[0]["cached_tokens"] > 0
        assert rows[0]["tiers"] == {"cpu": rows[0]["cached_tokens"]}  # from the sidecar
        assert rows[0]["max_logit_diff"] <= 1e-5
        summary = second["summary"]
        assert isinstance(summary, dict)
        assert "cpu" in summary["cached_tokens_by_tier"]
        assert set(summary["cached_tokens_by_tier"]) <= {"device", "cpu"}  # no disk anywhere
        assert summary["max_logit_diff"] <= 1e-5


def test_demo_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lmtier.cli", "demo", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--model" in result.stdout
    assert "--json" in result.stdout
