"""``lmtier stats`` and ``lmtier lookup`` against a real ``lmtier serve`` process
(``--sidecar``): the sidecar's tiers, counters and gauges, in the stats schema, and
a prompt's cached tokens split between its host memory and its disk."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lmtier import KVSpec, connect, load_config
from lmtier.ops.stats import schema_problems
from lmtier.testing.sidecar import SidecarProcess
from support.sidecar_helpers import run_lmtier

pytestmark = pytest.mark.integration

CHUNK = 16
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8)  # 4 KiB + a header per chunk
GEOMETRY = ["--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8"]
CPU_CHUNKS = 4
PROMPT = list(range(7, 7 + 6 * CHUNK))  # six chunks: more than the sidecar's host memory


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[SidecarProcess]:
    settings: dict[str, Any] = {
        "chunk_size": CHUNK,
        "cpu": {"capacity_bytes": f"{8 * CPU_CHUNKS}KiB", "staging_bytes": "64KiB"},
        "disk": {"path": str(tmp_path / "chunks"), "capacity_bytes": "16MiB"},
        "sidecar": {"slab_bytes": "8KiB"},
    }
    with SidecarProcess(tmp_path / "sidecar", settings) as process:
        yield process


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    """The operator's config: the model and chunk size (the tiers are the sidecar's)."""
    path = tmp_path / "ops.yaml"
    path.write_text(yaml.safe_dump({"model_id": "m", "chunk_size": CHUNK}))
    return path


def lmtier(config_path: Path, *args: str) -> dict[str, Any]:
    """``lmtier --config CONFIG ARGS`` as a process; its JSON output."""
    done = run_lmtier(config_path, *args)
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def fill(target: str, config_path: Path) -> None:
    """Store PROMPT through the sidecar (its host memory keeps the last CPU_CHUNKS,
    its disk all six), then load the first two chunks back into its host memory."""
    kv = torch.randn(SPEC.shape(len(PROMPT)), generator=torch.Generator().manual_seed(1))
    with connect(target, load_config(config_path), kv=SPEC) as cache:
        assert cache.store(PROMPT, kv) == 6
        cache.flush()
        with cache.load(PROMPT[: 2 * CHUNK]) as hit:
            assert hit.tokens_by_tier() == {"disk": 2 * CHUNK}


def test_stats_of_a_sidecar_follow_the_schema(sidecar: SidecarProcess, config_path: Path) -> None:
    fill(sidecar.target, config_path)
    report = lmtier(config_path, "stats", "--sidecar", sidecar.target, "--json")
    assert schema_problems(report) == []
    assert report["source"] == "sidecar"
    assert report["sidecar"]["slabs_total"] == CPU_CHUNKS + 8
    assert report["sidecar"]["sessions"] >= 1  # this command's own
    tiers = {row["name"]: row for row in report["tiers"]}
    assert [row["name"] for row in report["tiers"]] == ["cpu", "disk"]
    cpu, disk = tiers["cpu"], tiers["disk"]
    assert cpu["capacity_bytes"] == CPU_CHUNKS * 8 * 1024 and cpu["chunks"] == CPU_CHUNKS
    assert cpu["evictions"] >= 2
    assert disk["chunks"] == 6 and disk["capacity_bytes"] == 16 * 1024**2
    assert disk["hits"] == 2 and disk["hit_ratio"] == 1.0
    assert isinstance(disk["read_p50_s"], float) and disk["read_p99_s"] >= disk["read_p50_s"]
    assert isinstance(disk["write_p50_s"], float)
    assert disk["breaker"] is None  # the Stats call carries numbers only


def test_lookup_through_a_sidecar_reports_each_tier(
    sidecar: SidecarProcess, config_path: Path
) -> None:
    fill(sidecar.target, config_path)
    tokens = " ".join(map(str, PROMPT))
    args = ["lookup", "--sidecar", sidecar.target, *GEOMETRY, "--tokens", tokens, "--json"]
    report = lmtier(config_path, *args)
    assert report["source"] == "sidecar"
    assert report["cached_tokens"] == 6 * CHUNK
    assert report["tokens_by_tier"] == {"cpu": 2 * CHUNK, "disk": 4 * CHUNK}
    other = lmtier(config_path, *args, "--model-id", "another-model")
    assert other["cached_tokens"] == 0 and other["tokens_by_tier"] == {}
