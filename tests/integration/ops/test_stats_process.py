"""``lmtier stats`` as a process: the embedded tiers' state in the JSON schema, and
``--watch`` until Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lmtier.ops.stats import SCHEMA, schema_problems
from support.ops_helpers import (
    CHUNK,
    clean_env,
    run_process,
    store,
    write_config,
)

pytestmark = pytest.mark.integration

# What the sidecar's Stats call carries: numbers only, as floats, nested names flattened.


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    path = write_config(tmp_path)
    store(path, list(range(5 * CHUNK + 3)))  # five chunks on disk
    return path


def test_embedded_json_is_the_schema_with_the_disk_tier_state(config_path: Path) -> None:
    done = run_process("--config", str(config_path), "stats", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert schema_problems(report) == []
    assert report["schema"] == SCHEMA and report["source"] == "embedded"
    assert report["sidecar"] is None
    tiers = {row["name"]: row for row in report["tiers"]}
    assert [row["name"] for row in report["tiers"]] == ["cpu", "disk"]
    disk = tiers["disk"]
    assert disk["chunks"] == 5 and disk["used_bytes"] > 5 * CHUNK
    assert disk["capacity_bytes"] == 64 * 1024**2 and disk["breaker"] == "closed"
    assert disk["hit_ratio"] is None and disk["read_p50_s"] is None  # nothing read yet
    cpu = tiers["cpu"]  # the configured size; nothing of this process's own memory
    assert cpu["capacity_bytes"] == 1024**2
    assert cpu["used_bytes"] is None and cpu["chunks"] is None


def test_watch_redraws_until_ctrl_c_then_exits_0(config_path: Path) -> None:
    # main() with Python's own Ctrl-C handling, whatever the test runner's shell
    # ignores: a background job's SIGINT can be ignored, and that is inherited.
    program = (
        "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from lmtier.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    args = ["--config", str(config_path), "stats", "--json", "--watch", "0.05"]
    with subprocess.Popen(
        [sys.executable, "-c", program, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    ) as process:
        assert process.stdout is not None
        first, second = process.stdout.readline(), process.stdout.readline()
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    assert "Traceback" not in err
    assert schema_problems(json.loads(first)) == schema_problems(json.loads(second)) == []
