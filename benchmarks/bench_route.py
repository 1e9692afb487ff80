"""KV-aware routing over simulated nodes: token hit ratio by policy, the router's
overhead, the fleet index's query time and its lag behind the tiers, in one run.

Four nodes, each a real embedded ``LMTier`` (its CPU tier at ``--capacity`` of the
workload's distinct chunks, one shared Redis tier, and ``fleet.enabled``: each
node's feeder keeps the fleet index in that same redis-server, started here) replay
a multi-turn workload in arrival order. Per request, as ``lmtier route`` does, the
router computes the prompt's keys, asks the index, and picks a node with the
router's own policy code (:mod:`lmtier_apps.route.policy`, the router's ``Recent``
record included); the node then looks up the prompt (every token but the last can
be served) and stores the chunks it computed. A node's load is the number of the
last ``WINDOW`` requests it was given (requests still running, in a replay that has
no clock), which is what keeps ``kv-aware`` from sending everything to one node.

Rows:
  * ``hit_ratio``: tokens served from the chosen node's memory (its CPU tier) over
    prompt tokens, for ``kv-aware``, ``round-robin``, ``least-loaded``, and one node
    holding everything (one node with the four nodes' memory together); also
    ``total_hit_ratio``, memory and the shared Redis. Targets: kv-aware >= 0.9x the
    one-node figure and >= 2x round-robin.
  * ``overhead_ms``: the router's work per request beside the index query (keys of
    the prompt, the choice, its record), p50/p99, over the same prompts in a pass of
    their own (no cache at work in the process, as in ``lmtier route``'s); target
    p99 <= 2 ms.
  * ``index_query_ms``: one query of 128 keys that a node holds, p50/p99 (one round
    trip, one script).
  * ``event_lag_ms``: from a store's return to its chunks in the index, p50/p99
    (every ``LAG_EVERY``-th request of the kv-aware replay, polled every 0.5 ms).

Workloads: ``--trace FILE`` (default ``../shared/traces/mooncake-fast25-synthetic.jsonl``:
Mooncake FAST'25's synthetic trace, 512-token blocks given as hash ids; each id is
mapped to a fixed, seeded block of token ids, so equal ids are equal prefixes), or
``--synthetic``: seeded conversations, each turn its history plus a new message.

Usage: python benchmarks/bench_route.py [--quick] [--trace FILE | --synthetic]
       [--capacity 0.1] [--requests N]   (last line: one JSON object)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_redis import start_server

from lmtier import KVSpec, LMTier
from lmtier.chunks.keys import ChunkKey
from lmtier.config import LMTierConfig
from lmtier_apps.route.policy import (
    LOAD_TOKENS,
    Candidate,
    Holding,
    Recent,
    Turns,
    choose,
    with_recent,
)
from lmtier_backends.fleet.index import FleetIndex, prefixes

NODES = 4
BLOCK = 512
SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float16")
WINDOW = 8
"""Requests of the recent past that count as running (each node's load)."""
LAG_EVERY = 20
QUERY_KEYS = 128
DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "shared/traces/mooncake-fast25-synthetic.jsonl"
)
VOCAB = 32_000


def block_tokens(block_id: int) -> list[int]:
    """The fixed token ids of trace block ``block_id``."""
    rng = np.random.default_rng(block_id + 1)
    return rng.integers(3, VOCAB, BLOCK).tolist()  # type: ignore[no-any-return]


def trace_prompts(path: Path, limit: int) -> Iterator[list[int]]:
    """The trace's prompts as token ids (``input_length`` tokens of its blocks)."""
    blocks: dict[int, list[int]] = {}
    with path.open() as lines:
        for count, line in enumerate(lines):
            if count >= limit:
                return
            row = json.loads(line)
            tokens: list[int] = []
            for block in row["hash_ids"]:
                if block not in blocks:
                    blocks[block] = block_tokens(block)
                tokens += blocks[block]
            yield tokens[: max(1, min(len(tokens), int(row["input_length"])))]


def synthetic_prompts(limit: int, seed: int = 0) -> Iterator[list[int]]:
    """Conversations over a few system prompts; each request one more turn of one."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, VOCAB) for _ in range(2 * BLOCK)] for _ in range(4)]
    talks: list[list[int]] = []
    for _ in range(limit):
        if not talks or rng.random() < 0.25:
            talks.append(list(rng.choice(systems)))
        talk = rng.choice(talks[-40:])
        talk += [rng.randrange(3, VOCAB) for _ in range(rng.randrange(200, 900))]
        yield list(talk)


def distinct_chunks(prompts: list[list[int]]) -> int:
    seen: set[tuple[int, ...]] = set()
    for tokens in prompts:
        for end in range(BLOCK, len(tokens) + 1, BLOCK):
            seen.add(tuple(tokens[end - BLOCK : end]))  # chunk content stands in for its chain
    return len(seen)


def node_config(workdir: Path, name: str, port: int, slots: int) -> LMTierConfig:
    slab = SPEC.encoded_chunk_bytes(BLOCK)
    return LMTierConfig(
        chunk_size=BLOCK,
        cpu={"capacity_bytes": max(1, slots) * slab, "staging_bytes": 64 * slab},
        disk={"enabled": False},
        redis={"url": f"redis://127.0.0.1:{port}/0"},
        fleet={"enabled": True, "node_id": name, "interval_s": 0.005},
    )


class Replay:
    """One replay of the workload through ``nodes`` with one policy."""

    def __init__(
        self, nodes: dict[str, LMTier], index: FleetIndex, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.nodes = nodes
        self.index = index
        self.loop = loop
        self.recent = Recent()
        self.turns = Turns()
        self.running: deque[str] = deque(maxlen=WINDOW)
        self.kv = torch.zeros(SPEC.shape(64 * BLOCK * 2), dtype=torch.float16)
        self.load_tokens = LOAD_TOKENS
        self.lag_s: list[float] = []

    def run(self, prompts: list[list[int]], policy: str, *, lag: bool = False) -> dict[str, Any]:
        memory = total = tokens = 0
        placed: dict[str, int] = dict.fromkeys(self.nodes, 0)
        for count, prompt in enumerate(prompts):
            name = self.route(prompt, policy) if len(self.nodes) > 1 else next(iter(self.nodes))
            placed[name] += 1
            cache = self.nodes[name]
            found = cache.lookup(prompt[:-1])
            by_tier = found.tokens_by_tier(BLOCK)
            memory += by_tier.get("cpu", 0)
            total += found.num_tokens
            tokens += len(prompt)
            full = len(prompt) // BLOCK * BLOCK
            if full:
                kv = self._kv(full)
                stored_at = time.perf_counter()
                cache.store(prompt[:full], kv)
                if lag and count % LAG_EVERY == 0:
                    self._lag(cache.keys(prompt[:full])[-1:], name, stored_at)
        return {
            "hit_ratio": round(memory / tokens, 4),
            "total_hit_ratio": round(total / tokens, 4),
            "max_node_share": round(max(placed.values()) / max(1, len(prompts)), 3),
        }

    def _kv(self, num_tokens: int) -> torch.Tensor:
        if SPEC.shape(num_tokens)[2] > self.kv.shape[2]:
            self.kv = torch.zeros(SPEC.shape(num_tokens), dtype=torch.float16)
        return self.kv[:, :, :num_tokens]

    def route(self, prompt: list[int], policy: str) -> str:
        any_cache = next(iter(self.nodes.values()))
        keys = any_cache.keys(prompt[: 256 * BLOCK])
        found: dict[str, Holding] = {}
        shared = Holding()
        if policy == "kv-aware" and keys:
            live, owners = self.loop.run_until_complete(self.index.query(keys))
            found, shared = prefixes(live, owners)
        candidates = [
            Candidate(
                name,
                sum(1 for r in self.running if r == name),
                holding=with_recent(found.get(name, shared), self.recent.leading(keys, name)),
            )
            for name in self.nodes
        ]
        choice = choose(
            policy, candidates, self.turns, chunk_size=BLOCK, load_tokens=self.load_tokens
        )
        assert choice is not None
        self.recent.remember(keys, choice.name)
        self.running.append(choice.name)
        return choice.name

    def _lag(self, keys: list[ChunkKey], name: str, since: float) -> None:
        deadline = since + 5.0
        while time.perf_counter() < deadline:
            _, owners = self.loop.run_until_complete(self.index.query(keys))
            if owners and owners[0].get(name):
                self.lag_s.append(time.perf_counter() - since)
                return
            time.sleep(0.0005)


def percentile_ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 3)


def query_times(
    index: FleetIndex, loop: asyncio.AbstractEventLoop, keys: list[ChunkKey], repeats: int
) -> list[float]:
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        loop.run_until_complete(index.query(keys))
        out.append(time.perf_counter() - started)
    return out


def query_row(cache: LMTier, index: FleetIndex, loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
    """Queries of :data:`QUERY_KEYS` keys that node-0 holds (a prompt of as many
    chunks stored there first, and waited for in the index)."""
    tokens = [VOCAB - 1 - (i % 1000) for i in range(QUERY_KEYS * BLOCK)]
    cache.store(tokens, torch.zeros(SPEC.shape(len(tokens)), dtype=torch.float16))
    keys = cache.keys(tokens)
    deadline = time.perf_counter() + 30
    while len(loop.run_until_complete(index.query(keys))[1]) < QUERY_KEYS:
        assert time.perf_counter() < deadline, "the index never showed the stored prompt"
        time.sleep(0.005)
    times = query_times(index, loop, keys, 300)
    return {"keys": len(keys), "p50": percentile_ms(times, 0.5), "p99": percentile_ms(times, 0.99)}


def overhead_pass(prompts: list[list[int]], slots: int) -> list[float]:
    """The router's own work per request (keys, choice, record; no index query), in a
    process with no cache at work: as in ``lmtier route``'s process."""
    config = LMTierConfig(chunk_size=BLOCK, disk={"enabled": False})
    hasher = LMTier(config, SPEC, model_id="bench-route")  # never started: keys only
    recent, turns = Recent(), Turns()
    names = [f"node-{i}" for i in range(NODES)]
    times = []
    for prompt in prompts:
        started = time.perf_counter()
        keys = hasher.keys(prompt[: 256 * BLOCK])
        candidates = [
            Candidate(name, 0, holding=with_recent(Holding(), recent.leading(keys, name)))
            for name in names
        ]
        choice = choose("kv-aware", candidates, turns, chunk_size=BLOCK)
        assert choice is not None
        recent.remember(keys, choice.name)
        times.append(time.perf_counter() - started)
    return times


def replay(
    workdir: Path,
    port: int,
    prompts: list[list[int]],
    slots: int,
    policy: str,
    *,
    nodes: int,
    lag: bool,
    load_tokens: int = LOAD_TOKENS,
) -> tuple[dict[str, Any], Replay]:
    """One policy's replay on fresh nodes (an empty Redis: nothing carries over)."""
    import redis  # noqa: PLC0415 - the bench's own client, to empty the server

    redis.Redis(port=port).flushall()
    loop = asyncio.new_event_loop()
    index = FleetIndex(f"redis://127.0.0.1:{port}/0")
    with ExitStack() as stack:
        caches = {}
        for i in range(nodes):
            name = f"node-{i}"
            config = node_config(workdir, name, port, slots)
            caches[name] = stack.enter_context(LMTier.open(config, kv=SPEC, model_id="bench-route"))
        run = Replay(caches, index, loop)
        run.load_tokens = load_tokens
        result = run.run(prompts, policy, lag=lag)
        if lag:
            result["index_query_ms"] = query_row(caches["node-0"], index, loop)
    loop.run_until_complete(index.close())
    loop.close()
    return result, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first 600 requests (CI)")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--synthetic", action="store_true", help="seeded conversations instead")
    parser.add_argument(
        "--capacity",
        type=float,
        default=0.1,
        help="each node's memory, a fraction of the distinct chunks",
    )
    parser.add_argument("--requests", type=int, default=0, help="requests to replay (0: all)")
    parser.add_argument(
        "--load-tokens", type=int, default=LOAD_TOKENS, help="the router's --load-tokens"
    )
    args = parser.parse_args()
    limit = args.requests or (600 if args.quick else 10**9)
    if args.synthetic:
        prompts, workload = list(synthetic_prompts(min(limit, 3000))), "synthetic"
    else:
        if not args.trace.is_file():
            sys.exit(f"no trace at {args.trace}: give --trace FILE or --synthetic")
        prompts, workload = list(trace_prompts(args.trace, limit)), args.trace.name
    distinct = distinct_chunks(prompts)
    slots = max(1, int(args.capacity * distinct))
    workdir = Path(tempfile.mkdtemp(prefix="bench-route-"))
    server, port = start_server(str(workdir))
    started = time.perf_counter()
    rows: dict[str, Any] = {}
    try:
        for policy in ("kv-aware", "round-robin", "least-loaded"):
            rows[policy], run = replay(
                workdir, port, prompts, slots, policy, nodes=NODES,
                lag=policy == "kv-aware", load_tokens=args.load_tokens,
            )  # fmt: skip
            if policy == "kv-aware":
                lag = run.lag_s
        rows["one-node"], _ = replay(
            workdir, port, prompts, NODES * slots, "kv-aware", nodes=1, lag=False
        )
        overhead = overhead_pass(prompts, slots)
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    kv, rr, one = (rows[name]["hit_ratio"] for name in ("kv-aware", "round-robin", "one-node"))
    result = {
        "benchmark": "route",
        "workload": workload,
        "requests": len(prompts),
        "distinct_chunks": distinct,
        "nodes": NODES,
        "node_capacity": args.capacity,
        "load_tokens": args.load_tokens,
        "policies": rows,
        "kv_vs_one_node": round(kv / one, 3) if one else None,
        "kv_vs_round_robin": round(kv / rr, 2) if rr else None,
        "overhead_ms": {"p50": percentile_ms(overhead, 0.5), "p99": percentile_ms(overhead, 0.99)},
        "index_query_ms": rows["kv-aware"].pop("index_query_ms"),
        "event_lag_ms": {
            "samples": len(lag),
            "p50": percentile_ms(lag, 0.5),
            "p99": percentile_ms(lag, 0.99),
        },
        "targets": {
            "kv_vs_one_node": ">= 0.9",
            "kv_vs_round_robin": ">= 2",
            "overhead_p99_ms": "<= 2",
        },
        "quick": args.quick,
        "seconds": round(time.perf_counter() - started, 1),
        "python": sys.version.split()[0],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
