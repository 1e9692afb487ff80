"""Whoever can write the shared Redis (not the sidecars) against the peer tier: a real
redis-server holds the directory, real peer listeners serve two nodes, and the
attacker runs a gRPC server of their own that answers ``lmtier.v1.Peer``, records
every call and serves forged chunks with valid checksums.

Before the node secret was proven instead of sent, the directory's planted entry made
node B present ``authorization: Bearer <node token>`` to the attacker, who then read
node A's chunks bit-exact with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from test_peer_tier import TOKEN, Node, _buffers, _run

from lmtier.chunks.keys import ChunkKey
from lmtier.config.peer import AddressPolicy
from lmtier.testing import make_chunk
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.wire.peer_auth import CONTAINS_METHOD, FETCH_METHOD, PEER_SERVICE, PROOF_HEADER
from lmtier.wire.pieces import chunk_pieces
from lmtier_backends.peer.directory import PeerDirectory
from support.redis_servers import RedisServer


class PlantedServer:
    """The attacker's server: answers every Contains with "all of them" and every
    Fetch with chunks it made for the keys asked (valid checksums, its own KV)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[tuple[str, Any]], bytes]] = []
        self.server: grpc.aio.Server | None = None

    async def start(self, target: str = "127.0.0.1:0") -> str:
        server = grpc.aio.server()

        def record(method: str, request: pb.PeerFetchRequest, context: Any) -> None:
            metadata = [(k, v) for k, v in context.invocation_metadata()]
            self.calls.append((method, metadata, request.keys))

        async def fetch(request: pb.PeerFetchRequest, context: Any) -> AsyncIterator[bytes]:
            record(FETCH_METHOD, request, context)
            for start in range(0, len(request.keys), 32):
                key = ChunkKey(request.keys[start : start + 32])
                _, data = make_chunk(seed=7, key=key)
                for piece in chunk_pieces(key, memoryview(data), len(data), 1 << 20, tier="x"):
                    yield piece

        async def contains(request: pb.PeerFetchRequest, context: Any) -> pb.PeerContainsReply:
            record(CONTAINS_METHOD, request, context)
            return pb.PeerContainsReply(leading=len(request.keys) // 32)

        methods = {
            "Fetch": grpc.unary_stream_rpc_method_handler(
                fetch,
                request_deserializer=pb.PeerFetchRequest.FromString,
                response_serializer=None,
            ),
            "Contains": grpc.unary_unary_rpc_method_handler(
                contains,
                request_deserializer=pb.PeerFetchRequest.FromString,
                response_serializer=pb.PeerContainsReply.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(PEER_SERVICE, methods),)
        )
        port = server.add_insecure_port(target)
        await server.start()
        self.server = server
        return target if target.startswith("unix:") else f"127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(None)

    def secrets_seen(self) -> list[str]:
        """Every metadata value that holds the node secret (none may)."""
        return [
            f"{key}: {value!r}"
            for _, metadata, _ in self.calls
            for key, value in metadata
            if TOKEN in str(value) or key == "authorization"
        ]


async def _plant(url: str, node_id: str, address: str, keys: list[ChunkKey]) -> None:
    """What the attacker writes: a heartbeat for ``node_id`` at ``address`` and claims."""
    directory = PeerDirectory(url)
    try:
        await directory.heartbeat(node_id, address)
        await directory.publish(node_id, keys)
    finally:
        await directory.close()


async def _replay(
    channel: grpc.aio.Channel, method: str, keys: bytes, metadata: list[tuple[str, Any]]
) -> None:
    """Send ``keys`` with ``metadata`` as a call of ``method``, reading the whole reply."""
    request = pb.PeerFetchRequest(keys=keys).SerializeToString()
    if method == FETCH_METHOD:
        async for _ in channel.unary_stream(method)(request, metadata=metadata):
            pass
    else:
        await channel.unary_unary(method)(request, metadata=metadata)


def test_a_planted_owner_learns_no_secret_and_serves_nothing(redis_server: RedisServer) -> None:
    """The attacker takes over node A's heartbeat (A's chunks now point at the
    attacker): B's lookup counts nothing, B's reads take none of the forged chunks,
    the attacker never sees the node secret, and the proofs it did see open nothing
    when replayed to the real node A."""

    async def body() -> None:
        a, b = Node(redis_server.url), Node(redis_server.url)
        planted = PlantedServer()
        tier_a, tier_b = await a.start(interval_s=60.0), await b.start()
        try:
            chunks = [make_chunk(seed=i) for i in range(4)]
            keys = [key for key, _ in chunks]
            assert await tier_a.put(chunks) == 4
            assert tier_a.node is not None
            real = tier_a.node.address
            evil = await planted.start()
            await _plant(redis_server.url, tier_a.node_id, evil, keys)

            assert await tier_b.contains(keys) == 0
            assert [call[0] for call in planted.calls] == [CONTAINS_METHOD]
            assert planted.secrets_seen() == []
            # read directly from the planted owner: its unproven reply is not taken
            with pytest.raises(Exception, match="did not prove"):
                await tier_b.client.fetch_into(evil, keys, _buffers(4))
            assert planted.secrets_seen() == []
            assert all(
                any(key == PROOF_HEADER for key, _ in metadata) for _, metadata, _ in planted.calls
            )

            # every proof the attacker holds, replayed to the real node A
            channel = grpc.aio.insecure_channel(real)
            try:
                for method, metadata, data in planted.calls:
                    proof = [(k, v) for k, v in metadata if k == PROOF_HEADER]
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await _replay(channel, method, data, proof)
                    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
                    assert "another address" in (refused.value.details() or "")
            finally:
                await channel.close()
        finally:
            await planted.stop()
            await a.stop()
            await b.stop()

    _run(body)


def test_garbage_in_the_directory_is_a_miss(redis_server: RedisServer) -> None:
    """Bytes that are no text, a huge value and control characters as a node's address
    or id: lookups and reads miss, nothing raises."""

    async def body() -> None:
        b = Node(redis_server.url)
        tier_b = await b.start()
        try:
            for index, (node_id, address) in enumerate(
                [
                    ("bad-utf8", b"\xff\xfe\x00:70"),
                    ("huge", b"1" * 100_000 + b":70"),
                    ("new\nline", b"127.0.0.1:70\n"),
                ]
            ):
                keys = [make_chunk(seed=20 + index + i)[0] for i in range(2)]
                await _plant(redis_server.url, node_id, address, keys)  # type: ignore[arg-type]
                assert await tier_b.contains(keys) == 0
                assert await tier_b.get_into(keys, _buffers(2)) == [None] * 2
        finally:
            await b.stop()

    asyncio.run(body())


def test_addresses_the_policy_does_not_allow_are_never_dialled(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Planted owners at a loopback port (B allows only ``localhost`` by name) and at
    a unix socket get no call at all; B's lookups and reads count them as misses."""

    async def body() -> None:
        b = Node(redis_server.url)
        tier_b = await b.start()
        tier_b.owners.policy = AddressPolicy.parse(["localhost"])
        over_tcp, over_unix = PlantedServer(), PlantedServer()
        try:
            for index, (server, target) in enumerate(
                ((over_tcp, "127.0.0.1:0"), (over_unix, f"unix:{tmp_path}/planted.sock"))
            ):
                keys = [make_chunk(seed=10 * index + i)[0] for i in range(3)]
                address = await server.start(target)
                await _plant(redis_server.url, f"planted-{index}", address, keys)
                assert await tier_b.contains(keys) == 0
                assert await tier_b.get_into(keys, _buffers(3)) == [None] * 3
            assert over_tcp.calls == [] and over_unix.calls == []
        finally:
            await over_tcp.stop()
            await over_unix.stop()
            await b.stop()

    asyncio.run(body())
