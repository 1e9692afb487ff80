"""The S3 tier against a real HTTP S3 endpoint (moto in server mode, its own process).

Conformance, large batches and values, object naming, expiry, reads of other nodes'
writes, objects corrupted behind the tier's back, and faults (a hung or killed server)
through a real StorageManager. Coroutines run under ``asyncio.run`` in plain tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import boto3
import pytest

from lmtier.chunks.keys import ChunkKey
from lmtier.config import S3TierConfig
from lmtier.config.secrets import Secret
from lmtier.errors import BackendError, BackendUnavailable, ConfigError
from lmtier.storage.breaker import BreakerState, CircuitBreaker
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.host_pool import HostPool
from lmtier.storage.manager import StorageManager
from lmtier.testing import make_chunk, random_key
from lmtier.testing.conformance import TierConformance
from lmtier_backends.s3 import open_tier
from lmtier_backends.s3.io import SCAN_AHEAD_WINDOWS
from lmtier_backends.s3.tier import S3Tier, read_body_into
from support.s3_server import (  # noqa: F401 - fixtures
    MotoServer,
    dummy_credentials,
    free_port,
    s3_credentials,
    s3_server,
)

pytestmark = pytest.mark.integration

T = TypeVar("T")
BUCKET = "lmtier-test"
MIB = 1 << 20


def run(fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
    async def main() -> T:
        return await fn(*args, **kwargs)

    return asyncio.run(main())


def buffers(count: int, size: int = 64 * 1024) -> list[memoryview]:
    return [memoryview(bytearray(size)) for _ in range(count)]


def plain_client(endpoint: str) -> Any:
    return boto3.session.Session().client("s3", endpoint_url=endpoint, region_name="us-east-1")


@pytest.fixture(scope="module")
def endpoint(s3_server: MotoServer) -> str:  # noqa: F811
    plain_client(s3_server.endpoint).create_bucket(Bucket=BUCKET)
    return s3_server.endpoint


@pytest.fixture(scope="module")
def raw(endpoint: str) -> Iterator[Any]:
    """A plain boto3 client on the same endpoint, for looking behind the tier's back."""
    client = plain_client(endpoint)
    yield client
    client.close()


@pytest.fixture
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:8]}/"


def open_s3(endpoint: str, prefix: str, **kwargs: Any) -> Awaitable[S3Tier]:
    options: dict[str, Any] = {"max_concurrency": 8, "timeout_s": 5.0, **kwargs}
    return S3Tier.open(BUCKET, prefix=prefix, endpoint_url=endpoint, **options)


def exists(raw: Any, key: str) -> bool:
    return bool(raw.list_objects_v2(Bucket=BUCKET, Prefix=key)["KeyCount"])


class TestS3Conformance(TierConformance):
    @pytest.fixture
    def make_tier(self, endpoint: str, prefix: str):  # type: ignore[no-untyped-def]
        return lambda: open_s3(endpoint, prefix)


# --- batches, sizes, naming ------------------------------------------------------------


def test_contains_1000_keys_and_early_stop(endpoint: str, prefix: str) -> None:
    chunks = [make_chunk(num_tokens=1, hidden=8) for _ in range(1000)]
    keys = [key for key, _ in chunks]

    async def scenario() -> None:
        tier = await open_s3(endpoint, prefix, max_concurrency=16)
        heads: list[str] = []
        tier.client.meta.events.register(
            "before-send.s3.HeadObject", lambda request, **_: heads.append(request.url)
        )
        try:
            assert await tier.put(chunks) == 1000
            assert await tier.contains(keys) == 1000
            assert len(heads) == 1000

            # A miss at 500 stops the cursor: a round or so of HEADs past it, and never
            # more than the cursor's reach past the lowest unanswered key, however long
            # the miss's own HEAD takes (a descheduled thread on a loaded machine).
            heads.clear()
            assert await tier.contains([*keys[:500], random_key(), *keys[500:]]) == 500
            assert 501 <= len(heads) <= 500 + SCAN_AHEAD_WINDOWS * 16

            heads.clear()  # fresh keys: the slow-start window, 2 HEADs, not 1000
            assert await tier.contains([random_key() for _ in range(1000)]) == 0
            assert len(heads) <= 2
            assert tier.stats.lookups == 3001
        finally:
            await tier.close()

    run(scenario)


@pytest.mark.parametrize("payload_mib", [1, 8, 32])
def test_large_values_round_trip(endpoint: str, prefix: str, payload_mib: int) -> None:
    # payload = 2 (k, v) x tokens x hidden x 4 bytes
    key, data = make_chunk(num_tokens=256 * payload_mib, hidden=512, seed=payload_mib)
    assert payload_mib * MIB < len(data) < payload_mib * MIB + 512  # + its header

    async def scenario() -> None:
        tier = await open_s3(endpoint, prefix)
        try:
            assert await tier.put([(key, memoryview(data))]) == 1
            assert tier.stats.bytes_written == len(data)
            (buffer,) = buffers(1, len(data) + 8192)
            assert await tier.get_into([key], [buffer]) == [len(data)]
            assert buffer[: len(data)] == data
            assert await tier.get_into([key], buffers(1, len(data) - 1)) == [None]
        finally:
            await tier.close()

    run(scenario)


@pytest.mark.parametrize("direct", [True, False])
def test_read_body_into_both_paths(raw: Any, direct: bool) -> None:
    data = os.urandom(3 * MIB + 17)
    raw.put_object(Bucket=BUCKET, Key="body-paths", Body=data)
    response = raw.get_object(Bucket=BUCKET, Key="body-paths")
    view = memoryview(bytearray(len(data)))
    read_body_into(response["Body"], view, direct=direct)
    # The direct path reads under urllib3, which then has counted nothing: this fails
    # if a urllib3 or botocore upgrade silently sends every read down the copying path.
    assert response["Body"]._raw_stream._fp_bytes_read == (0 if direct else len(data))
    response["Body"].close()
    assert view == data


def test_objects_named_by_namespace_and_stored_unchanged(
    endpoint: str, prefix: str, raw: Any
) -> None:
    ns_a, ns_b = b"A" * 16, b"B" * 16
    chunks_a = [make_chunk(random_key(ns_a)) for _ in range(3)]
    chunks_b = [make_chunk(random_key(ns_b)) for _ in range(2)]

    async def scenario() -> None:
        tier = await open_s3(endpoint, prefix)
        try:
            await tier.put(chunks_a + chunks_b)
            assert tier.namespace_prefix(ns_a) == f"{prefix}{ns_a.hex()}/"
            listed = raw.list_objects_v2(Bucket=BUCKET, Prefix=tier.namespace_prefix(ns_a))
            names = sorted(item["Key"] for item in listed["Contents"])
            assert names == sorted(f"{prefix}{ns_a.hex()}/{k[16:].hex()}" for k, _ in chunks_a)
            key, data = chunks_b[0]
            assert tier.object_key(key) == f"{prefix}{ns_b.hex()}/{key[16:].hex()}"
            body = raw.get_object(Bucket=BUCKET, Key=tier.object_key(key))["Body"].read()
            assert body == data
        finally:
            await tier.close()

    run(scenario)


# --- expiry and freshness -----------------------------------------------------------------


def test_expired_objects_are_misses_and_deleted(endpoint: str, prefix: str, raw: Any) -> None:
    (k1, d1), (k2, d2) = make_chunk(), make_chunk()

    async def gone(tier: S3Tier, key: ChunkKey) -> bool:
        for _ in range(100):  # the delete runs in the background
            if not exists(raw, tier.object_key(key)):
                return True
            await asyncio.sleep(0.02)
        return False

    async def scenario() -> None:
        # LastModified has whole seconds and a loaded machine is slow: a ttl_s of about
        # a second could expire a fresh object. Move the clock of one tier instead.
        now = await open_s3(endpoint, prefix, ttl_s=30.0)
        later = await open_s3(endpoint, prefix, ttl_s=30.0, clock=lambda: time.time() + 60)
        try:
            await now.put([(k1, d1), (k2, d2)])
            assert await now.contains([k1, k2]) == 2  # fresh within ttl_s
            assert await later.contains([k1]) == 0  # HEAD: expired
            assert await gone(later, k1)
            assert exists(raw, later.object_key(k2))  # never asked: left alone
            assert await later.get_into([k2], buffers(1)) == [None]  # GET: expired
            assert await gone(later, k2)
            assert later.stats.evictions == 2
            assert await now.contains([k1]) == 0
        finally:
            await now.close()
            await later.close()

    run(scenario)


def test_no_stale_miss_after_another_node_writes(endpoint: str, prefix: str) -> None:
    key, data = make_chunk()

    async def scenario() -> None:
        node_a = await open_s3(endpoint, prefix)
        node_b = await open_s3(endpoint, prefix)
        try:
            assert await node_a.contains([key]) == 0
            assert await node_a.get_into([key], buffers(1)) == [None]
            assert await node_b.put([(key, data)]) == 1
            assert await node_a.contains([key]) == 1
            assert await node_a.get_into([key], buffers(1)) == [len(data)]
        finally:
            await node_a.close()
            await node_b.close()

    run(scenario)


# --- corruption -------------------------------------------------------------------------


def test_objects_corrupted_behind_our_back(endpoint: str, prefix: str, raw: Any) -> None:
    chunks = [make_chunk(seed=i) for i in range(5)]
    keys = [key for key, _ in chunks]
    data = chunks[0][1]
    flipped = bytearray(data)
    flipped[5000] ^= 0x01  # one bit of the payload
    damaged = [bytes(flipped), data[:-100], os.urandom(len(data)), chunks[4][1]]

    async def scenario() -> None:
        tier = await open_s3(endpoint, prefix)
        try:
            await tier.put(chunks)
            for key, body in zip(keys[:4], damaged, strict=True):
                raw.put_object(Bucket=BUCKET, Key=tier.object_key(key), Body=body)
            assert await tier.contains(keys) == 5  # HEAD cannot tell; reads validate
            sizes = await tier.get_into(keys, buffers(5))
            assert sizes == [None, None, None, None, len(chunks[4][1])]
            assert tier.stats.corrupt == 4
            assert [exists(raw, tier.object_key(k)) for k in keys] == [False] * 4 + [True]
            assert await tier.contains(keys) == 0
            # An object larger than any slab can never be served: no phantom hit.
            raw.put_object(Bucket=BUCKET, Key=tier.object_key(keys[4]), Body=bytes(70 * 1024))
            assert await tier.get_into(keys[4:], buffers(1)) == [None]
            assert tier.stats.unservable == 1
            assert not exists(raw, tier.object_key(keys[4]))
            assert await tier.contains(keys[4:]) == 0
        finally:
            await tier.close()

    run(scenario)


# --- opening, credentials, close ------------------------------------------------------------


def test_open_missing_bucket_is_a_clear_config_error(endpoint: str) -> None:
    with pytest.raises(ConfigError, match=f"'no-such-bucket' at {endpoint} does not exist"):
        run(S3Tier.open, "no-such-bucket", endpoint_url=endpoint)


def test_open_unreachable_endpoint_names_it(s3_credentials: None) -> None:  # noqa: F811
    port = free_port()  # nobody listens there
    with pytest.raises(
        BackendError, match=f"'lmtier-b' at http://127.0.0.1:{port} cannot be reached"
    ):
        run(S3Tier.open, "lmtier-b", endpoint_url=f"http://127.0.0.1:{port}", timeout_s=0.5)


def test_open_tier_from_config(endpoint: str, prefix: str) -> None:
    config = S3TierConfig(bucket=BUCKET, prefix=prefix, endpoint_url=endpoint, ttl_s=60.0)

    async def scenario() -> None:
        tier = await open_tier(config)
        try:
            assert tier.properties.shared
            assert tier.properties.write_policy == "write_through"
            assert tier.properties.timeout_s == config.timeout_s
            assert await tier.put([make_chunk()]) == 1
        finally:
            await tier.close()
        await tier.close()  # idempotent
        with pytest.raises(BackendError, match="closed"):
            await tier.contains([random_key()])

    run(scenario)


def test_credentials_never_logged(
    endpoint: str, prefix: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_id, secret, token = "AKIDLMTIERTEST42", "sEcReT/lmtier+key", "TOKENlmtier/session+x"
    caplog.set_level(logging.DEBUG)
    chunk = make_chunk()

    async def scenario() -> list[str]:
        tier = await open_s3(
            endpoint, prefix, access_key_id=Secret(key_id), secret_access_key=Secret(secret)
        )
        try:
            await tier.put([chunk])
            await tier.contains([chunk[0], random_key()])
            await tier.get_into([chunk[0]], buffers(1))
            await tier.delete([chunk[0]])
            shown = [repr(tier), repr(tier.config), str(tier.config)]
        finally:
            await tier.close()
        with pytest.raises(ConfigError) as info:
            await S3Tier.open(
                "missing",
                endpoint_url=endpoint,
                access_key_id=Secret(key_id),
                secret_access_key=Secret(secret),
            )
        # Credentials from the default chain, with a session token, are masked too.
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
        monkeypatch.setenv("AWS_SESSION_TOKEN", token)
        chained = await open_s3(endpoint, prefix)
        try:
            await chained.contains([chunk[0]])
        finally:
            await chained.close()
        return [*shown, str(info.value)]

    shown = run(scenario)
    assert "Sending http request" in caplog.text  # botocore's DEBUG lines were captured
    assert "Credential=***" in caplog.text
    for text in [caplog.text, *shown]:
        for value in (key_id, secret, token):
            assert value not in text


def test_close_returns_within_a_second_while_the_server_hangs(
    s3_server: MotoServer,  # noqa: F811
    endpoint: str,
    prefix: str,
) -> None:
    key, data = make_chunk()
    timeout_s = 120.0  # far longer than the bounds below: nothing may wait for it

    async def scenario() -> None:
        tier = await open_s3(endpoint, prefix, timeout_s=timeout_s)
        await tier.put([(key, data)])
        s3_server.pause()
        try:
            reading = asyncio.ensure_future(tier.get_into([key], buffers(1)))
            abandoned = asyncio.ensure_future(tier.get_into([key], buffers(1)))
            await asyncio.sleep(0.2)
            assert not reading.done() and not abandoned.done()  # hung on the stopped server
            started = time.perf_counter()
            await tier.close()
            assert time.perf_counter() - started < 20.0
            # Closing ends the hung GETs (their connections are shut down, the retry
            # refused) while the server is still stopped: a cancelled one returns once
            # its thread is done with its buffer, and that is now, not after the timeout.
            abandoned.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await abandoned
            with pytest.raises(BackendUnavailable, match="closed"):
                await reading
        finally:
            s3_server.resume()

    started = time.perf_counter()
    run(scenario)
    # A hang guard, not a speed check: the whole scenario, the event loop's shutdown
    # included, ends far below one timeout (a hung GET used to hold its thread, and so
    # the cancelled call and asyncio.run, for the timeout twice: 240 s).
    assert time.perf_counter() - started < timeout_s / 2


# --- faults through the StorageManager -------------------------------------------------------

TIMEOUT_S = 0.5
MARGIN_S = 3.0
"""Beyond the timeout, what a call may take on a loaded machine (it was 0.5 s); a call
that hung on the stopped server would not come back at all."""
SLAB = 16 * 1024


def small_chunks(count: int) -> list[tuple[ChunkKey, bytes]]:
    return [make_chunk(num_tokens=4, hidden=16) for _ in range(count)]


async def manager_on(tier: S3Tier) -> StorageManager:
    pool = HostPool(SLAB, 64)
    manager = StorageManager(
        CPUTier(pool),
        [tier],
        breaker_factory=lambda: CircuitBreaker(
            failure_threshold=2, reset_after_s=0.2, max_reset_after_s=0.4
        ),
    )
    await manager.start()
    return manager


async def put_through(manager: StorageManager, items: list[tuple[ChunkKey, bytes]]) -> None:
    for key, data in items:
        handle = manager.cpu_tier.acquire_slab()
        assert handle is not None
        handle.view[: len(data)] = data
        manager.put(key, handle, len(data))
    await manager.flush()


async def misses_within_timeout(manager: StorageManager, keys: list[ChunkKey]) -> None:
    """Lookups and loads miss within the timeout and raise nothing; the breaker opens."""
    for _ in range(3):
        started = time.perf_counter()
        assert (await manager.lookup(keys)).num_chunks == 0
        assert await manager.get(keys) == []
        assert time.perf_counter() - started < 2 * TIMEOUT_S + MARGIN_S
    assert manager.breakers["s3"].state is not BreakerState.CLOSED
    started = time.perf_counter()
    assert (await manager.lookup(keys)).num_chunks == 0
    assert time.perf_counter() - started < TIMEOUT_S + MARGIN_S
    stats = manager.stats()["s3"]
    assert stats["errors"] >= 2
    assert stats["breaker_opens"] >= 1


async def recovers(manager: StorageManager, tier: S3Tier) -> None:
    """The breaker closes once the server answers again; new writes read back from S3."""
    deadline = time.monotonic() + 60  # a hang guard: it closes within a second
    while manager.breakers["s3"].state is not BreakerState.CLOSED:
        assert time.monotonic() < deadline, "breaker never closed"
        await manager.lookup([random_key()])  # a probe once the breaker allows one
        await asyncio.sleep(0.05)
    fresh = small_chunks(3)
    await put_through(manager, fresh)
    keys = [key for key, _ in fresh]
    assert await tier.contains(keys) == 3
    sizes = await tier.get_into(keys, buffers(3))
    assert sizes == [len(data) for _, data in fresh]


def test_hung_server_is_a_miss_and_recovers(
    s3_server: MotoServer,  # noqa: F811
    endpoint: str,
    prefix: str,
) -> None:
    async def scenario() -> None:
        tier = await open_s3(endpoint, prefix, timeout_s=TIMEOUT_S, max_concurrency=4)
        manager = await manager_on(tier)
        try:
            stored = small_chunks(4)
            await tier.put(stored)  # in S3 only, so lookups must ask it
            keys = [key for key, _ in stored]
            assert (await manager.lookup(keys)).num_chunks == 4
            s3_server.pause()
            try:
                await misses_within_timeout(manager, keys)
            finally:
                s3_server.resume()
            await recovers(manager, tier)
            assert (await manager.lookup(keys)).num_chunks == 4
        finally:
            await manager.close()

    run(scenario)


@pytest.mark.slow  # a restart: the S3 server killed and started again
def test_killed_server_is_a_miss_and_recovers_after_restart(prefix: str) -> None:
    server = MotoServer()
    with dummy_credentials():
        server.start()
        try:
            plain_client(server.endpoint).create_bucket(Bucket=BUCKET)
            run(_killed_scenario, server, prefix)
        finally:
            server.close()


async def _killed_scenario(server: MotoServer, prefix: str) -> None:
    tier = await open_s3(server.endpoint, prefix, timeout_s=TIMEOUT_S, max_concurrency=4)
    manager = await manager_on(tier)
    try:
        stored = small_chunks(4)
        await tier.put(stored)
        keys = [key for key, _ in stored]
        server.kill()
        with pytest.raises(BackendError):  # the tier itself says the endpoint is gone...
            await tier.contains(keys)
        with pytest.raises(BackendError):
            await tier.put(small_chunks(2))
        await misses_within_timeout(manager, keys)  # ...the manager turns that into misses
        server.start()  # same port, empty: moto keeps data in memory
        plain_client(server.endpoint).create_bucket(Bucket=BUCKET)
        await recovers(manager, tier)
        assert (await manager.lookup(keys)).num_chunks == 0  # lost with the old server
    finally:
        await manager.close()
