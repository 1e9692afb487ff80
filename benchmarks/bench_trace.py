"""A conversation workload replayed through ``LMTier``: token hit ratio against an LRU
of the same capacity and the ideal (infinite) cache, request rate, disk write drops.

The workload is what a chat service sees: many conversations, interleaved in arrival
order, each request a growing history (a system prompt shared by many conversations,
then user and assistant turns) whose cached prefix is loaded and whose full chunks
are stored. The cache (CPU tier + disk tier, 512-token chunks of 32 KiB: one layer,
one KV head, head_dim 8, float32) holds 5% of the working set on disk, so eviction
decides the hit ratio; disk writes are background writes that drop (and count) when
the tier cannot keep up, which shows as hits lost against the LRU figure.

Per request, as an engine does: its tokens hashed once (``keys``), ``load_keys`` of the
chunks before the last token (which is always recomputed), then ``store_keys`` of the
full chunks not cached (the KV is one preallocated tensor: the benchmark measures the
cache, not a random generator).

Baselines, from the same trace and chunking: the ideal hit ratio (every chunk ever
stored stays) and an LRU simulation with the disk tier's capacity in chunks (a hit
refreshes a chunk; stored chunks are the most recent); and the raw write rate of this
machine's disk for such files (plain os calls on 4 threads, each new file evicting
an old one, as a full cache does), measured in the same run, beside the burner if
there is one. One replay runs unpaced (as fast as the facade goes: its requests/s);
the others are paced the way an engine's compute paces a real cache, at a fraction
(``--load``) of the lower of two ceilings: the request rate whose stores the raw disk
could take (raw file writes/s over the LRU's writes per request) and the unpaced
replay's rate (the replay's own work, hashing, loads and stores, shares the two cores
with the disk tier's threads). Target, at the first load: token hit ratio >= 0.98x
the LRU figure, 0 disk queue drops, with ``--contend 2`` (two processes spinning on
the two cores, as an inference engine beside the cache does).

Workloads: a seeded synthetic one (default), or ``--trace FILE``: ShareGPT-style JSON
(a list of {"conversations": [{"from": "human"|"gpt"|"system", "value": text}, ...]}),
tokenised deterministically without a tokenizer (words and punctuation, long words
cut every 4 characters, each piece's CRC32 modulo a 32k vocabulary).

``--capacities 0.01,0.05,...`` adds hit ratio against capacity: the same trace replayed
unpaced through the CPU tier alone (disk off) at each capacity, a fraction of the working
set, against an LRU of as many chunks and the ideal; the JSON gets a ``capacities`` list.

Usage: python benchmarks/bench_trace.py [--quick] [--contend N] [--trace FILE] [--load 0.25,0.5]
       [--requests N] [--fsync true] [--capacities 0.01,0.05]   (last line: one JSON object)
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import tempfile
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import torch
import xxhash
from bench_common import add_contend_argument, contend, contention_of

from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.config import CPUTierConfig, DiskTierConfig

Tokens: TypeAlias = "np.ndarray[Any, np.dtype[np.int32]]"
CHUNK = 512
SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8)  # 2 * 512 * 8 * 4 B = 32 KiB
VOCAB = 32_000
MAX_CONTEXT = 32_768
"""Tokens a conversation may reach (the model's context); it ends there."""
CACHE_FRACTION = 0.05
"""Disk capacity as a fraction of the working set (distinct chunks of the trace)."""
CPU_FRACTION = 0.01
"""CPU tier capacity as a fraction of the working set."""


@dataclass(slots=True)
class Workload:
    """Conversations (token ids, each request a prefix of one) and the requests in
    arrival order: (conversation index, prompt length)."""

    conversations: list[Tokens]
    requests: list[tuple[int, int]]


# --- workloads --------------------------------------------------------------------


def interleave(turn_ends: list[list[int]], rng: np.random.Generator) -> list[tuple[int, int]]:
    """Requests in arrival order: conversations start as a Poisson process (one per
    time unit), and each next turn comes an exponential think time (mean 200 units)
    after the previous one, so about a thousand conversations are live at once."""
    events: list[tuple[float, int, int]] = []
    start = 0.0
    for conv, ends in enumerate(turn_ends):
        start += rng.exponential(1.0)
        at = start
        for turn, _ in enumerate(ends):
            events.append((at, conv, turn))
            at += rng.exponential(200.0)
    events.sort()
    return [(conv, turn_ends[conv][turn]) for _, conv, turn in events]


def synthetic(num_requests: int, seed: int) -> Workload:
    """Seeded chats: 24 system prompts of 300-3500 tokens chosen with Zipf popularity,
    1-24 turns (mean ~7) of user messages (median 150 tokens, a long tail of pasted
    text) and replies (median 400), until the context is full."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, int(rng.integers(300, 3500)), np.int32) for _ in range(24)]
    popularity = 1.0 / np.arange(1, len(prompts) + 1) ** 1.0
    popularity /= popularity.sum()
    conversations: list[Tokens] = []
    turn_ends: list[list[int]] = []
    planned = 0
    while planned < num_requests:
        parts = [prompts[rng.choice(len(prompts), p=popularity)]]
        length, ends = len(parts[0]), []
        for _ in range(min(24, 1 + int(rng.geometric(0.15)))):
            user = int(min(4000, rng.lognormal(np.log(150), 1.0)))
            reply = int(min(1500, rng.lognormal(np.log(400), 0.6)))
            if length + user + reply > MAX_CONTEXT:
                break
            parts.append(rng.integers(0, VOCAB, user, np.int32))
            ends.append(length + user)
            parts.append(rng.integers(0, VOCAB, reply, np.int32))
            length += user + reply
        if ends:
            conversations.append(np.concatenate(parts))
            turn_ends.append(ends)
            planned += len(ends)
    requests = interleave(turn_ends, rng)[:num_requests]
    return Workload(conversations, requests)


_PIECES = re.compile(r"\w{1,4}|[^\w\s]")


def tokenize(text: str) -> list[int]:
    """Deterministic stand-in for a tokenizer: word pieces of up to 4 characters and
    punctuation (about as many tokens as BPE makes), each CRC32 modulo the vocabulary."""
    return [zlib.crc32(piece.encode()) % VOCAB for piece in _PIECES.findall(text)]


def sharegpt(path: Path, num_requests: int, seed: int) -> Workload:
    """Conversations of a ShareGPT-style JSON file; a request at each human turn."""
    conversations: list[Tokens] = []
    turn_ends: list[list[int]] = []
    planned = 0
    for entry in json.loads(path.read_text()):
        tokens: list[int] = []
        ends: list[int] = []
        for turn in entry.get("conversations", ()):
            tokens += tokenize(str(turn.get("value", "")))
            if len(tokens) > MAX_CONTEXT:
                break
            if turn.get("from") in ("human", "user"):
                ends.append(len(tokens))
        if ends and ends[0] > 0:
            conversations.append(np.asarray(tokens[: ends[-1]], np.int32))
            turn_ends.append(ends)
            planned += len(ends)
        if planned >= num_requests:
            break
    requests = interleave(turn_ends, np.random.default_rng(seed))[:num_requests]
    return Workload(conversations, requests)


# --- the baselines: ideal and LRU, in chunks ------------------------------------


def chunk_ids(tokens: Tokens) -> list[bytes]:
    """Chained ids of every full chunk (equal prefixes, equal ids; like the cache's keys)."""
    ids, parent = [], b""
    for start in range(0, len(tokens) - CHUNK + 1, CHUNK):
        parent = xxhash.xxh3_128_digest(parent + tokens[start : start + CHUNK].tobytes())
        ids.append(parent)
    return ids


@dataclass(frozen=True, slots=True)
class Simulated:
    """What a cache of chunks would do with the trace under LRU."""

    hit_ratio: float
    """Tokens loaded from the cache / tokens in the requests."""
    chunks: int
    """Distinct chunks held at the end (with no capacity: the working set)."""
    writes: int
    """Chunks stored (each a disk write in the replay)."""


def simulate(workload: Workload, capacity: int | None) -> Simulated:
    """A cache of ``capacity`` chunks under LRU (None: infinite), driven as the replay
    drives LMTier: the leading cached chunks are hits (refreshed), the rest stored."""
    ids = [chunk_ids(conv) for conv in workload.conversations]
    cache: OrderedDict[bytes, None] = OrderedDict()
    hit_tokens = total_tokens = writes = 0
    for conv, length in workload.requests:
        keys = ids[conv][: length // CHUNK]
        loadable = (length - 1) // CHUNK
        hits = 0
        while hits < loadable and keys[hits] in cache:
            cache.move_to_end(keys[hits])
            hits += 1
        for key in keys[hits:]:
            cache[key] = None
            cache.move_to_end(key)
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
        hit_tokens += hits * CHUNK
        total_tokens += length
        writes += len(keys) - hits
    return Simulated(hit_tokens / total_tokens, len(cache), writes)


# --- the replay -------------------------------------------------------------------


def raw_write_rate(workdir: str, file_bytes: int, capacity: int, seconds: float) -> float:
    """Files per second this machine writes as the disk tier must, measured with plain
    os calls on 4 threads for about ``seconds``: a new file of ``file_bytes`` each (a
    temp file renamed into one of 256 directories), the one written ``capacity`` files
    earlier unlinked (a full cache evicts one chunk per chunk it stores), no sync."""
    root = tempfile.mkdtemp(prefix="raw-", dir=workdir)
    for shard in range(256):
        os.mkdir(f"{root}/{shard:02x}")
    data = memoryview(bytes(file_bytes))
    claim = itertools.count().__next__
    deadline = time.perf_counter() + seconds

    def writer() -> None:
        while time.perf_counter() < deadline:
            n = claim()
            final = f"{root}/{n % 256:02x}/{n}"
            fd = os.open(final + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, data)
            os.close(fd)
            os.replace(final + ".tmp", final)
            if n >= capacity:
                with contextlib.suppress(FileNotFoundError):  # not landed yet: rare
                    os.unlink(f"{root}/{(n - capacity) % 256:02x}/{n - capacity}")

    started = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: writer(), range(4)))
    rate = claim() / (time.perf_counter() - started)
    shutil.rmtree(root)
    return rate


def cache_config(
    workdir: str, disk_chunks: int, cpu_chunks: int, fsync: str | None
) -> LMTierConfig:
    """CPU tier and disk tier of these capacities (in chunks), other settings default."""
    file_bytes = SPEC.encoded_chunk_bytes(CHUNK)
    disk = DiskTierConfig(path=Path(workdir), capacity_bytes=disk_chunks * file_bytes)
    if fsync is not None:
        disk = disk.replace(fsync=fsync)
    cpu = CPUTierConfig(capacity_bytes=cpu_chunks * file_bytes)
    return LMTierConfig(chunk_size=CHUNK, cpu=cpu, disk=disk)


def replay(workload: Workload, config: LMTierConfig, rate: float | None) -> dict[str, Any]:
    """Drive the facade with the workload, ``rate`` requests a second (None: as fast as
    it goes); hit ratio, rate and the tiers' counters."""
    longest = max(len(conv) for conv in workload.conversations)
    kv = torch.ones(SPEC.shape(longest), dtype=torch.float32)  # one buffer, reused
    hit_tokens = total_tokens = 0
    with LMTier.open(config, kv=SPEC, model_id="bench-trace") as cache:
        started = time.perf_counter()
        for index, (conv, length) in enumerate(workload.requests):
            if rate is not None and (ahead := started + index / rate - time.perf_counter()) > 0:
                time.sleep(ahead)  # the engine computing: the cache's threads get the CPU
            tokens = workload.conversations[conv][:length]
            keys = cache.keys(tokens)
            with cache.load_keys(keys[: (length - 1) // CHUNK]) as loaded:
                hit_tokens += loaded.num_tokens
            if keys:
                cache.store_keys(keys, kv.narrow(SPEC.token_axis, 0, len(keys) * CHUNK))
            total_tokens += length
        seconds = time.perf_counter() - started
        cache.flush()
        stats = cache.stats()
    disk = _counters(stats.get("disk", {}))
    return {
        "token_hit_ratio": round(hit_tokens / total_tokens, 4),
        "requests_per_s": round(len(workload.requests) / seconds, 1),
        "chunk_writes_per_s": round(int(disk["puts"]) / seconds, 1),
        "replay_s": round(seconds, 2),
        "disk": disk,
        "cpu": _counters(stats["cpu"]),
    }


def _counters(entry: dict[str, object]) -> dict[str, int]:
    names = ("hits", "misses", "puts", "evictions", "queue_drops", "errors", "corrupt")
    return {name: int(entry.get(name) or 0) for name in names}  # type: ignore[call-overload]


def capacity_sweep(
    workload: Workload, working_set: int, fractions: list[float]
) -> list[dict[str, Any]]:
    """The trace replayed unpaced through the CPU tier alone at each capacity (a
    fraction of the working set): token hit ratio against an LRU of as many chunks."""
    file_bytes = SPEC.encoded_chunk_bytes(CHUNK)
    rows = []
    for fraction in fractions:
        chunks = max(1, round(working_set * fraction))
        lru = simulate(workload, chunks)
        cpu = CPUTierConfig(capacity_bytes=chunks * file_bytes)
        config = LMTierConfig(chunk_size=CHUNK, cpu=cpu, disk=DiskTierConfig(enabled=False))
        run = replay(workload, config, None)
        rows.append(
            {
                "capacity_fraction": fraction,
                "capacity_chunks": chunks,
                "capacity_mib": round(chunks * file_bytes / 2**20, 1),
                "token_hit_ratio": run["token_hit_ratio"],
                "lru_hit_ratio": round(lru.hit_ratio, 4),
                "hit_vs_lru": ratio(run["token_hit_ratio"], lru.hit_ratio),
                "requests_per_s": run["requests_per_s"],
                "evictions": run["cpu"]["evictions"],
            }
        )
    return rows


def ratio(measured: float, baseline: float) -> float | None:
    return round(measured / baseline, 3) if baseline else None


# --- main -------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3000 requests (~1 minute)")
    parser.add_argument("--requests", type=int, help="requests to replay (default 12000)")
    parser.add_argument("--trace", type=Path, help="a ShareGPT-style JSON file to replay")
    add_contend_argument(parser)
    parser.add_argument(
        "--load",
        default="0.25,0.5",
        help="paced replays, comma-separated: at this fraction of the lower ceiling of the "
        "raw disk's and the unpaced replay's request rates; the first is the target row",
    )
    parser.add_argument("--fsync", help="disk.fsync for the replays (default: the config's)")
    parser.add_argument(
        "--capacities",
        help="also replay unpaced through the CPU tier alone (disk off) at these capacities, "
        "comma-separated fractions of the working set (e.g. 0.01,0.02,0.05,0.1,0.2)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the disk tier goes")
    args = parser.parse_args(argv)
    num_requests = args.requests or (3000 if args.quick else 12_000)
    if args.trace is not None:
        workload = sharegpt(args.trace, num_requests, args.seed)
    else:
        workload = synthetic(num_requests, args.seed)
    ideal = simulate(workload, None)
    disk_chunks = max(1, round(ideal.chunks * CACHE_FRACTION))
    cpu_chunks = max(1, round(ideal.chunks * CPU_FRACTION))
    lru = simulate(workload, disk_chunks)
    file_bytes = SPEC.encoded_chunk_bytes(CHUNK)
    workdir = tempfile.mkdtemp(prefix="lmtier-bench-trace-", dir=args.dir)
    loads = [float(x) for x in args.load.split(",")]
    try:
        with contend(contention_of(args)):
            raw_rate = raw_write_rate(workdir, file_bytes, disk_chunks, 1.5 if args.quick else 3)
            per_request = lru.writes / len(workload.requests)
            runs: dict[str, dict[str, Any]] = {}
            ceiling = raw_rate / per_request
            for name, load in [("unpaced", None), *((f"load_{x:g}", x) for x in loads)]:
                where = tempfile.mkdtemp(dir=workdir)
                config = cache_config(where, disk_chunks, cpu_chunks, args.fsync)
                runs[name] = replay(workload, config, None if load is None else load * ceiling)
                runs[name]["hit_vs_lru"] = round(runs[name]["token_hit_ratio"] / lru.hit_ratio, 3)
                ceiling = min(ceiling, runs["unpaced"]["requests_per_s"])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    target = runs[f"load_{loads[0]:g}"]
    results: dict[str, Any] = {
        "benchmark": "trace",
        "workload": str(args.trace) if args.trace else f"synthetic(seed={args.seed})",
        "requests": len(workload.requests),
        "conversations": len({conv for conv, _ in workload.requests}),
        "working_set_chunks": ideal.chunks,
        "chunk_tokens": CHUNK,
        "chunk_file_bytes": file_bytes,
        "disk_capacity_chunks": disk_chunks,
        "cpu_capacity_chunks": cpu_chunks,
        "contend": contention_of(args),
        "fsync": args.fsync or "default",
        "raw_file_writes_per_s": round(raw_rate, 1),
        "lru_writes_per_request": round(per_request, 2),
        "raw_requests_per_s": round(raw_rate / per_request, 1),
        "ideal_hit_ratio": round(ideal.hit_ratio, 4),
        "lru_hit_ratio": round(lru.hit_ratio, 4),
        "target_load": loads[0],
        "token_hit_ratio": target["token_hit_ratio"],
        "hit_vs_lru": target["hit_vs_lru"],
        "disk_queue_drops": target["disk"]["queue_drops"],
        "disk_errors": target["disk"]["errors"],
        "requests_per_s": target["requests_per_s"],
        "unpaced_requests_per_s": runs["unpaced"]["requests_per_s"],
        "runs": runs,
        "target_hit_vs_lru": 0.98,
        "quick": args.quick,
    }
    for name, value in results.items():
        print(f"{name:>26}: {value}")
    if args.capacities:
        fractions = [float(x) for x in args.capacities.split(",")]
        with contend(contention_of(args)):
            results["capacities"] = capacity_sweep(workload, ideal.chunks, fractions)
        print(
            f"{'CPU tier capacity':>26}  hit ratio     LRU  vs LRU  (ideal {ideal.hit_ratio:.4f})"
        )
        for row in results["capacities"]:
            label = f"{row['capacity_fraction']:g} ({row['capacity_mib']} MiB)"
            print(
                f"{label:>26}  {row['token_hit_ratio']:>9}  {row['lru_hit_ratio']:>6}  "
                f"{row['hit_vs_lru']!s:>6}"
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
