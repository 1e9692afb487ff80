"""The peer tier against a real redis-server (the directory) and real peer listeners
(``lmtier.v1.Peer`` over TCP, grpc.aio), in one process: conformance, two nodes
exchanging chunks, dead peers, wrong tokens, a dead directory.

The processes-level story (sidecars, engines, kill -9) is in test_cluster_peer.py.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from lmtier.chunks.encoding import HeaderTemplate
from lmtier.chunks.format import decode
from lmtier.chunks.keys import ChunkKey
from lmtier.config import LMTierConfig
from lmtier.config.secrets import Secret
from lmtier.errors import BackendError, ConfigError
from lmtier.local_store import HostView
from lmtier.sidecar.auth import Authenticator
from lmtier.sidecar.metrics import SidecarMetrics
from lmtier.sidecar.peer import PeerServer
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.host_pool import HostPool
from lmtier.storage.sealing import Sealer
from lmtier.storage.tier import Tier
from lmtier.testing import make_chunk, random_key
from lmtier.testing.conformance import TierConformance
from lmtier.wire.peer_auth import NodeKey
from lmtier_apps.cluster.trust import SERVER_NAME, TrustFiles, ensure_trust
from lmtier_backends.peer.fetch import PeerClient, PeerTLS
from lmtier_backends.peer.tier import PeerTier
from support.redis_servers import RedisServer

TOKEN = "node-secret-for-tests-0123456789"
SIDECAR_TOKEN = "sidecar-token-for-tests-0123456"
SLAB = 64 * 1024


class Node:
    """One node: a CPU tier, its peer listener, and a peer tier attached to it. The
    listener's node secret is ``secret``; the tier proves ``TOKEN``."""

    def __init__(self, url: str, *, secret: str = TOKEN, tls: TrustFiles | None = None) -> None:
        self.url, self.secret, self.tls = url, secret, tls
        self.cpu_tier = CPUTier(HostPool(SLAB, 256, pin=False))
        self.lock = threading.RLock()
        self.server: PeerServer | None = None
        self.tier: PeerTier | None = None
        self.sealer = Sealer()

    async def start(self, *, ttl_s: float = 15.0, interval_s: float = 0.05) -> PeerTier:
        peer: dict[str, object] = {"enabled": True, "listen": "127.0.0.1:0", "token": self.secret}
        tls = None
        if self.tls is not None:
            peer |= {"tls_cert_file": str(self.tls.cert), "tls_key_file": str(self.tls.key)}
            peer["tls_ca_file"] = str(self.tls.ca)
            tls = PeerTLS(self.tls.ca, self.tls.cert, self.tls.key, SERVER_NAME)
        config = LMTierConfig(peer=peer, sidecar={"auth_token": SIDECAR_TOKEN})
        auth = Authenticator.from_config(config.sidecar)
        self.server = PeerServer(
            config, auth, SidecarMetrics(), HostView(self.cpu_tier, self.lock, self.sealer)
        )
        node = await self.server.start()
        self.tier = PeerTier(
            self.url,
            key=NodeKey(Secret(TOKEN)),
            tls=tls,
            ttl_s=ttl_s,
            publish_interval_s=interval_s,
        )
        await self.tier.attach_node(node)
        return self.tier

    async def stop(self) -> None:
        if self.tier is not None:
            await self.tier.close()
        if self.server is not None:
            await self.server.stop(None)
        self.sealer.close()
        await self.cpu_tier.close()
        self.cpu_tier.pool.close()


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
                assert await a.cpu_tier.put(chunks) == 6  # stored by A's engine, not the tier
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
                a.cpu_tier.discard([keys[2]])

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
                assert await a.cpu_tier.put([(k, unsealed(k, c)) for k, c in chunks]) == 4

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


def test_a_dead_peer_is_not_counted_by_lookups_and_forgotten_with_its_heartbeat(
    redis_server: RedisServer,
) -> None:
    """A lookup asks the owners it would load from: once A is dead, B's lookup counts
    nothing at once (it counted A's 3 chunks until A's heartbeat expired, so an engine
    waited for a load that returned none), and its reads do not call A again."""

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
            assert await tier_b.contains(keys) == 0  # A's heartbeat still lives
            assert await tier_b.get_into(keys, _buffers(3)) == [None] * 3
            assert tier_b.stats.errors >= 1

            async def forgotten() -> bool:
                return await tier_b.directory.lookup(keys) == []

            await _until(forgotten)  # the heartbeat's TTL ran out: 1 s
        finally:
            await a.stop()
            await b.stop()

    _run(body)


def test_a_peer_that_evicted_a_chunk_is_not_counted(redis_server: RedisServer) -> None:
    """Between A's eviction and its publisher's next round the directory still names
    A; B's lookup asks A and counts only the leading chunks A holds."""

    async def body() -> None:
        a, b = Node(redis_server.url), Node(redis_server.url)
        await a.start(interval_s=60.0)  # no round between the eviction and the lookup
        tier_b = await b.start()
        try:
            tier_a = a.tier
            assert tier_a is not None
            chunks = [make_chunk(seed=i) for i in range(4)]
            assert await tier_a.put(chunks) == 4  # claimed at once
            keys = [key for key, _ in chunks]
            assert await tier_b.contains(keys) == 4
            with a.lock:
                a.cpu_tier.discard([keys[2]])
            assert len(await tier_b.directory.lookup(keys)) == 4  # still named
            assert await tier_b.contains(keys) == 2
        finally:
            await a.stop()
            await b.stop()

    _run(body)


def test_another_node_secret_fetches_nothing(redis_server: RedisServer) -> None:
    """A node whose listener has another node secret refuses B's proofs: B's lookup
    counts nothing, and a direct fetch is refused with a one-line reason."""

    async def body() -> None:
        holder = Node(redis_server.url, secret="another-secret-entirely-01234567")
        b = Node(redis_server.url)
        tier_a, tier_b = await holder.start(), await b.start()
        try:
            chunk = make_chunk()
            assert await tier_a.put([chunk]) == 1
            assert len(await tier_b.directory.lookup([chunk[0]])) == 1  # shared directory
            assert await tier_b.contains([chunk[0]]) == 0
            assert await tier_b.get_into([chunk[0]], _buffers(1)) == [None]
            assert tier_a.node is not None
            with pytest.raises(BackendError, match="refused this node's proof"):
                await tier_b.client.fetch_into(tier_a.node.address, [chunk[0]], _buffers(1))
        finally:
            await holder.stop()
            await b.stop()

    _run(body)


def test_peers_talk_mutual_tls_with_the_clusters_certificates(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The shipped cluster's trust files (lmtier cluster): B fetches A's chunks over
    mutual TLS bit-exact; a caller without the cluster's certificate (TLS with the CA
    only, or another CA's certificate) and a plaintext caller get nothing."""
    trust, made = ensure_trust(tmp_path / "secrets")
    assert len(made) == 5
    assert ensure_trust(tmp_path / "secrets")[1] == []  # kept, not remade
    for path in (trust.node_secret, trust.integrity_key, trust.ca, trust.cert, trust.key):
        assert path.stat().st_mode & 0o777 == 0o600
    stranger, _ = ensure_trust(tmp_path / "stranger")

    async def body() -> None:
        a, b = Node(redis_server.url, tls=trust), Node(redis_server.url, tls=trust)
        tier_a, tier_b = await a.start(), await b.start()
        try:
            chunks = [make_chunk(seed=i) for i in range(3)]
            keys = [key for key, _ in chunks]
            assert await tier_a.put(chunks) == 3
            assert await tier_b.contains(keys) == 3
            buffers = _buffers(3)
            assert await tier_b.get_into(keys, buffers) == [len(c) for _, c in chunks]
            assert all(bytes(b[: len(c)]) == c for (_, c), b in zip(chunks, buffers, strict=True))
            assert tier_a.node is not None
            address = tier_a.node.address
            for tls in (
                PeerTLS(trust.ca, server_name=SERVER_NAME),
                PeerTLS(trust.ca, stranger.cert, stranger.key, SERVER_NAME),
                None,
            ):
                client = PeerClient(NodeKey(Secret(TOKEN)), tls=tls, timeout_s=5.0)
                try:
                    with pytest.raises(BackendError):
                        await client.fetch_into(address, keys, _buffers(3))
                finally:
                    await client.close()
        finally:
            await a.stop()
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


def _server(peer: dict[str, object], sidecar: dict[str, object] | None = None) -> None:
    config = LMTierConfig(peer={"enabled": True, **peer}, sidecar=sidecar or {})
    cpu_tier = CPUTier(HostPool(SLAB, 4, pin=False))
    try:
        auth = Authenticator.from_config(config.sidecar)

        async def start() -> None:
            server = PeerServer(
                config, auth, SidecarMetrics(), HostView(cpu_tier, threading.RLock(), Sealer())
            )
            try:
                await server.start()
            finally:
                await server.stop(None)

        asyncio.run(start())
    finally:
        cpu_tier.pool.close()


def test_a_listener_needs_a_node_secret_of_its_own() -> None:
    with pytest.raises(ConfigError, match="node secret"):
        _server({"listen": "127.0.0.1:0"}, {"auth_token": SIDECAR_TOKEN})
    # a sidecar token is no node secret: every node holds the node secret
    with pytest.raises(ConfigError, match="also a sidecar token"):
        _server({"listen": "127.0.0.1:0", "token": TOKEN}, {"auth_token": TOKEN})


def test_a_listener_advertised_outside_the_allowed_peers_is_refused() -> None:
    with pytest.raises(ConfigError, match="allowed_peers"):
        _server({"listen": "127.0.0.1:0", "token": TOKEN, "allowed_peers": "10.0.0.0/8"})
