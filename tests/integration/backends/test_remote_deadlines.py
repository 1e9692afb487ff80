"""Deadlines of calls to the remote tiers against real servers (redis-server, moto):
the tiers declare a budget from their config and tick their I/O progress, and a hung
server (SIGSTOP) ends a call carrying a deadline of hours after ``timeout_s``.

No durations are asserted: a call given up on by its byte deadline would take hours
(``NEVER_S`` bounds the test far below that); a call that returns at all was ended by
the stall rule.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import boto3
import pytest

from lmtier.config import RedisTierConfig, S3TierConfig
from lmtier.storage.breaker import CircuitBreaker
from lmtier.storage.budget import CallBudget
from lmtier.storage.guard import TierGuard
from lmtier.testing import make_chunk
from lmtier_backends.redis import open_tier as open_redis
from lmtier_backends.redis.tier import RedisTier
from lmtier_backends.s3 import open_tier as open_s3
from lmtier_backends.s3.tier import S3Tier
from support.redis_servers import RedisServer
from support.s3_server import MotoServer, s3_credentials, s3_server  # noqa: F401

pytestmark = pytest.mark.integration

BUCKET = "lmtier-deadlines"
NEVER_S = 120.0
HUGE = 10**15
"""Bytes whose deadline at any default floor rate is months."""
CHUNKS = 64


@pytest.fixture(scope="module")
def endpoint(s3_server: MotoServer) -> str:  # noqa: F811
    client = boto3.session.Session().client(
        "s3", endpoint_url=s3_server.endpoint, region_name="us-east-1"
    )
    client.create_bucket(Bucket=BUCKET)
    return s3_server.endpoint


def open_remote(kind: str, redis_server: RedisServer, endpoint: str, **settings: Any) -> Any:
    if kind == "redis":
        config = RedisTierConfig(
            url=redis_server.url, key_prefix=f"{uuid.uuid4().hex}:", **settings
        )
        return open_redis(config)
    config = S3TierConfig(
        bucket=BUCKET, endpoint_url=endpoint, prefix=f"{uuid.uuid4().hex}/", **settings
    )
    return open_s3(config)


@pytest.fixture(params=["redis", "s3"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def run(body: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(body(), NEVER_S)

    asyncio.run(bounded())


def test_budget_comes_from_the_config(kind: str, redis_server: RedisServer, endpoint: str) -> None:
    async def body() -> None:
        tier: RedisTier | S3Tier = await open_remote(
            kind, redis_server, endpoint, timeout_s=1.5, min_bytes_per_s=1000, lookup_key_s=0.2
        )
        try:
            assert tier.budget == CallBudget(1.5, 1000.0, 0.2)
            assert tier.properties.timeout_s == 1.5
        finally:
            await tier.close()
        tier = await open_remote(kind, redis_server, endpoint, min_bytes_per_s=0)
        try:
            assert tier.budget.min_bytes_per_s is None  # 0: bytes add nothing
        finally:
            await tier.close()

    run(body)


def test_every_kind_of_call_ticks_the_progress_meter(
    kind: str, redis_server: RedisServer, endpoint: str
) -> None:
    async def body() -> None:
        tier: RedisTier | S3Tier = await open_remote(kind, redis_server, endpoint)
        chunks = [make_chunk(num_tokens=64, hidden=64, seed=i) for i in range(3)]
        keys = [key for key, _ in chunks]
        views = [memoryview(bytearray(len(data))) for _, data in chunks]
        try:
            seen = tier.io_progress.count
            for call in (
                lambda: tier.put(chunks),
                lambda: tier.contains(keys),
                lambda: tier.get_into(keys, views),
                lambda: tier.delete(keys),
            ):
                await call()
                assert tier.io_progress.count != seen
                seen = tier.io_progress.count
        finally:
            await tier.close()

    run(body)


def test_a_hung_server_ends_a_call_with_a_deadline_of_months(
    kind: str,
    redis_server: RedisServer,
    endpoint: str,
    s3_server: MotoServer,  # noqa: F811
) -> None:
    server = redis_server if kind == "redis" else s3_server
    # Few connections for many chunks: the tier alone, request by request, would take
    # far longer than timeout_s to fail the whole batch.
    limits = {"max_connections": 2} if kind == "redis" else {"max_concurrency": 2}

    async def body() -> None:
        tier: RedisTier | S3Tier = await open_remote(
            kind, redis_server, endpoint, timeout_s=0.5, **limits
        )
        chunks = [make_chunk(num_tokens=16, hidden=64, seed=i) for i in range(CHUNKS)]
        keys = [key for key, _ in chunks]
        views = [memoryview(bytearray(len(data))) for _, data in chunks]
        guard = TierGuard(tier, 0.5, CircuitBreaker())
        try:
            assert await tier.put(chunks) == CHUNKS
            server.pause()
            try:
                read, timed_out = await guard.call(
                    "get", lambda: tier.read_chunks(keys, views), num_bytes=HUGE
                )
                assert read is None and timed_out
                found, timed_out = await guard.call(
                    "contains", lambda: tier.contains(keys), num_keys=HUGE
                )
                assert found is None and timed_out
            finally:
                server.resume()
            # Served again once resumed. Not under the 0.5 s deadline: a resumed server on
            # a loaded machine first answers the calls abandoned above, which hold both
            # connections (seen beside a CPU burner: the S3 check timed out).
            patient = TierGuard(tier, 60.0, CircuitBreaker())
            found, timed_out = await patient.call(
                "contains", lambda: tier.contains(keys), num_keys=CHUNKS
            )
            assert (found, timed_out) == (CHUNKS, False)
        finally:
            await tier.close()

    run(body)
