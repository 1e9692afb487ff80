"""The fleet index against a real redis-server: after random stores, evictions,
promotions, purges, corrupt chunks and node deaths on three nodes (each a
StorageManager with its CPU tier and a disk-like tier, all sharing one Redis-like
tier), every node's cached prefix of every prompt, by tier, as the index answers it
equals a brute-force scan of the tiers themselves. Also: a Redis that lost its data
or was down is caught up with, a node that leaves stops counting at once, bounded
entries, hostile entries."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable

import pytest

from lmtier.chunks.keys import ChunkKey
from lmtier.errors import BackendError
from lmtier.local_store import node_feed
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.host_pool import HostPool
from lmtier.storage.manager import StorageManager
from lmtier.storage.tier import TierProperties
from lmtier.testing import DictTier, make_chunk, random_key
from lmtier_backends.fleet.feeder import FleetFeeder
from lmtier_backends.fleet.index import FleetIndex, Holding, fastest_tier, prefixes, tier_bit
from support.redis_servers import RedisServer

SLAB = 16 * 1024
NAMESPACES = (b"namespace-aaaaa!", b"namespace-bbbbb!")
PROMPT_CHUNKS = 12


class Node:
    """One node: its manager, its own disk-like tier, and its feeder."""

    def __init__(
        self, name: str, shared: DictTier, url: str, *, lower: bool = True, **index: object
    ) -> None:
        self.name = name
        self.pool = HostPool(SLAB, 24)
        self.cpu = CPUTier(self.pool, 6 * self.pool.slab_bytes)
        self.disk = DictTier("disk")
        redis = DictTier("redis", TierProperties(shared=True))
        redis.data = shared.data  # each node's client of one shared store
        self.manager = StorageManager(self.cpu, [self.disk, redis] if lower else [])
        self.index = FleetIndex(url, ttl_s=60.0, **index)  # type: ignore[arg-type]
        self.feeder = FleetFeeder(self.index, node_feed(self.manager), name, interval_s=0.01)
        self.alive = True

    def held_bits(self, key: ChunkKey) -> int:
        bits = tier_bit("cpu") if key in self.cpu else 0
        return bits | (tier_bit("disk") if key in self.disk.data else 0)

    async def close(self) -> None:
        await self.manager.close()
        await self.index.close()
        self.pool.close()


def prompts(rng: random.Random, count: int) -> list[list[ChunkKey]]:
    """Chains of keys; prompts share leading chunks as real ones do."""
    out: list[list[ChunkKey]] = []
    for _ in range(count):
        base = rng.choice(out) if out and rng.random() < 0.5 else []
        cut = rng.randint(0, len(base))
        namespace = rng.choice(NAMESPACES)
        tail = [random_key(namespace) for _ in range(PROMPT_CHUNKS - cut)]
        out.append(base[:cut] + tail)
    return out


def brute_force(nodes: list[Node], shared: DictTier, keys: list[ChunkKey]) -> dict[str, Holding]:
    answer: dict[str, Holding] = {}
    for node in nodes:
        if not node.alive:
            continue
        holding = Holding()
        for key in keys:
            bits = node.held_bits(key) | (tier_bit("redis") if key in shared.data else 0)
            if not bits:
                break
            holding.chunks += 1
            tier = fastest_tier(bits)
            holding.by_tier[tier] = holding.by_tier.get(tier, 0) + 1
        answer[node.name] = holding
    return answer


def put(manager: StorageManager, key: ChunkKey, seed: int) -> None:
    _, data = make_chunk(key, num_tokens=4, hidden=16, seed=seed)
    (handle,) = manager.acquire_slabs(1)
    handle.view[: len(data)] = data
    manager.put(key, handle, len(data))


def run(body: Callable[[list[Node], DictTier], Awaitable[None]], url: str, **index: object) -> None:
    async def case() -> None:
        shared = DictTier("redis", TierProperties(shared=True))
        nodes = [Node(f"node-{i}", shared, url, **index) for i in range(3)]
        for node in nodes:
            await node.manager.start()
        try:
            await body(nodes, shared)
        finally:
            for node in nodes:
                await node.close()

    asyncio.run(case())


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_index_equals_a_scan_of_the_tiers(redis_server: RedisServer, seed: int) -> None:
    redis_server.client().flushall()

    async def body(nodes: list[Node], shared: DictTier) -> None:
        rng = random.Random(seed)
        chains = prompts(rng, 8)

        for step in range(60):
            node = rng.choice([n for n in nodes if n.alive])
            action = rng.random()
            if action < 0.55:  # store a prompt's leading chunks (evicting the LRU)
                chain = rng.choice(chains)
                for at, key in enumerate(chain[: rng.randint(1, len(chain))]):
                    put(node.manager, key, seed=at)
            elif action < 0.7:  # a load, promoting what lower tiers hold
                for chunk in await node.manager.get(rng.choice(chains)[:4]):
                    chunk.release()
            elif action < 0.8 and node.disk.data:  # a corrupt chunk, found on read
                victim = rng.choice(sorted(node.disk.data))
                node.disk.data[victim] = b"\x00" * 64
                await node.cpu.delete([victim])
                for chunk in await node.manager.get([victim]):
                    chunk.release()
            elif action < 0.88:
                await node.manager.purge(rng.choice(NAMESPACES))
            elif action < 0.93 and sum(n.alive for n in nodes) > 1:
                # A node dies: its heartbeat is gone (as when it expires), its
                # entries stay behind.
                node.alive = False
                await node.index.leave(node.name)
                continue
            await node.manager.flush()
            for each in nodes:
                if each.alive:
                    await each.feeder.round()
            for chain in chains:
                live, owners = await nodes[0].index.query(chain)
                found, _ = prefixes(live, owners)
                assert found == brute_force(nodes, shared, chain), f"step {step}"
        assert any(n.cpu.stats.evictions for n in nodes)

    run(body, redis_server.url)


def test_a_node_that_leaves_stops_counting_and_its_entries_go(redis_server: RedisServer) -> None:
    redis_server.client().flushall()

    async def body(nodes: list[Node], shared: DictTier) -> None:
        keys = [random_key() for _ in range(4)]
        for at, key in enumerate(keys):
            put(nodes[0].manager, key, at)
        await nodes[0].feeder.round()
        live, owners = await nodes[1].index.query(keys)
        assert prefixes(live, owners)[0]["node-0"].by_tier == {"cpu": 4}
        live, _ = await nodes[1].index.query(keys, at=time.time() + 10**6)
        assert "node-0" not in live, "a heartbeat that expired: the node is not counted"
        await nodes[0].feeder.close()
        live, owners = await nodes[1].index.query(keys)
        assert "node-0" not in live and owners == []
        assert redis_server.client().zcard("lmtier:{fleet}:o:node-0") == 0

    run(body, redis_server.url)


def test_a_redis_that_lost_its_data_or_was_down_is_caught_up_with(
    redis_server: RedisServer,
) -> None:
    redis_server.client().flushall()

    async def case() -> None:
        node = Node("node-0", DictTier(), redis_server.url, lower=False)  # what a restart lists
        await node.manager.start()

        async def in_memory(keys: list[ChunkKey]) -> list[bool]:
            found = []
            for key in keys:
                _, owners = await node.index.query([key])
                found.append(bool(owners and owners[0].get("node-0", 0) & tier_bit("cpu")))
            return found

        try:
            first = [random_key() for _ in range(3)]
            for at, key in enumerate(first):
                put(node.manager, key, at)
            await node.feeder.round()
            redis_server.client().flushall()  # a restart without persistence
            later = [random_key() for _ in range(2)]
            for at, key in enumerate(later):
                put(node.manager, key, at)
            await node.feeder.round()  # the index did not know the node: start over next
            await node.feeder.round()
            assert await in_memory(first + later) == [True] * 5
            redis_server.kill()
            await node.cpu.delete([later[0]])
            with pytest.raises(BackendError):
                await node.feeder.round()
            redis_server.start()
            await node.feeder.round()
            assert await in_memory(first + later) == [True, True, True, False, True], "hidden"
        finally:
            await node.close()

    asyncio.run(case())


def test_each_node_keeps_at_most_max_keys(redis_server: RedisServer) -> None:
    redis_server.client().flushall()

    async def body(nodes: list[Node], shared: DictTier) -> None:
        node = nodes[0]
        keys = [random_key() for _ in range(5)]
        for at, key in enumerate(keys):
            put(node.manager, key, at)
            await node.manager.flush()  # each key's tiers written in its own round
            await node.feeder.round()
        client = redis_server.client()
        assert client.zcard("lmtier:{fleet}:o:node-0") == 3
        _, owners = await node.index.query(keys[2:])
        assert len(owners) == 3, "the most recently written three"

    run(body, redis_server.url, max_keys=3)


def test_entries_anyone_wrote_never_break_a_query(redis_server: RedisServer) -> None:
    redis_server.client().flushall()

    async def body(nodes: list[Node], shared: DictTier) -> None:
        key = random_key()
        put(nodes[0].manager, key, 0)
        await nodes[0].feeder.round()
        client = redis_server.client()
        name = nodes[0].index.chunk_name(key)
        client.hset(name, mapping={"evil node!": "1", "node-9": "nope", "node-8": "99999999"})
        client.zadd("lmtier:{fleet}:nodes", {"x" * 300: 10**15, "node-8": 10**15})
        live, owners = await nodes[0].index.query([key])
        assert set(live) == {"node-0", "node-8"}
        assert owners == [{"node-0": tier_bit("cpu")}]
        assert prefixes(live, owners)[0]["node-8"].chunks == 0

    run(body, redis_server.url)
