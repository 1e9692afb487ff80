"""Purging a namespace from the real backends, beyond what the conformance suite checks:
Redis (key prefixes with glob metacharacters, many SCAN pages, a cluster, a dead or
hung server through a StorageManager), S3 (more objects than one DeleteObjects takes,
other prefixes untouched, a dead endpoint) and disk (files another tier or another
process wrote, the shared ledger, a reopened directory).

Coroutines run under ``asyncio.run`` inside plain tests (no pytest-asyncio).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import boto3
import pytest

from lmtier.chunks.keys import ChunkKey
from lmtier.storage.breaker import CircuitBreaker
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.host_pool import HostPool
from lmtier.storage.manager import PURGE_FAILED, StorageManager
from lmtier.storage.tier import Tier
from lmtier.testing import make_chunk, random_key
from lmtier_backends.disk.tier import DiskTier
from lmtier_backends.redis import tier as redis_tier
from lmtier_backends.redis.tier import RedisTier
from lmtier_backends.s3.tier import S3Tier
from support.disk_files import CHUNK_LEN, GIB, chunk_files
from support.redis_servers import RedisClusterProcesses, RedisServer
from support.s3_server import MotoServer, dummy_credentials, s3_credentials, s3_server  # noqa: F401

pytestmark = pytest.mark.integration

T = TypeVar("T")
BUCKET = "lmtier-purge"


def run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    async def main() -> T:
        return await fn(*args)

    return asyncio.run(main())


def small(namespace: bytes, count: int) -> list[tuple[ChunkKey, bytes]]:
    """``count`` tiny chunks of ``namespace`` (a few hundred bytes each)."""
    return [make_chunk(random_key(namespace), num_tokens=1, hidden=4) for _ in range(count)]


def keys_of(items: list[tuple[ChunkKey, bytes]]) -> list[ChunkKey]:
    return [key for key, _ in items]


async def holds(tier: Tier, keys: list[ChunkKey]) -> int:
    """How many of ``keys`` ``tier`` holds, each asked on its own (not a leading run)."""
    return sum([await tier.contains([key]) for key in keys])


async def purge_through_manager(tier: Tier, namespace: bytes) -> dict[str, int]:
    """A StorageManager over ``tier`` (fast breaker) purges ``namespace``."""
    pool = HostPool(64 * 1024, 16)
    manager = StorageManager(
        CPUTier(pool, 8 * pool.slab_bytes),
        [tier],
        breaker_factory=lambda: CircuitBreaker(failure_threshold=1, reset_after_s=0.2),
        purge_timeout_s=30.0,
    )
    await manager.start()
    try:
        return await manager.purge(namespace)
    finally:
        await manager.close()
        pool.close()


# --- Redis ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcesses]:
    with RedisClusterProcesses(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.mark.parametrize(
    ("tricky", "neighbour"),
    [("p*:", "pX:"), ("q[x]:", "qx:"), ("s?:", "sZ:"), ("r\\:", "r:"), ("t\\*[?", "t\\X[Y")],
)
def test_redis_prefix_glob_metacharacters_match_themselves_only(
    redis_server: RedisServer, tricky: str, neighbour: str
) -> None:
    # Unescaped, MATCH "p*:<ns>:*" takes "pX:<ns>:..." too, and "r\\:<ns>:*" misses
    # its own keys (a backslash escapes the colon).
    async def scenario() -> None:
        namespace, salt = os.urandom(16), uuid.uuid4().hex[:6]
        ours = await RedisTier.open(redis_server.url, key_prefix=salt + tricky)
        theirs = await RedisTier.open(redis_server.url, key_prefix=salt + neighbour)
        try:
            mine, other = small(namespace, 3), small(namespace, 2)
            await ours.put(mine)
            await theirs.put(other)
            assert await ours.purge(namespace) == 3
            assert await holds(ours, keys_of(mine)) == 0
            assert await holds(theirs, keys_of(other)) == 2
        finally:
            await ours.close()
            await theirs.close()

    run(scenario)


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_redis_purge_pages_through_every_node(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    server = request.getfixturevalue("redis_server" if where == "standalone" else "redis_cluster")
    monkeypatch.setattr(redis_tier, "PURGE_PAGE", 50)  # many SCAN pages per node

    async def scenario() -> None:
        doomed_ns, kept_ns = os.urandom(16), os.urandom(16)
        tier = await RedisTier.open(server.url, key_prefix=f"pg{uuid.uuid4().hex[:6]}:")
        try:
            doomed, kept = small(doomed_ns, 600), small(kept_ns, 40)
            assert await tier.put(doomed + kept) == 640
            progress = tier.io_progress.count
            assert await tier.purge(doomed_ns) == 600
            assert tier.io_progress.count - progress >= 600 // 50  # a tick per page at least
            assert await holds(tier, keys_of(doomed[::50])) == 0
            assert await tier.contains(keys_of(kept)) == 40
        finally:
            await tier.close()

    run(scenario)


def test_redis_dead_or_hung_is_a_reported_failure(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()

    async def scenario() -> None:
        namespace = os.urandom(16)
        tier = await RedisTier.open(server.url, timeout_s=0.3)
        await tier.put(small(namespace, 3))
        server.pause()  # SIGSTOP: caught by the stall check, not the 30 s deadline
        started = time.monotonic()
        assert await purge_through_manager(tier, namespace) == {"cpu": 0, "redis": PURGE_FAILED}
        assert time.monotonic() - started < 20.0  # a load's margin, still short of 30 s
        server.resume()
        tier = await RedisTier.open(server.url, timeout_s=0.3)
        server.kill()
        assert await purge_through_manager(tier, namespace) == {"cpu": 0, "redis": PURGE_FAILED}

    try:
        run(scenario)
    finally:
        server.resume()
        server.stop()


# --- S3 ------------------------------------------------------------------------------


def plain_client(endpoint: str) -> Any:
    return boto3.session.Session().client("s3", endpoint_url=endpoint, region_name="us-east-1")


@pytest.fixture(scope="module")
def endpoint(s3_server: MotoServer) -> str:  # noqa: F811
    plain_client(s3_server.endpoint).create_bucket(Bucket=BUCKET)
    return s3_server.endpoint


def open_s3(endpoint: str, prefix: str, **options: Any) -> Awaitable[S3Tier]:
    settings: dict[str, Any] = {"max_concurrency": 16, "timeout_s": 5.0, **options}
    return S3Tier.open(BUCKET, prefix=prefix, endpoint_url=endpoint, **settings)


def count_objects(endpoint: str, prefix: str) -> int:
    pages = plain_client(endpoint).get_paginator("list_objects_v2")
    return sum(page["KeyCount"] for page in pages.paginate(Bucket=BUCKET, Prefix=prefix))


def test_s3_purge_deletes_more_than_one_batch_and_only_its_prefix(endpoint: str) -> None:
    async def scenario() -> None:
        doomed_ns, kept_ns = os.urandom(16), os.urandom(16)
        base = f"pg-{uuid.uuid4().hex[:8]}/"
        tier = await open_s3(endpoint, base)
        elsewhere = await open_s3(endpoint, base + "other/")  # same namespace, not ours
        try:
            doomed = small(doomed_ns, 1234)  # two ListObjectsV2 pages, two DeleteObjects
            assert await tier.put(doomed + small(kept_ns, 5)) == 1239
            assert await elsewhere.put(small(doomed_ns, 3)) == 3
            assert await tier.purge(doomed_ns) == 1234
            assert count_objects(endpoint, tier.namespace_prefix(doomed_ns)) == 0
            assert count_objects(endpoint, tier.namespace_prefix(kept_ns)) == 5
            assert count_objects(endpoint, elsewhere.namespace_prefix(doomed_ns)) == 3
            assert await holds(tier, keys_of(doomed[::100])) == 0
        finally:
            await tier.close()
            await elsewhere.close()

    run(scenario)


def test_s3_dead_endpoint_is_a_reported_failure() -> None:
    server = MotoServer()
    with dummy_credentials():
        server.start()
        try:
            plain_client(server.endpoint).create_bucket(Bucket=BUCKET)

            async def scenario() -> None:
                tier = await open_s3(server.endpoint, "dead/", timeout_s=0.5)
                namespace = os.urandom(16)
                await tier.put(small(namespace, 2))
                server.kill()
                assert await purge_through_manager(tier, namespace) == {
                    "cpu": 0,
                    "s3": PURGE_FAILED,
                }

            run(scenario)
        finally:
            server.close()


# --- disk ----------------------------------------------------------------------------


def ledger_total(path: Path) -> int:
    """The directory's shared byte counter (disk/ledger.py), read as another process would."""
    value: int = struct.unpack("<q", (path / "v1" / "ledger").read_bytes()[:8])[0]
    return value


def test_disk_purge_takes_every_tiers_files_and_keeps_the_ledger(tmp_path: Path) -> None:
    async def scenario() -> None:
        doomed_ns, kept_ns = os.urandom(16), os.urandom(16)
        ours, theirs = await DiskTier.open(tmp_path, GIB), await DiskTier.open(tmp_path, GIB)
        mine = [make_chunk(random_key(doomed_ns)) for _ in range(3)]
        their_doomed = [make_chunk(random_key(doomed_ns)) for _ in range(2)]
        kept = [make_chunk(random_key(kept_ns)) for _ in range(2)]
        await ours.put(mine + kept)
        await theirs.put(their_doomed)  # not in our index: found by listing the directory
        assert await ours.purge(doomed_ns) == 5
        assert (ours.used_bytes, len(ours)) == (2 * CHUNK_LEN, 2)
        assert len(chunk_files(tmp_path)) == 2
        assert ledger_total(tmp_path) == 2 * CHUNK_LEN
        # The other tier still indexes its files until it reads them: a miss, dropped.
        buffers = [memoryview(bytearray(CHUNK_LEN)) for _ in their_doomed]
        assert await theirs.get_into(keys_of(their_doomed), buffers) == [None, None]
        assert await theirs.contains(keys_of(their_doomed)[:1]) == 0
        await ours.close()
        await theirs.close()
        reopened = await DiskTier.open(tmp_path, GIB)
        assert await holds(reopened, keys_of(mine + their_doomed)) == 0
        assert await reopened.contains(keys_of(kept)) == 2
        assert reopened.used_bytes == 2 * CHUNK_LEN
        await reopened.close()

    run(scenario)


_PURGER = """
import asyncio, sys
from lmtier_backends.disk.tier import DiskTier

async def main():
    tier = await DiskTier.open(sys.argv[1], 1 << 30)
    print(await tier.purge(bytes.fromhex(sys.argv[2])))
    await tier.close()

asyncio.run(main())
"""


def test_disk_purge_by_another_process(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    doomed_ns, kept_ns = os.urandom(16), os.urandom(16)
    doomed = [make_chunk(random_key(doomed_ns), seed=i) for i in range(4)]
    kept = [make_chunk(random_key(kept_ns), seed=i) for i in range(2)]
    (tmp_path / "chunks.pkl").write_bytes(pickle.dumps(doomed + kept))

    async def scenario() -> None:
        tier = await DiskTier.open(cache, GIB)
        await tier.put(doomed + kept)
        script = [sys.executable, "-c", _PURGER, str(cache), doomed_ns.hex()]
        done = await asyncio.to_thread(
            subprocess.run, script, check=True, timeout=120, capture_output=True, text=True
        )
        assert done.stdout.strip() == "4"
        buffers = [memoryview(bytearray(CHUNK_LEN)) for _ in doomed]
        assert await tier.get_into(keys_of(doomed), buffers) == [None] * 4
        assert tier.used_bytes == 2 * CHUNK_LEN  # the misses left our index
        assert await tier.contains(keys_of(kept)) == 2
        await tier.close()
        reopened = await DiskTier.open(cache, GIB)
        assert await holds(reopened, keys_of(doomed)) == 0
        assert (await reopened.contains(keys_of(kept)), len(reopened)) == (2, 2)
        await reopened.close()

    run(scenario)
