"""A load without a lookup is one walk: remote tiers are read, never asked first.

Real Redis and a real HTTP S3 endpoint (moto) below a real LMTier: a chunk Redis lost
is read from S3, no HEAD or EXISTS precedes the GETs, a tier holding nothing costs
one request, and a load given the lookup just made reads exactly the spans it names.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import boto3
import pytest
import redis
import torch

from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.config import CPUTierConfig, DiskTierConfig, RedisTierConfig, S3TierConfig
from support.redis_servers import RedisServer
from support.s3_server import (  # noqa: F401 - fixtures
    MotoServer,
    dummy_credentials,
    s3_credentials,
    s3_server,
)

pytestmark = pytest.mark.integration

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8)
CHUNK = 16
CHUNKS = 8
BUCKET = "lmtier-walk"


@pytest.fixture(scope="module")
def endpoint(s3_server: MotoServer) -> str:  # noqa: F811
    client = boto3.session.Session().client(
        "s3", endpoint_url=s3_server.endpoint, region_name="us-east-1"
    )
    client.create_bucket(Bucket=BUCKET)
    client.close()
    return s3_server.endpoint


def config(redis_url: str, endpoint: str, run: str) -> LMTierConfig:
    # Deadlines far above any stall of a loaded machine: these tests count which tier
    # served each chunk, and a read past its deadline is (rightly) a fall-through.
    return LMTierConfig(
        chunk_size=CHUNK,
        cpu=CPUTierConfig(capacity_bytes=4 << 20, staging_bytes=1 << 20),
        disk=DiskTierConfig(enabled=False),
        redis=RedisTierConfig(url=redis_url, key_prefix=f"{run}:", timeout_s=30.0),  # type: ignore[arg-type]
        s3=S3TierConfig(bucket=BUCKET, prefix=f"{run}/", endpoint_url=endpoint, timeout_s=30.0),
    )


def kv_of(num_tokens: int) -> torch.Tensor:
    return torch.randn(SPEC.shape(num_tokens), generator=torch.Generator().manual_seed(3))


def counters(cache: LMTier, tier: str) -> tuple[int, int, int]:
    stats = cache.stats()[tier]
    return int(stats["lookups"]), int(stats["hits"]), int(stats["misses"])  # type: ignore[call-overload]


def test_load_reads_each_tier_once_and_falls_through_to_the_next(
    redis_server: RedisServer, endpoint: str, tmp_path: Path
) -> None:
    run = uuid.uuid4().hex[:8]
    prompt, kv = list(range(CHUNKS * CHUNK)), kv_of(CHUNKS * CHUNK)
    with LMTier.open(config(redis_server.url, endpoint, run), kv=SPEC, model_id="m") as writer:
        assert writer.store(prompt, kv) == CHUNKS
        writer.flush()
        keys = writer.keys(prompt)
    # Redis loses the second half (evicted, say); S3 still has everything.
    client = redis.Redis.from_url(redis_server.url)
    try:
        lost = [f"{run}:{key[:16].hex()}:{key[16:].hex()}".encode() for key in keys[CHUNKS // 2 :]]
        assert client.delete(*lost) == len(lost)
    finally:
        client.close()

    with LMTier.open(config(redis_server.url, endpoint, run), kv=SPEC, model_id="m") as reader:
        with reader.load(prompt) as loaded:
            assert loaded.num_tokens == CHUNKS * CHUNK
            assert torch.equal(loaded.kv(), kv)
            assert [c.tier for c in loaded.chunks] == ["redis"] * (CHUNKS // 2) + ["s3"] * (
                CHUNKS // 2
            )
        # No lookup went to either remote tier: the GETs were the walk (Redis's batch
        # may have asked for lost chunks past the first miss: misses, not lookups).
        assert counters(reader, "redis")[:2] == (0, CHUNKS // 2)
        assert counters(reader, "s3") == (0, CHUNKS // 2, 0)


def test_a_tier_holding_nothing_costs_one_request(redis_server: RedisServer, endpoint: str) -> None:
    run = uuid.uuid4().hex[:8]
    with LMTier.open(config(redis_server.url, endpoint, run), kv=SPEC, model_id="m") as cache:
        with cache.load(list(range(CHUNKS * CHUNK))) as loaded:
            assert loaded.num_tokens == 0
        assert counters(cache, "redis") == (0, 0, 1)
        assert counters(cache, "s3") == (0, 0, 1)
        assert cache.host_memory().slabs_in_use == 0


def test_a_load_given_the_lookup_reads_only_the_spans_it_names(
    redis_server: RedisServer, endpoint: str
) -> None:
    run = uuid.uuid4().hex[:8]
    prompt, kv = list(range(CHUNKS * CHUNK)), kv_of(CHUNKS * CHUNK)
    with LMTier.open(config(redis_server.url, endpoint, run), kv=SPEC, model_id="m") as writer:
        writer.store(prompt, kv)
        writer.flush()
    with LMTier.open(config(redis_server.url, endpoint, run), kv=SPEC, model_id="m") as reader:
        hit = reader.lookup(prompt)
        assert hit.num_tokens == CHUNKS * CHUNK
        assert hit.tokens_by_tier(CHUNK) == {"redis": CHUNKS * CHUNK}
        with reader.load_keys(hit.keys, hit.lookup) as loaded:
            assert torch.equal(loaded.kv(), kv)
        assert counters(reader, "redis") == (CHUNKS, CHUNKS, 0)  # the lookup's, then reads
        assert counters(reader, "s3") == (0, 0, 0)
