"""A remote tier that hangs (a SIGSTOPped moto or redis-server): stores never wait on
it, lookups and loads miss within its timeout, and the cache closes promptly."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
import torch

from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.config import CPUTierConfig, DiskTierConfig, RedisTierConfig, S3TierConfig
from support.redis_servers import RedisServer
from support.s3_server import MotoServer, s3_credentials, s3_server  # noqa: F401

pytestmark = pytest.mark.integration

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8)
CHUNK = 32


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as server:
        yield server


def in_thread(body: object, limit_s: float) -> None:
    """Run ``body()`` in a thread; fail if it has not returned after ``limit_s`` (a
    generous bound on milliseconds of work, far below what waiting on a hung server
    would take)."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            body()  # type: ignore[operator]
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=limit_s)
    assert not thread.is_alive(), "waited on a hung remote tier"
    assert errors == []


@pytest.mark.parametrize("remote", ["s3", "redis"])
def test_stores_never_wait_on_a_hung_remote_tier(
    remote: str,
    s3_server: MotoServer,  # noqa: F811
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    # A 10 s timeout: before stores asked local tiers only, each of the 40 stores below
    # looked the prompt up in the hung tier first and waited the whole timeout.
    if remote == "s3":
        boto3.client("s3", endpoint_url=s3_server.endpoint).create_bucket(Bucket="hung")
        section = {"s3": S3TierConfig(bucket="hung", endpoint_url=s3_server.endpoint, timeout_s=10)}
        server: MotoServer | RedisServer = s3_server
    else:
        section = {"redis": RedisTierConfig(url=redis_server.url, timeout_s=10)}  # type: ignore[arg-type, dict-item]
        server = redis_server
    config = LMTierConfig(
        chunk_size=CHUNK,
        cpu=CPUTierConfig(capacity_bytes=64 << 20),
        disk=DiskTierConfig(path=tmp_path / "disk", fsync=False),
        **section,  # type: ignore[arg-type]
    )
    prompts = [list(range(i * 10_000, i * 10_000 + 4 * CHUNK)) for i in range(40)]
    kvs = [torch.randn(SPEC.shape(4 * CHUNK)) for _ in prompts]
    with LMTier.open(config, kv=SPEC, model_id="m") as cache:
        server.pause()
        try:
            lookups = cache.stats()[remote]["lookups"]

            def store_all() -> None:
                for prompt, kv in zip(prompts, kvs, strict=True):
                    assert cache.store(prompt, kv) == 4

            in_thread(store_all, limit_s=30)
            assert cache.stats()[remote]["lookups"] == lookups  # never asked
            with cache.load(prompts[0]) as hit:  # served by the local tiers
                assert torch.equal(hit.kv(), kvs[0])
        finally:
            server.resume()
