"""The peer tier against a real redis-server (the directory) and real peer listeners
(``lmtier.v1.Peer`` over TCP, grpc.aio), in one process: conformance, two nodes
exchanging chunks, dead peers, wrong tokens, a dead directory.

The processes-level story (sidecars, engines, kill -9) is in test_cluster_peer.py.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import pytest
from redis_servers import RedisServer

from lmtier.chunks.encoding import HeaderTemplate
from lmtier.chunks.format import decode
from lmtier.chunks.keys import ChunkKey
from lmtier.config import LMTierConfig
from lmtier.config.secrets import Secret
from lmtier.errors import BackendError, ConfigError
from lmtier.sidecar.auth import Authenticator, Principal
from lmtier.sidecar.metrics import SidecarMetrics
from lmtier.sidecar.peer import PeerServer
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.memory import HostPool
from lmtier.storage.sealing import Sealer
from lmtier.storage.tier import Tier
from lmtier.testing import make_chunk, random_key
from lmtier.testing.conformance import TierConformance
from lmtier_backends.peer.tier import PeerTier

TOKEN = "node-token-for-tests-0123456789"
SLAB = 64 * 1024


class Node:
    """One node: a CPU tier, its peer listener, and a peer tier attached to it."""

    def __init__(self, url: str, *, token: str = TOKEN, scoped: bool = False) -> None:
        self.url, self.token, self.scoped = url, token, scoped
        self.memory = CPUTier(HostPool(SLAB, 256, pin=False))
        self.lock = threading.RLock()
        self.server: PeerServer | None = None
        self.tier: PeerTier | None = None
        self.sealer = Sealer()

    async def start(self, *, ttl_s: float = 15.0, interval_s: float = 0.05) -> PeerTier:
        principal = Principal("scoped", models=frozenset({"m"})) if self.scoped else Principal("n")
        auth = Authenticator([(Secret(self.token), principal)])
        config = LMTierConfig(
            peer={"enabled": True, "listen": "127.0.0.1:0"}, sidecar={"auth_token": TOKEN}
        )
        self.server = PeerServer(
            config, auth, SidecarMetrics(), self.memory, self.lock, sealer=self.sealer
        )
        node = await self.server.start()
        self.tier = PeerTier(
            self.url, token=Secret(TOKEN), ttl_s=ttl_s, publish_interval_s=interval_s
        )
        await self.tier.attach_node(node)
        return self.tier

    async def stop(self) -> None:
        if self.tier is not None:
            await self.tier.close()
        if self.server is not None:
            await self.server.stop(None)
        self.sealer.close()
        await self.memory.close()
        self.memory.pool.close()


class ServedPeerTier(PeerTier):
    """A peer tier whose close also stops its node's listener (for the conformance suite)."""

    node_of: Node

    async def close(self) -> None:
        await super().close()
        if self.node_of.server is not None:
            await self.node_of.server.stop(None)
            self.node_of.server = None


class TestPeerConformance(TierConformance):
    @pytest.fixture
    def make_tier(self, redis_server: RedisServer) -> Callable[[], Awaitable[Tier]]:
        async def factory() -> Tier:
            node = Node(redis_server.url)
            tier = await node.start()
            tier.__class__ = ServedPeerTier
            tier.node_of = node  # type: ignore[attr-defined]
            return tier

        return factory


def _run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


def _buffers(count: int) -> list[memoryview]:
    return [memoryview(bytearray(SLAB)) for _ in range(count)]


async def _until(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 30.0) -> None:
    """Poll ``predicate`` (a state, never a duration) until it holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def test_a_node_reads_what_another_holds_bit_exact(redis_server: RedisServer) -> None:
    async def body() -> None:
        a, b = Node(redis_server.url), Node(redis_server.url)
        tier_a, tier_b = await a.start(), await b.start()
        try:
            chunks = [make_chunk(seed=i) for i in range(6)]
            with a.lock:
                assert await a.memory.put(chunks) == 6  # stored by A's engine, not the tier
            keys = [key for key, _ in chunks]

            async def published() -> bool:
                return await tier_b.contains(keys) == 6

            await _until(published)  # A's publisher found them
            buffers = _buffers(6)
            sizes = await tier_b.get_into(keys, buffers)
            assert sizes == [len(data) for _, data in chunks]
            for (_, data), buffer in zip(chunks, buffers, strict=True):
                assert bytes(buffer[: len(data)]) == data
            # A evicts one: the directory forgets it at A's next round
            with a.lock:
                a.memory.discard([keys[2]])

            async def withdrawn() -> bool:
                return await tier_b.contains(keys) == 2

            await _until(withdrawn)
            assert tier_a.publisher is not None and tier_a.publisher.rounds > 0
        finally:
            await a.stop()
            await b.stop()

    _run(body)


def unsealed(key: ChunkKey, chunk: bytes) -> bytes:
    """``chunk`` as an engine's store frames it: no checksum yet (``UNSEALED``)."""
    meta = decode(chunk).meta
    data = bytearray(chunk)
    HeaderTemplate(meta).frame_into(memoryview(data), key, ctime=meta.created, sealed=False)
    return bytes(data)


def test_a_chunk_not_yet_written_down_is_sealed_and_served(redis_server: RedisServer) -> None:
    """A node with no lower tier holds what its engines stored unsealed (the first
    write down seals it); a fetch seals it, so the asker's check passes. It was
    refused as unsealed: the asker missed and deleted the node's directory entry."""

    async def body() -> None:
        a, b = Node(redis_server.url), Node(redis_server.url)
        await a.start()
        tier_b = await b.start()
        try:
            chunks = [make_chunk(seed=i) for i in range(4)]
            keys = [key for key, _ in chunks]
            with a.lock:
                assert await a.memory.put([(k, unsealed(k, c)) for k, c in chunks]) == 4

            async def published() -> bool:
                return await tier_b.contains(keys) == 4

            await _until(published)
            buffers = _buffers(4)
            assert await tier_b.get_into(keys, buffers) == [len(c) for _, c in chunks]
            for (_, chunk), buffer in zip(chunks, buffers, strict=True):
                assert bytes(buffer[: len(chunk)]) == chunk  # sealed as make_chunk seals
            assert a.sealer.sealed == 4 and tier_b.stats.corrupt == 0
            assert await tier_b.get_into(keys, _buffers(4)) == [len(c) for _, c in chunks]
            assert a.sealer.sealed == 4  # sealed in place, once
        finally:
            await a.stop()
            await b.stop()

    _run(body)


def test_a_dead_peer_is_a_miss_and_forgotten_with_its_heartbeat(
    redis_server: RedisServer,
) -> None:
    async def body() -> None:
        a, b = Node(redis_server.url), Node(redis_server.url)
        await a.start(ttl_s=1.0, interval_s=0.05)
        tier_b = await b.start()
        try:
            chunks = [make_chunk(seed=i) for i in range(3)]
            tier_a = a.tier
            assert tier_a is not None
            assert await tier_a.put(chunks) == 3
            keys = [key for key, _ in chunks]
            assert await tier_b.contains(keys) == 3
            # A dies without a word: its listener stops, its publisher stops beating
            assert a.server is not None and tier_a.publisher is not None
            await a.server.stop(None)
            publisher_task = tier_a.publisher._task
            assert publisher_task is not None
            publisher_task.cancel()
            with pytest.raises(BackendError):  # every peer of the read failed
                await tier_b.get_into(keys, _buffers(3))

            async def forgotten() -> bool:
                return await tier_b.contains(keys) == 0

            await _until(forgotten)  # the heartbeat's TTL ran out: 1 s
        finally:
            await a.stop()
            await b.stop()

    _run(body)


def test_a_wrong_or_scoped_token_fetches_nothing(redis_server: RedisServer) -> None:
    async def body() -> None:
        for holder in (
            Node(redis_server.url, token="another-token-entirely-01234567"),
            Node(redis_server.url, scoped=True),
        ):
            b = Node(redis_server.url)
            tier_a, tier_b = await holder.start(), await b.start()
            try:
                chunk = make_chunk()
                assert await tier_a.put([chunk]) == 1
                assert await tier_b.contains([chunk[0]]) == 1  # the directory is shared
                with pytest.raises(BackendError, match="refused the token"):
                    await tier_b.get_into([chunk[0]], _buffers(1))
            finally:
                await holder.stop()
                await b.stop()

    _run(body)


def test_a_dead_directory_is_a_backend_error_then_heals(tmp_path) -> None:  # type: ignore[no-untyped-def]
    server = RedisServer(tmp_path / "redis").start()
    try:

        async def body() -> None:
            a = Node(server.url)
            tier = await a.start(interval_s=0.05)
            try:
                chunk = make_chunk()
                assert await tier.put([chunk]) == 1
                server.pause()
                with pytest.raises(BackendError):
                    await asyncio.wait_for(tier.contains([chunk[0]]), 30)
                server.resume()

                async def healed() -> bool:
                    try:
                        return await tier.contains([chunk[0], random_key()]) == 1
                    except BackendError:
                        return False

                await _until(healed)
            finally:
                await a.stop()

        _run(body)
    finally:
        server.stop()


def test_a_listener_needs_a_token() -> None:
    config = LMTierConfig(peer={"enabled": True, "listen": "127.0.0.1:0"})
    memory = CPUTier(HostPool(SLAB, 4, pin=False))
    try:
        auth, lock = Authenticator(), threading.RLock()
        with pytest.raises(ConfigError, match="token"):
            PeerServer(config, auth, SidecarMetrics(), memory, lock, sealer=Sealer())
    finally:
        memory.pool.close()
