"""`lmtier warm --prefetch` between two nodes sharing a real redis-server: node A
computes a prompt's KV (its disk and Redis get it), node B pulls the chunks from Redis
into its own disk tier, and keeps serving them after Redis is flushed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from redis_servers import RedisServer

from lmtier import LMTier, load_config
from lmtier_connector.hf.adapter import kv_spec_of
from lmtier_connector.hf.demo_model import build_demo_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHUNK = 64
PROMPT = {"tokens": list(range(2000, 2000 + 5 * CHUNK + 7))}


def node(directory: Path, redis_url: str | None) -> Path:
    settings: dict[str, Any] = {
        "chunk_size": CHUNK,
        "cpu": {"capacity_bytes": "32MiB", "staging_bytes": "16MiB"},
        "disk": {"path": str(directory / "chunks"), "capacity_bytes": "256MiB"},
    }
    if redis_url is not None:
        settings["redis"] = {"url": redis_url}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "lmtier.yaml"
    path.write_text(json.dumps(settings))
    return path


def warm(config: Path, *args: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "lmtier.cli", "--config", str(config), "warm", "--json", *args, "-"],
        input=json.dumps(PROMPT) + "\n",
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    summary: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return summary


def test_prefetch_pulls_a_peers_chunks_from_redis_onto_local_disk(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    redis_server.client().flushall()
    computed = warm(node(tmp_path / "a", redis_server.url))
    assert computed["warmed"] == 1 and computed["chunks_stored"]["redis"] == 5

    b = node(tmp_path / "b", redis_server.url)
    fetched = warm(b, "--prefetch")
    assert (fetched["warmed"], fetched["chunks_stored"]) == (1, {"redis": 5})
    assert warm(b, "--prefetch")["skipped"] == 1, "now on B's disk: nothing to fetch"

    redis_server.client().flushall()
    demo = build_demo_model(0)
    local_only = node(tmp_path / "b", None)
    with LMTier.open(
        load_config(local_only),
        kv=kv_spec_of(demo.model),
        model_id=demo.model_id,
        model_revision=demo.revision,
    ) as cache:
        found = cache.lookup(PROMPT["tokens"])
        assert found.tokens_by_tier(CHUNK) == {"disk": 5 * CHUNK}
        with cache.load(PROMPT["tokens"]) as hit:
            assert hit.num_tokens == 5 * CHUNK  # checksums verified on the way
