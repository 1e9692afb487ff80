"""Slow but healthy links to real servers (a rate-capped TCP proxy in front of
redis-server and moto): late reads must never land in a reused slab, and a long
prompt must be served at the link's speed, not time out whole."""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import urlsplit

import boto3
import pytest
import torch

from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.config import CPUTierConfig, DiskTierConfig, RedisTierConfig, S3TierConfig
from support.redis_servers import RedisServer
from support.s3_server import MotoServer, s3_credentials, s3_server  # noqa: F401
from support.slow_link import SlowLink

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # links paced in real time


def kv_for(spec: KVSpec, num_tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(spec.shape(num_tokens), generator=torch.Generator().manual_seed(seed))


def wait_until_no_call_in_flight(cache: LMTier, tier: str) -> None:
    """Abandoned calls finish when the link has delivered their bytes (seconds)."""
    deadline = time.monotonic() + 60
    while cache.stats()[tier]["abandoned_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cache.stats()[tier]["abandoned_in_flight"] == 0


def test_late_s3_reads_never_reach_another_tenants_slabs(
    s3_server: MotoServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    # 512 KiB chunks; the first read batch (4 chunks, 2 MiB) needs ~1 s at 2 MB/s and
    # times out after 0.3 s, with its GETs still streaming into their slabs.
    spec, chunk = KVSpec(num_layers=4, num_kv_heads=4, head_dim=64), 64
    boto3.client("s3", endpoint_url=s3_server.endpoint).create_bucket(Bucket="slow")
    prompt_a, prompt_b = list(range(48 * chunk)), list(range(48 * chunk))
    kv_a, kv_b = kv_for(spec, 48 * chunk, 1), kv_for(spec, 48 * chunk, 2)

    def config(endpoint: str, cpu_chunks: int, timeout_s: float) -> LMTierConfig:
        slab = spec.encoded_chunk_bytes(chunk)
        return LMTierConfig(
            chunk_size=chunk,
            cpu=CPUTierConfig(capacity_bytes=cpu_chunks * slab, staging_bytes=8 * slab),
            disk=DiskTierConfig(enabled=False),
            s3=S3TierConfig(bucket="slow", endpoint_url=endpoint, timeout_s=timeout_s),
        )

    # Stored over the direct link with a generous timeout: a loaded machine is slow too;
    # a pool of twice the prompt, since queued writes may hold at most half of it.
    with LMTier.open(config(s3_server.endpoint, 96, 30), kv=spec, model_id="m") as fast:
        assert fast.store(prompt_a, kv_a, cache_salt="tenant-a") == 48
        fast.flush()
        assert fast.stats()["s3"]["puts"] == 48
    with (
        SlowLink(urlsplit(s3_server.endpoint).port or 0, bytes_per_s=2_000_000) as link,
        LMTier.open(
            config(f"http://127.0.0.1:{link.port}", 56, 0.3), kv=spec, model_id="m"
        ) as cache,
    ):
        # Through a lookup: its spans are read in paced batches from the first (a
        # load without one would probe with a single chunk, which fits the deadline).
        found = cache.lookup(prompt_a, cache_salt="tenant-a")
        with cache.load_keys(found.keys, found.lookup) as hit:
            assert hit.num_tokens < 48 * chunk  # the slow link could not serve it in time
        # Tenant B's store takes every free slab at once, while A's reads still land.
        # (It counts only what S3's write queue took: at most half the pool.)
        assert 0 < cache.store(prompt_b, kv_b, cache_salt="tenant-b") <= 48
        wait_until_no_call_in_flight(cache, "s3")
        with cache.load(prompt_b, cache_salt="tenant-b") as hit:
            assert hit.tokens_by_tier() == {"cpu": 48 * chunk}
            assert torch.equal(hit.kv(), kv_b)


def test_long_prompt_from_a_slow_healthy_redis_is_served(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    # 120 chunks of 12 KiB over 1.6 MB/s take ~0.9 s; one call may take 0.5 s.
    spec, chunk = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8), 32
    prompt, kv = list(range(120 * chunk)), kv_for(spec, 120 * chunk, 3)

    def config(url: str, timeout_s: float = 0.5) -> LMTierConfig:
        return LMTierConfig(
            chunk_size=chunk,
            cpu=CPUTierConfig(capacity_bytes=1 << 30, staging_bytes=1 << 20),
            disk=DiskTierConfig(enabled=False),
            redis=RedisTierConfig(url=url, timeout_s=timeout_s),
        )

    with LMTier.open(config(redis_server.url, 30), kv=spec, model_id="slow-redis") as fast:
        assert fast.store(prompt, kv) == 120
        fast.flush()
    with (
        SlowLink(redis_server.port, bytes_per_s=1_600_000) as link,
        LMTier.open(
            config(f"redis://127.0.0.1:{link.port}/0"), kv=spec, model_id="slow-redis"
        ) as cache,
    ):
        served = 0
        for _ in range(5):  # on a loaded machine a batch may still time out: retry
            with cache.load(prompt) as hit:
                served = hit.num_tokens
                if served == 120 * chunk:
                    assert torch.equal(hit.kv(), kv)
                    break
        assert served == 120 * chunk
        stats = cache.stats()["redis"]
        assert stats["read_batch"] > 1  # sized from the measured rate, not one by one
