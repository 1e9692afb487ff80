"""``fleet.enabled``: an embedded cache keeps its node's entries in the fleet index (a
real redis-server) through the ``lmtier.services`` entry point, including what its
disk tier held before it started, and withdraws them when it closes; a Redis that is
down at start costs the index its freshness, not the cache."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import torch

from lmtier import KVSpec, LMTier
from lmtier.config import LMTierConfig
from lmtier_backends.fleet.index import FleetIndex, prefixes
from support.redis_servers import RedisServer, free_port

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=16)
CHUNK = 16
WAIT_S = 30.0  # catches a hang: the index follows within an interval


def config(tmp_path: Path, url: str, **fleet: Any) -> LMTierConfig:
    slab = SPEC.encoded_chunk_bytes(CHUNK)
    return LMTierConfig(
        chunk_size=CHUNK,
        cpu={"capacity_bytes": 4 * slab, "staging_bytes": 4 * slab},
        disk={"path": str(tmp_path / "disk")},
        fleet={"enabled": True, "node_id": "node-a", "index_url": url, "interval_s": 0.01, **fleet},
    )


def holding(url: str, keys: list[bytes]) -> dict[str, Any]:
    async def ask() -> dict[str, Any]:
        index = FleetIndex(url)
        try:
            live, owners = await index.query(keys)  # type: ignore[arg-type]
            found, _ = prefixes(live, owners)
            return {node: (h.chunks, h.by_tier) for node, h in found.items()}
        finally:
            await index.close()

    return asyncio.run(ask())


def wait_for(url: str, keys: list[bytes], expected: dict[str, Any]) -> None:
    deadline = time.monotonic() + WAIT_S
    while (found := holding(url, keys)) != expected:
        assert time.monotonic() < deadline, f"the index says {found}, not {expected}"
        time.sleep(0.02)


def test_a_cache_keeps_its_node_in_the_index_and_leaves_it(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    redis_server.client().flushall()
    tokens = list(range(6 * CHUNK))
    with LMTier.open(config(tmp_path, redis_server.url), kv=SPEC, model_id="fleet") as cache:
        cache.store(tokens, torch.randn(SPEC.shape(len(tokens))))
        cache.flush()
        keys = [bytes(k) for k in cache.keys(tokens)]
        # 6 chunks through a 4-chunk CPU tier: the first 2 on disk only.
        wait_for(redis_server.url, keys, {"node-a": (6, {"disk": 2, "cpu": 4})})
    wait_for(redis_server.url, keys, {})
    with LMTier.open(config(tmp_path, redis_server.url), kv=SPEC, model_id="fleet") as cache:
        # A new process: what its disk holds is in the index before any store.
        wait_for(redis_server.url, keys, {"node-a": (6, {"disk": 6})})


def test_a_redis_down_at_start_is_caught_up_with(tmp_path: Path, redis_server: RedisServer) -> None:
    redis_server.client().flushall()
    dead = f"redis://127.0.0.1:{free_port()}/0"
    tokens = list(range(2 * CHUNK))
    with LMTier.open(config(tmp_path, dead), kv=SPEC, model_id="fleet") as cache:
        cache.store(tokens, torch.randn(SPEC.shape(len(tokens))))
        assert cache.lookup(tokens).num_tokens == 2 * CHUNK, "the cache works without its index"
