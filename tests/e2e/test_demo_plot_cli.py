"""`lmtier demo --plot FILE.png`: the demo's run draws its PNG, and stdout is still
the report (one JSON line with --json)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.demo_server import HANG_S

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_demo_writes_its_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "ttft.png"
    env = {**os.environ, "LMTIER_CHUNK_SIZE": "64", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    command = [sys.executable, "-m", "lmtier.cli", "demo", "--json", "--scale", "0.1"]
    command += ["--no-disk", "--threads", "1", "--plot", str(out)]
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, check=False, timeout=HANG_S
    )
    assert result.returncode == 0, result.stderr[-6000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["summary"]["requests"] == 9
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 10_000
