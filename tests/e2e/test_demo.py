"""`lmtier demo`, the main job: runs, matches the no-cache logits, and a second process
is served from the disk tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def run_demo(cache_dir: Path) -> dict[str, object]:
    env = {**os.environ, "LMTIER_CHUNK_SIZE": "64", "PYTHONHASHSEED": "random"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmtier.cli",
            "demo",
            "--json",
            "--scale",
            "0.2",
            "--cache-dir",
            str(cache_dir),
            "--cpu-capacity",
            "256MiB",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    parsed: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return parsed


def test_demo_twice_second_run_is_served_from_disk(tmp_path: Path) -> None:
    first = run_demo(tmp_path)
    summary = first["summary"]
    assert isinstance(summary, dict)
    assert summary["requests"] == 9
    assert summary["max_logit_diff"] <= 1e-5
    assert summary["cached_tokens"] > 0
    assert set(summary["cached_tokens_by_tier"]) <= {"device", "cpu", "disk"}
    rows = first["rows"]
    assert isinstance(rows, list)
    assert rows[0]["cached_tokens"] == 0  # a fresh cache: nothing to serve yet

    second = run_demo(tmp_path)
    rows = second["rows"]
    assert isinstance(rows, list)
    assert rows[0]["cached_tokens"] > 0
    assert rows[0]["tiers"].get("disk", 0) == rows[0]["cached_tokens"]
    assert second["summary"]["max_logit_diff"] <= 1e-5  # type: ignore[index]


def test_demo_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lmtier.cli", "demo", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--model" in result.stdout
    assert "--json" in result.stdout
