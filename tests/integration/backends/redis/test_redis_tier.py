"""The Redis tier against real redis-server processes: conformance (standalone and a
3-master cluster), big batches and values, TTL, key naming, corruption, cluster round
trips, faults through a StorageManager (kill, SIGSTOP, restart), close, and secrets.

Coroutines run under ``asyncio.run`` inside plain tests (no pytest-asyncio).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from redis.crc import key_slot

from lmtier.chunks.keys import ChunkKey
from lmtier.config import RedisTierConfig
from lmtier.config.secrets import SecretURL
from lmtier.errors import BackendTimeout, BackendUnavailable, ConfigError
from lmtier.storage.breaker import CircuitBreaker
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.host_pool import HostPool
from lmtier.storage.manager import StorageManager
from lmtier.testing import make_chunk, random_key
from lmtier.testing.conformance import TierConformance
from lmtier_backends.redis import open_tier
from lmtier_backends.redis.tier import RedisTier
from lmtier_backends.redis.wire import ZeroCopyConnection, ZeroCopyUnixConnection
from support.redis_servers import RedisClusterProcesses, RedisServer, free_port

pytestmark = pytest.mark.integration

T = TypeVar("T")
MIB = 1 << 20


def run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    async def main() -> T:
        return await fn(*args)

    return asyncio.run(main())


def buffers(count: int, size: int = 64 * 1024) -> list[memoryview]:
    return [memoryview(bytearray(size)) for _ in range(count)]


def unique_prefix() -> str:
    return f"t{os.urandom(4).hex()}:"


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A standalone server shared by this module's tests (with a unix socket too)."""
    with RedisServer(tmp_path_factory.mktemp("redis"), unix_socket=True) as server:
        yield server


@pytest.fixture(scope="module")
def redis_tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A server that speaks only TLS (``rediss://``), with a self-signed certificate."""
    with RedisServer(tmp_path_factory.mktemp("redis-tls"), tls=True) as server:
        yield server


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcesses]:
    """A 3-master Redis Cluster shared by this module's tests."""
    with RedisClusterProcesses(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


# --- conformance ---------------------------------------------------------------------


class TestRedisConformance(TierConformance):
    @pytest.fixture
    def make_tier(self, redis_server: RedisServer):  # type: ignore[no-untyped-def]
        return lambda: RedisTier.open(redis_server.url)


class TestRedisClusterConformance(TierConformance):
    @pytest.fixture
    def make_tier(self, redis_cluster: RedisClusterProcesses):  # type: ignore[no-untyped-def]
        return lambda: RedisTier.open(redis_cluster.url)  # detected, not declared


class TestRedisTLSConformance(TierConformance):
    @pytest.fixture
    def make_tier(self, redis_tls_server: RedisServer):  # type: ignore[no-untyped-def]
        return lambda: RedisTier.open(redis_tls_server.url)


class TestRedisUnixSocketConformance(TierConformance):
    @pytest.fixture
    def make_tier(self, redis_server: RedisServer):  # type: ignore[no-untyped-def]
        return lambda: RedisTier.open(redis_server.unix_url)


@pytest.fixture(params=["standalone", "cluster", "tls"])
def url(request: pytest.FixtureRequest) -> str:
    fixture = {"standalone": "redis_server", "cluster": "redis_cluster", "tls": "redis_tls_server"}
    return str(request.getfixturevalue(fixture[request.param]).url)


# --- opening ---------------------------------------------------------------------------


def test_open_detects_cluster_mode_and_declares_properties(
    redis_server: RedisServer, redis_cluster: RedisClusterProcesses
) -> None:
    async def scenario() -> None:
        plain = await RedisTier.open(redis_server.url)
        detected = await RedisTier.open(redis_cluster.url)
        declared = await RedisTier.open(redis_cluster.url, cluster=True)
        unix = await RedisTier.open(redis_server.unix_url)
        try:
            assert not plain.is_cluster and detected.is_cluster and declared.is_cluster
            assert not unix.is_cluster
            props = plain.properties
            assert props.shared and props.write_policy == "write_through"
            assert props.timeout_s == plain.timeout_s == 0.5
            # Our connection classes, whatever redis-py would pick by default.
            await unix.put([make_chunk()])
            await detected.put([make_chunk() for _ in range(20)])
            assert all(
                isinstance(conn, ZeroCopyUnixConnection)
                for conn in unix._route.pool._available_connections  # type: ignore[union-attr]
            )
            nodes = detected._route.cluster.get_nodes()  # type: ignore[union-attr]
            conns = [conn for node in nodes for conn in node._connections]
            assert conns and all(isinstance(conn, ZeroCopyConnection) for conn in conns)
        finally:
            for tier in (plain, detected, declared, unix):
                await tier.close()

    run(scenario)


def test_open_tier_from_config(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        config = RedisTierConfig(url=SecretURL(redis_server.url), key_prefix="cfg:", ttl_s=60)
        tier = await open_tier(config)
        try:
            key, data = make_chunk()
            assert await tier.put([(key, data)]) == 1
            assert tier.redis_key(key).startswith(b"cfg:")
            assert tier.ttl_ms == 60_000
        finally:
            await tier.close()
        with pytest.raises(ConfigError, match=r"redis\.url"):
            await open_tier(RedisTierConfig())

    run(scenario)


def test_open_fails_fast_when_nothing_listens() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    started = time.perf_counter()
    with pytest.raises(BackendUnavailable, match="open failed"):
        run(lambda: RedisTier.open(url, timeout_s=60.0))
    assert time.perf_counter() - started < 20.0  # refused at once, not retried for 60 s


def test_our_connections_pass_values_through_uncopied() -> None:
    slab = bytearray(3 * MIB)
    value = memoryview(slab)[: 2 * MIB]
    conn = ZeroCopyConnection(host="127.0.0.1", port=1)  # never connected
    for pieces in (
        conn.pack_command("SET", b"key", value, "PX", 1000),
        conn.pack_commands([("SET", b"a", value), ("SET", b"b", bytes(100))]),
    ):
        passed = [p for p in pieces if isinstance(p, memoryview) and p.obj is slab]
        assert passed and all(p.nbytes == 2 * MIB for p in passed)
        assert sum(len(p) for p in pieces if not isinstance(p, memoryview)) < 200
    assert b"".join(conn.pack_command("CLUSTER SLOTS")) == b"*2\r\n$7\r\nCLUSTER\r\n$5\r\nSLOTS\r\n"


# --- batches, values, TTL, naming ------------------------------------------------------


def test_batch_of_1000_keys(url: str) -> None:
    async def scenario() -> None:
        tier = await RedisTier.open(url, key_prefix=unique_prefix())
        try:
            chunks = [make_chunk(num_tokens=2, hidden=8) for _ in range(1000)]
            keys = [key for key, _ in chunks]
            assert await tier.put(chunks) == 1000
            assert await tier.contains(keys) == 1000
            assert await tier.contains([*keys[:500], random_key(), *keys[500:]]) == 500
            sizes = await tier.get_into(keys, buffers(1000, 8192))
            assert sizes == [len(data) for _, data in chunks]
            assert tier.stats.lookups == 2001 and tier.stats.puts == 1000
            assert tier.stats.bytes_written == sum(len(data) for _, data in chunks)
            assert await tier.delete(keys) == 1000
            assert await tier.contains(keys) == 0
        finally:
            await tier.close()

    run(scenario)


def test_values_up_to_32_mib_from_slab_views(url: str) -> None:
    async def scenario() -> None:
        tier = await RedisTier.open(url, timeout_s=2.0)
        try:
            for hidden in (256, 1024, 4096):  # 2, 8 and 32 MiB of payload
                key, data = make_chunk(num_tokens=1024, hidden=hidden)
                slab = bytearray(len(data) + 12345)  # a pool slab is larger than its chunk
                slab[: len(data)] = data
                assert await tier.put([(key, memoryview(slab)[: len(data)])]) == 1
                (buffer,) = buffers(1, len(data) + 4096)
                assert await tier.get_into([key], [buffer]) == [len(data)]
                assert buffer[: len(data)] == data
                assert await tier.get_into([key], buffers(1, len(data) - 1)) == [None]
                await tier.delete([key])
        finally:
            await tier.close()

    run(scenario)


def test_ttl_is_set_and_refreshed_on_hit(redis_server: RedisServer) -> None:
    client = redis_server.client()

    async def scenario() -> None:
        refreshing = await RedisTier.open(redis_server.url, ttl_s=100, refresh_ttl_on_hit=True)
        plain = await RedisTier.open(redis_server.url, ttl_s=100)
        forever = await RedisTier.open(redis_server.url)
        try:
            key, data = make_chunk()
            name = refreshing.redis_key(key)
            await refreshing.put([(key, data)])
            assert 99_000 < client.pttl(name) <= 100_000
            client.pexpire(name, 5_000)
            await plain.get_into([key], buffers(1))
            assert client.pttl(name) <= 5_000  # a plain read leaves the TTL alone
            await refreshing.get_into([key], buffers(1))
            assert client.pttl(name) > 99_000  # a hit renews it
            other, other_data = make_chunk()
            await forever.put([(other, other_data)])
            assert client.pttl(forever.redis_key(other)) == -1
        finally:
            for tier in (refreshing, plain, forever):
                await tier.close()

    try:
        run(scenario)
    finally:
        client.close()


def test_one_key_per_chunk_named_by_namespace(redis_server: RedisServer) -> None:
    client = redis_server.client()
    prefix = unique_prefix()

    async def scenario() -> None:
        tier = await RedisTier.open(redis_server.url, key_prefix=prefix)
        try:
            ns_a, ns_b = b"A" * 16, b"B" * 16
            chunks_a = [make_chunk(random_key(ns_a)) for _ in range(5)]
            chunks_b = [make_chunk(random_key(ns_b)) for _ in range(3)]
            await tier.put(chunks_a + chunks_b)
            found = set(client.scan_iter(match=f"{prefix}{ns_a.hex()}:*"))
            expected = {f"{prefix}{ns_a.hex()}:{key[16:].hex()}".encode() for key, _ in chunks_a}
            assert found == expected
            assert len(list(client.scan_iter(match=f"{prefix}*"))) == 8  # no metadata keys
            for key, data in chunks_a + chunks_b:
                assert client.get(tier.redis_key(key)) == data  # the chunk format, unchanged
        finally:
            await tier.close()

    try:
        run(scenario)
    finally:
        client.close()


def test_values_changed_behind_our_back_are_deleted_and_counted(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()

    async def scenario() -> None:
        tier = await RedisTier.open(redis_server.url)
        try:
            chunks = [make_chunk() for _ in range(5)]
            await tier.put(chunks)
            keys = [key for key, _ in chunks]
            names = [tier.redis_key(key) for key in keys]
            flipped = bytearray(chunks[0][1])
            flipped[len(flipped) // 2] ^= 0x01
            client.set(names[0], bytes(flipped))
            client.set(names[1], chunks[1][1][:-100])  # truncated
            client.set(names[2], os.urandom(len(chunks[2][1])))
            client.set(names[3], chunks[4][1])  # another chunk's bytes
            sizes = await tier.get_into(keys, buffers(5))
            assert sizes == [None, None, None, None, len(chunks[4][1])]
            assert tier.stats.corrupt == 4
            assert [client.exists(name) for name in names] == [0, 0, 0, 0, 1]
            # What can never be served must not stay a hit for EXISTS: a key of another
            # type under a chunk's name, a value larger than any slab.
            client.delete(names[4])
            client.hset(names[4], "field", "value")
            client.set(names[3], os.urandom(70 * 1024))
            assert await tier.contains(keys[3:]) == 2  # phantoms, until a read finds out
            assert await tier.get_into(keys[3:], buffers(2)) == [None, None]
            assert tier.stats.unservable == 2
            assert await tier.contains(keys[3:4]) == await tier.contains(keys[4:]) == 0
            assert [client.exists(name) for name in names[3:]] == [0, 0]
        finally:
            await tier.close()

    try:
        run(scenario)
    finally:
        client.close()


# --- cluster ---------------------------------------------------------------------------


def test_cluster_spreads_keys_and_looks_up_in_one_round_trip_per_node(
    redis_cluster: RedisClusterProcesses,
) -> None:
    clients = [server.client() for server in redis_cluster.servers]
    prefix = unique_prefix()

    def snapshot() -> list[tuple[int, int, int, int]]:
        out = []
        for client in clients:
            stats, commands = client.info("stats"), client.info("commandstats")
            exists = commands.get("cmdstat_exists", {}).get("calls", 0)
            out.append(
                (
                    stats["total_reads_processed"],
                    stats["total_writes_processed"],
                    stats["total_connections_received"],
                    exists,
                )
            )
        return out

    async def scenario() -> None:
        tier = await RedisTier.open(redis_cluster.url, key_prefix=prefix)
        try:
            chunks = [make_chunk(num_tokens=1, hidden=8) for _ in range(512)]
            keys = [key for key, _ in chunks]
            await tier.put(chunks)
            per_node = [len(list(c.scan_iter(match=f"{prefix}*", count=1000))) for c in clients]
            assert sum(per_node) == 512 and min(per_node) > 100  # every master holds a share
            assert len({key_slot(tier.redis_key(key)) for key in keys}) > 450  # no hash tag
            await tier.contains(keys)  # warm: every node has a connection
            before = snapshot()
            started = time.perf_counter()
            assert await tier.contains(keys) == 512
            elapsed = time.perf_counter() - started
            after = snapshot()
            for node, (b, a, held) in enumerate(zip(before, after, per_node, strict=True)):
                reads, writes, connections, exists = (x - y for x, y in zip(a, b, strict=True))
                assert exists == held, f"node {node}: {exists} EXISTS for {held} keys"
                # One pipelined batch arrives in one or two socket reads (+2 for our two
                # INFO calls); one EXISTS per round trip would take ~170.
                assert reads <= 5, f"node {node}: {reads} reads for one lookup"
                assert writes <= 5, f"node {node}: {writes} writes for one lookup"
                assert connections == 0, f"node {node}: {connections} new connections"
            print(f"512-key cluster lookup: {elapsed * 1e3:.2f} ms")
        finally:
            await tier.close()

    try:
        run(scenario)
    finally:
        for client in clients:
            client.close()


def test_cluster_follows_a_slot_that_moved_after_open(
    redis_cluster: RedisClusterProcesses,
) -> None:
    clients = [server.client() for server in redis_cluster.servers]
    ids = [client.execute_command("CLUSTER MYID").decode() for client in clients]

    def move(slot: int, to: int) -> None:
        for client in [clients[to], *clients]:  # the new owner first, as redis-cli does
            client.execute_command("CLUSTER SETSLOT", slot, "NODE", ids[to])

    async def scenario() -> None:
        tier = await RedisTier.open(redis_cluster.url)  # its slot map is now stale-able
        try:
            # Redis refuses to move a slot that holds keys, and earlier tests on this
            # module's cluster left some: take a chunk whose slot is empty.
            for _ in range(100):
                key, data = make_chunk()
                name = tier.redis_key(key)
                slot = key_slot(name)
                owner = next(i for i, client in enumerate(clients) if _owns(client, slot))
                if clients[owner].execute_command("CLUSTER COUNTKEYSINSLOT", slot) == 0:
                    break
            target = (owner + 1) % len(clients)
            move(slot, target)
            moved_before = _moved_replies(clients[owner])
            try:
                assert await tier.put([(key, data)]) == 1  # MOVED: followed through redis-py
                assert _moved_replies(clients[owner]) > moved_before  # the old owner said so
                assert clients[target].exists(name) == 1
                assert await tier.contains([key]) == 1
                assert await tier.get_into([key], buffers(1)) == [len(data)]
                assert await tier.delete([key]) == 1
            finally:
                clients[target].delete(name)
                move(slot, owner)
        finally:
            await tier.close()

    try:
        run(scenario)
    finally:
        for client in clients:
            client.close()


def _moved_replies(client: Any) -> int:
    return int(client.info("errorstats").get("errorstat_MOVED", {}).get("count", 0))


def _owns(client: Any, slot: int) -> bool:
    myself = client.execute_command("CLUSTER MYID")
    for start, end, primary, *_ in client.execute_command("CLUSTER SLOTS"):
        if start <= slot <= end:
            return bool(primary[2] == myself)
    return False


# --- faults through a real StorageManager ----------------------------------------------

TIMEOUT_S = 0.25
SLOW_S = TIMEOUT_S + 2.0
"""A missed lookup comes back within this: about the timeout; one that hung on the
stopped or dead server would not come back at all. The margin is a loaded machine's
(it was 0.35 s, which a load of 12 on 2 cores can take from any step)."""


async def timed_lookup(manager: StorageManager, keys: list[ChunkKey]) -> tuple[int, float]:
    started = time.perf_counter()
    found = (await manager.lookup(keys)).num_chunks
    return found, time.perf_counter() - started


async def wait_for_breaker(manager: StorageManager, keys: list[ChunkKey], state: str) -> None:
    deadline = time.monotonic() + 60  # a hang guard: the breaker turns within a second
    while manager.stats()["redis"]["breaker"] != state:
        assert time.monotonic() < deadline, f"breaker never became {state}"
        _, elapsed = await timed_lookup(manager, keys)
        assert elapsed < SLOW_S
        await asyncio.sleep(0.05)


def test_faults_are_misses_and_the_breaker_recovers(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()

    async def scenario() -> None:
        pool = HostPool(64 * 1024, 64)
        tier = await RedisTier.open(server.url, timeout_s=TIMEOUT_S)
        manager = StorageManager(
            CPUTier(pool, 16 * pool.slab_bytes),
            [tier],
            breaker_factory=lambda: CircuitBreaker(
                failure_threshold=2, reset_after_s=0.2, max_reset_after_s=0.4
            ),
        )
        await manager.start()
        try:
            stored = [make_chunk() for _ in range(4)]
            await tier.put(stored)  # in Redis only: lookups must ask it (gets promote, so
            keys = [key for key, _ in stored]  # the workload drops them from the CPU tier)
            assert await timed_lookup(manager, keys) == (4, pytest.approx(0, abs=SLOW_S))

            # kill mid-workload: puts, lookups and gets keep returning, as misses
            async def workload() -> None:
                for round_ in range(30):
                    key, data = make_chunk(seed=round_)
                    handle = manager.cpu_tier.acquire_slab()
                    assert handle is not None
                    handle.view[: len(data)] = data
                    manager.put(key, handle, len(data))
                    _, elapsed = await timed_lookup(manager, keys)
                    assert elapsed < SLOW_S, f"lookup took {elapsed:.3f} s"
                    for chunk in await manager.get(keys):
                        chunk.release()
                    await manager.cpu_tier.delete(keys)
                    await asyncio.sleep(0.01)

            work = asyncio.create_task(workload())
            await asyncio.sleep(0.1)
            server.kill()
            await work  # no exception reaches the caller
            assert await timed_lookup(manager, keys) == (0, pytest.approx(0, abs=SLOW_S))
            await wait_for_breaker(manager, keys, "open")

            # restart (empty): the breaker closes and new writes read back
            server.start()
            await wait_for_breaker(manager, keys, "closed")
            fresh = [make_chunk() for _ in range(3)]
            for key, data in fresh:
                handle = manager.cpu_tier.acquire_slab()
                assert handle is not None
                handle.view[: len(data)] = data
                manager.put(key, handle, len(data))
            await manager.flush()
            fresh_keys = [key for key, _ in fresh]
            assert await tier.contains(fresh_keys) == 3
            sizes = await tier.get_into(fresh_keys, buffers(3))
            assert sizes == [len(data) for _, data in fresh]

            # SIGSTOP: a hang becomes a miss within the timeout, then the breaker opens
            remote = [make_chunk() for _ in range(3)]
            await tier.put(remote)  # again in Redis only
            remote_keys = [key for key, _ in remote]
            server.pause()
            found, elapsed = await timed_lookup(manager, remote_keys)
            assert found == 0 and TIMEOUT_S * 0.8 < elapsed < SLOW_S
            await wait_for_breaker(manager, remote_keys, "open")
            server.resume()
            await wait_for_breaker(manager, remote_keys, "closed")
            assert (await manager.lookup(remote_keys)).num_chunks == 3
            assert manager.stats()["redis"]["breaker_opens"] >= 2
        finally:
            server.resume()
            await manager.close()
            pool.close()

    try:
        run(scenario)
    finally:
        server.stop()


def test_stale_connections_after_a_restart_are_replaced(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()

    async def scenario() -> None:
        tier = await RedisTier.open(server.url)
        try:
            await tier.put([make_chunk() for _ in range(8)])  # pooled connections
            server.restart()
            await asyncio.sleep(0.05)
            chunk = make_chunk()
            assert await tier.put([chunk]) == 1  # no retry on writes: the pool must notice
            assert await tier.contains([chunk[0]]) == 1
        finally:
            await tier.close()

    try:
        run(scenario)
    finally:
        server.stop()


def test_close_returns_quickly_while_the_server_is_stopped(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()

    async def scenario() -> None:
        # A timeout far longer than the bounds below: close must not wait for it.
        tier = await RedisTier.open(server.url, timeout_s=120.0)
        key, data = make_chunk(num_tokens=1024, hidden=4096)  # 32 MiB: fills socket buffers
        await tier.put([make_chunk()])
        server.pause()
        stuck = [
            asyncio.create_task(tier.put([(key, data)])),
            asyncio.create_task(tier.get_into([key], buffers(1, len(data)))),
            asyncio.create_task(tier.contains([key])),
        ]
        await asyncio.sleep(0.2)
        started = time.perf_counter()
        await tier.close()
        assert time.perf_counter() - started < 20.0
        outcomes = await asyncio.wait_for(asyncio.gather(*stuck, return_exceptions=True), 20.0)
        assert all(isinstance(o, (BackendUnavailable, BackendTimeout)) for o in outcomes)
        with pytest.raises(BackendUnavailable, match="closed"):
            await tier.contains([key])
        await tier.close()

    try:
        run(scenario)
    finally:
        server.stop()


# --- secrets ---------------------------------------------------------------------------

PASSWORD = "s3cr3t-Pa55word"


def test_the_password_never_reaches_logs_reprs_or_errors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    server = RedisServer(tmp_path / "redis", password=PASSWORD).start()
    wrong_url = server.url.replace(PASSWORD, "Wr0ng-" + PASSWORD)
    errors: list[BaseException] = []

    async def scenario() -> None:
        tier = await RedisTier.open(server.url, timeout_s=TIMEOUT_S)
        manager = StorageManager(CPUTier(HostPool(64 * 1024, 4)), [tier])
        await manager.start()
        try:
            texts = [repr(tier), str(tier.url), repr(tier.url)]
            key, data = make_chunk()
            await tier.put([(key, data)])
            assert await tier.get_into([key], buffers(1)) == [len(data)]
            with pytest.raises(BackendUnavailable) as wrong:
                await RedisTier.open(wrong_url)
            errors.append(wrong.value)
            server.kill()
            with pytest.raises(BackendUnavailable) as down:
                await tier.contains([key])
            errors.append(down.value)
            assert (await manager.lookup([key])).num_chunks == 0  # logged at DEBUG
            for text in texts:
                assert PASSWORD not in text
        finally:
            await manager.close()

    try:
        run(scenario)
    finally:
        server.stop()
    for error in errors:
        chain = [error, error.__cause__, error.__context__]
        assert all(PASSWORD not in repr(e) and PASSWORD not in str(e) for e in chain)
        assert "***" in str(error)
    assert caplog.records, "expected DEBUG logs to inspect"
    assert PASSWORD not in caplog.text
    for record in caplog.records:
        assert PASSWORD not in record.getMessage()
