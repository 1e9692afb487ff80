"""A load test: 8 client processes (half on shared memory, half streaming) mixing
lookups, loads and stores of shared prompts against one sidecar. Every call answers
OK, every load is bit-exact, the sidecar's private memory stays bounded, and every
slab comes back.

``SIDECAR_LOAD_TEST_S`` sets how long the clients run (default 10 s here; the
closing figures were measured with 60; ``pytest -s`` prints them). Not an
``LMTIER_`` name: every one of those is a config key, and the sidecar, which
inherits the environment, refuses unknown ones.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lmtier.testing.sidecar import SidecarProcess
from support import child_env
from support.sidecar_client import connect

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLIENT = ("-m", "support.sidecar_client")
"""The raw client, a process of its own (``python -m``, with :func:`support.child_env`)."""
CLIENTS = 8
SECONDS = float(os.environ.get("SIDECAR_LOAD_TEST_S", "10"))
RSS_GROWTH_BOUND = 96 * 1024**2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def private_rss(pid: int) -> int:
    """Anonymous resident memory (the shared pool is not in it)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as reply:
        text = reply.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "lmtier_sidecar_requests_total":
                code = sample.labels["code"]
                found[code] = found.get(code, 0.0) + sample.value
    return found


def test_eight_clients_mixing_calls(tmp_path: Path) -> None:
    port = free_port()
    settings = {
        "cpu": {"capacity_bytes": "64MiB", "staging_bytes": "32MiB"},
        "sidecar": {"slab_bytes": "520KiB", "metrics_listen": f"127.0.0.1:{port}"},
    }
    with SidecarProcess(tmp_path, settings) as sidecar:
        warm = connect(sidecar.target, stream=False)
        baseline = private_rss(sidecar.pid)
        clients = [
            subprocess.Popen(
                [
                    sys.executable,
                    *CLIENT,
                    sidecar.target,
                    "mix",
                    "100",
                    str(4 * 256 + 17),
                    "--seconds",
                    str(SECONDS),
                    *(["--stream"] if index % 2 else []),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=child_env(),
            )
            for index in range(CLIENTS)
        ]
        results = []
        for client in clients:
            out, err = client.communicate(timeout=SECONDS + 300)
            assert client.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
        assert [r["errors"] for r in results] == [0] * CLIENTS
        assert all(r["loads"] and r["stores"] and r["lookups"] for r in results)
        assert sum(r["loaded_tokens"] for r in results) > 0
        codes = scrape(port)
        assert set(codes) == {"OK"}, codes
        gauges = warm.stats()["sidecar"]
        assert gauges["leases"] == 0
        assert gauges["sessions"] == 1  # the clients' sessions ended with them
        growth = private_rss(sidecar.pid) - baseline
        totals = {k: sum(r[k] for r in results) for k in ("lookups", "loads", "stores")}
        print(json.dumps({"seconds": SECONDS, **totals, "requests": codes, "rss_growth": growth}))
        assert growth < RSS_GROWTH_BOUND
        warm.close()
