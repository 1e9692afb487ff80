"""`lmtier purge` as a process over real tiers (a disk directory, redis-server, a moto S3
endpoint): a dry run counts, no terminal and no --yes deletes nothing, and a purge
removes every tensor-parallel rank's chunks of one model revision from every tier,
leaving the next revision's untouched."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch

from lmtier import KVSpec, LMTier, load_config
from support.redis_servers import RedisServer
from support.s3_server import MotoServer, s3_credentials, s3_server  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BUCKET = "lmtier-ops-purge"
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16)
CHUNK = 16
GEOMETRY = ("--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "16")
TOKENS = list(range(100, 100 + 4 * CHUNK))


def config_file(tmp_path: Path, redis: RedisServer, endpoint: str) -> Path:
    settings: dict[str, Any] = {
        "chunk_size": CHUNK,
        "model_id": "m",
        "cpu": {"capacity_bytes": "8MiB", "staging_bytes": "2MiB"},
        "disk": {"path": str(tmp_path / "chunks"), "capacity_bytes": "64MiB"},
        "redis": {"url": redis.url, "key_prefix": f"p{uuid.uuid4().hex[:6]}:"},
        "s3": {"bucket": BUCKET, "endpoint_url": endpoint, "prefix": f"{uuid.uuid4().hex[:6]}/"},
    }
    path = tmp_path / "lmtier.yaml"
    path.write_text(json.dumps(settings))
    return path


def store(config: Path, revision: str, rank: int, tp_size: int) -> None:
    with LMTier.open(
        load_config(config), kv=SPEC, model_revision=revision, tp_size=tp_size, tp_rank=rank
    ) as cache:
        assert cache.store(TOKENS, torch.randn(SPEC.shape(len(TOKENS)))) == 4
        cache.flush()


def held(config: Path, revision: str, rank: int, tp_size: int) -> dict[str, int]:
    with LMTier.open(
        load_config(config), kv=SPEC, model_revision=revision, tp_size=tp_size, tp_rank=rank
    ) as cache:
        counts = cache.purge(dry_run=True)
    return {tier: n for tier, n in counts.items() if tier != "cpu"}


def purge(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmtier.cli", "--config", str(config), "purge", *GEOMETRY, *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        check=False,
        timeout=300,
    )


def test_purge_takes_one_revision_from_every_tier_and_rank(
    tmp_path: Path,
    redis_server: RedisServer,
    s3_server: MotoServer,  # noqa: F811
) -> None:
    boto3.session.Session().client(
        "s3", endpoint_url=s3_server.endpoint, region_name="us-east-1"
    ).create_bucket(Bucket=BUCKET)
    config = config_file(tmp_path, redis_server, s3_server.endpoint)
    for rank in (0, 1):
        store(config, "old", rank, 2)
        store(config, "new", rank, 2)
    everywhere = {"disk": 4, "redis": 4, "s3": 4}
    assert held(config, "old", 1, 2) == everywhere

    dry = purge(config, "--model-revision", "old", "--tp-size", "2", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout)
    assert report["chunks"] == 24 and not report["deleted"]
    assert [entry["tp_rank"] for entry in report["namespaces"]] == [0, 1]

    refused = purge(config, "--model-revision", "old", "--tp-size", "2")
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert held(config, "old", 0, 2) == everywhere, "nothing deleted without --yes"

    done = purge(config, "--model-revision", "old", "--tp-size", "2", "--yes", "--json")
    assert done.returncode == 0, done.stderr
    deleted = json.loads(done.stdout)
    assert deleted["deleted"] and deleted["incomplete_tiers"] == []
    assert [entry["purged"] for entry in deleted["namespaces"]] == [
        {"cpu": 0, **everywhere},
        {"cpu": 0, **everywhere},
    ]
    for rank in (0, 1):
        assert held(config, "old", rank, 2) == {"disk": 0, "redis": 0, "s3": 0}
        assert held(config, "new", rank, 2) == everywhere, "the next revision is untouched"

    again = purge(config, "--model-revision", "old", "--tp-size", "2", "--yes")
    assert again.returncode == 0 and "nothing to purge" in again.stdout
