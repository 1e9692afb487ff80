"""Disk tier write and cold-read throughput against raw file I/O of the same sizes.

Measures, in one run, on ~2 MiB chunks (256 tokens x 1024 hidden, fp32):
  (a) raw file I/O, the baseline (:mod:`disk_raw`): buffered writes without a sync,
      with an fsync per file and with one syncfs for all; O_DIRECT writes with and
      without fsync (1 and 4 threads); buffered and O_DIRECT cold reads (4 and 16);
  (b) the disk tier writing (put) and cold-reading (get_into) the same chunks,
      buffered and with O_DIRECT, 4 I/O threads: writes by default (no sync) against
      the best raw write, and durable (``fsync``: a group commit per wave) against
      the best raw durable write;
  (c) the tier's read path (a file per thread hop, checked in that thread) against
      the same path through aiofiles (one executor hop per call, checked after);
  (d) the facade, as a user calls it: ``LMTier.store`` + ``flush`` of a 128-chunk
      prompt against the best raw write of the same files, and ``LMTier.load`` of it
      in a new process over the directory, page cache dropped, against the best raw
      cold read of the same files (threads, aligned and already touched buffers);
  (e) start-up: rebuilding the index over 100k chunk files (20k with --quick),
      with warm and, where the page cache can be dropped, cold metadata caches; and
      the index's memory per chunk (tracemalloc around the rebuild).
Reads are cold: every file is synced and dropped from the page cache first. Paired
ratios are medians over repeats of ratios within one repeat (the machine is shared).
Target: the tier's and the facade's best write and read at >= 0.9x the best raw.

Usage: python benchmarks/bench_disk.py [--quick] [--dir DIR] [--contend N]  (last line: JSON)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from statistics import median
from typing import Any

import aiofiles
import disk_raw
import numpy as np
import torch
from bench_common import add_contend_argument, contend, contention_of
from disk_raw import (
    DROP_CACHES,
    READ_MODES,
    WRITE_MODES,
    aligned_buffers,
    drop_page_cache,
    files_under,
    raw_pass,
    raw_write_pass,
    timed,
)

from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.chunks.format import align_up
from lmtier.chunks.keys import ChunkKey
from lmtier.config import CPUTierConfig, DiskTierConfig
from lmtier.testing import make_chunk, random_key
from lmtier_backends.disk.tier import DiskTier

NUM_TOKENS, HIDDEN = 256, 1024  # the payload of make_chunk(num_tokens=256, hidden=1024)
RAW_MODES = (*WRITE_MODES, *READ_MODES)
DURABLE_WRITES = ("write_buffered_fsync", "write_buffered_syncfs")


def make_chunks(count: int) -> list[tuple[ChunkKey, memoryview]]:
    """``count`` valid chunks with distinct keys, each in its own aligned buffer."""
    chunks = []
    for _ in range(count):
        key, data = make_chunk(num_tokens=NUM_TOKENS, hidden=HIDDEN, seed=0)
        chunks.append((key, aligned_copy(data)))
    return chunks


# --- the tier ---------------------------------------------------------------------


class AiofilesDiskTier(DiskTier):
    """The tier with its read path on aiofiles (open, readinto, close: three hops;
    checksums after every read, on the event loop)."""

    async def _read_checked(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        async def one(key: ChunkKey, buf: memoryview) -> int | None:
            async with aiofiles.open(
                self.path_of(key), "rb", buffering=0, executor=self._pool
            ) as f:
                got: int | None = await f.readinto(buf)
                return got

        return list(await asyncio.gather(*(one(k, b) for k, b in zip(keys, buffers, strict=True))))


TIER_WRITES = {  # label: (o_direct, fsync); the last one's files are read back
    "tier_write_buffered_fsync": (False, True),  # durable: one group commit per wave
    "tier_write_direct_fsync": (True, True),
    "tier_write_buffered": (False, False),  # the default
    "tier_write_direct": (True, False),
}
TIER_READS = {  # label: (tier class, o_direct)
    "tier_read_buffered": (DiskTier, False),  # the shipped path: a file per thread hop
    "tier_read_direct": (DiskTier, True),
    "aiofiles_read_buffered": (AiofilesDiskTier, False),  # the alternative not taken
}


async def tier_write(
    workdir: str, chunks: list[tuple[ChunkKey, memoryview]], o_direct: bool, fsync: bool
) -> float:
    """Seconds to put every chunk: puts of 16 chunks issued together, like a
    write-through queue being drained."""
    tier = await DiskTier.open(workdir, 1 << 40, fsync=fsync, o_direct=o_direct, io_threads=4)
    start = time.perf_counter()
    puts = [tier.put(chunks[i : i + 16]) for i in range(0, len(chunks), 16)]
    assert sum(await asyncio.gather(*puts)) == len(chunks)
    seconds = time.perf_counter() - start
    await tier.close()
    return seconds


async def tier_read(
    workdir: str, keys: list[ChunkKey], size: int, cls: type[DiskTier], o_direct: bool
) -> tuple[float, float]:
    """Seconds for one get_into of every chunk (one long prompt's prefix: 128 chunks
    are 32k tokens), from a freshly opened tier: cold, then warm."""
    tier = await cls.open(workdir, 1 << 40, o_direct=o_direct, io_threads=4)
    buffers = aligned_buffers(len(keys), size)
    drop_page_cache(files_under(workdir))
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        assert await tier.get_into(keys, buffers) == [size] * len(keys)
        seconds.append(time.perf_counter() - start)
    await tier.close()
    return seconds[0], seconds[1]


# --- the facade, as a user calls it ---------------------------------------------

FACADE_SPEC = KVSpec(num_layers=4, num_kv_heads=4, head_dim=64)  # 2 MiB per 256 tokens
FACADE_CHUNK = 256


def facade_config(root: str, num_chunks: int) -> LMTierConfig:
    """The user's default cache (CPU tier + disk, default disk settings) over ``root``,
    with host memory for the prompt and its promotion, and no more."""
    slab = align_up(FACADE_SPEC.encoded_chunk_bytes(FACADE_CHUNK))
    return LMTierConfig(
        chunk_size=FACADE_CHUNK,
        cpu=CPUTierConfig(capacity_bytes=num_chunks * slab, staging_bytes=num_chunks * slab),
        disk=DiskTierConfig(path=Path(root)),
    )


def facade_tokens(num_chunks: int) -> np.ndarray[Any, np.dtype[np.int32]]:
    return np.random.default_rng(1).integers(0, 32_000, num_chunks * FACADE_CHUNK, np.int32)


def facade_store(root: str, num_chunks: int) -> tuple[float, float]:
    """Seconds until ``store`` of a prompt's KV returns (what the caller waits for), and
    until its ``flush`` returns too (the disk tier has written it, as its default
    settings promise), in this process."""
    kv = torch.ones(FACADE_SPEC.shape(num_chunks * FACADE_CHUNK))
    tokens = facade_tokens(num_chunks)
    with LMTier.open(facade_config(root, num_chunks), kv=FACADE_SPEC, model_id="bench") as cache:
        start = time.perf_counter()
        assert cache.store(tokens, kv) == num_chunks
        stored = time.perf_counter()
        cache.flush()
        seconds = time.perf_counter() - start
        assert cache.stats()["disk"]["puts"] == num_chunks
    return stored - start, seconds


def in_new_process(cold: Sequence[str], *command: str) -> dict[str, float]:
    """Run ``command`` (python args) in a new process, files ``cold`` dropped from the
    page cache first (a user's process after a restart); the JSON object it prints."""
    drop_page_cache(cold)
    out = subprocess.run([sys.executable, *command], check=True, capture_output=True, text=True)
    return dict(json.loads(out.stdout.splitlines()[-1]))


def facade_child(root: str, num_chunks: int) -> None:
    """In a new process: open, load, check where the tokens came from, print JSON."""
    start = time.perf_counter()
    cache = LMTier.open(facade_config(root, num_chunks), kv=FACADE_SPEC, model_id="bench")
    opened = time.perf_counter()
    tokens = facade_tokens(num_chunks)
    begun = time.perf_counter()
    with cache.load(tokens) as loaded:
        loaded_s = time.perf_counter() - begun
        assert loaded.tokens_by_tier() == {"disk": num_chunks * FACADE_CHUNK}, loaded
    cache.close()
    print(json.dumps({"open_s": opened - start, "load_s": loaded_s}))


def copy_then_write(workdir: str, num_chunks: int, mode: str) -> float:
    """Seconds for the least any store to disk does: copy each chunk's KV out of the
    caller's tensor (torch ``copy_``, into page-aligned buffers already touched) and
    write the buffers to files (4 threads, ``mode``): the floor of ``store()`` +
    ``flush()``, which also checksums each chunk and writes it atomically."""
    kv = torch.ones(FACADE_SPEC.shape(num_chunks * FACADE_CHUNK))
    shape = FACADE_SPEC.shape(FACADE_CHUNK)
    size = int(np.prod(shape)) * 4  # the payload's bytes (float32)
    buffers = aligned_buffers(num_chunks, size)
    places = [
        torch.frombuffer(b, dtype=torch.float32, count=size // 4).view(shape) for b in buffers
    ]
    axis = FACADE_SPEC.token_axis
    start = time.perf_counter()
    for index, place in enumerate(places):
        place.copy_(kv.narrow(axis, index * FACADE_CHUNK, FACADE_CHUNK))
    copied = time.perf_counter() - start
    return copied + raw_write_pass(workdir, [b[:size] for b in buffers], 4, mode)


def facade_paths(root: str, num_chunks: int) -> list[str]:
    """The files of the prompt's chunks, in the prompt's order (no I/O: names only)."""
    cache = LMTier(facade_config(root, num_chunks), FACADE_SPEC, model_id="bench")
    layout = DiskTier(root, 1)
    return [layout.path_of(key) for key in cache.keys(facade_tokens(num_chunks))]


def aligned_copy(data: bytes) -> memoryview:
    view = aligned_buffers(1, len(data))[0][: len(data)]
    view[:] = data
    return view


def settle() -> None:
    """Start a timed write from the same state as every other: nothing dirty. The
    writeback of the write before (256 MiB left dirty: the disk tier does not sync by
    default) slowed whichever write came next; under two busy processes the first
    buffered write of a round took 450-560 ms against 70-220 ms for the same write
    later in the round, so the order decided the ratios. (The page cache is not
    dropped: a server's directories are in it, and after a drop each file created in
    the tier's 256 subdirectories waited for a read of their blocks.)"""
    os.sync()


RAW_COLD_READS = {f"{'direct' if d else 'buffered'}_{t}t": (t, d) for t in (4, 16) for d in (0, 1)}
"""The raw cold reads tried (threads, O_DIRECT); the best by its median is the baseline."""


def measure_facade(workdir: str, num_chunks: int, repeats: int) -> dict[str, Any]:
    """Facade store (+ flush) and cold load in a new process, each round against raw
    I/O of the same bytes in the same round: ratios are medians over rounds of (the
    best raw variant, chosen by its median) / (the facade) within each round."""
    root = os.path.join(workdir, "facade")
    times: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    # Untimed: a process's first store + flush ran 0.5-0.7 s under two busy processes
    # against 0.12-0.33 s for the next ones (threads and code paths started once).
    facade_store(root, num_chunks)
    for _ in range(repeats):
        shutil.rmtree(root, ignore_errors=True)
        settle()
        call_s, store_s = facade_store(root, num_chunks)
        add("store_call", call_s)
        add("store", store_s)
        paths = facade_paths(root, num_chunks)  # in the prompt's order, as a load reads
        views = [aligned_copy(Path(p).read_bytes()) for p in paths]  # O_DIRECT needs it
        for mode in ("write_buffered", "write_direct"):
            target = tempfile.mkdtemp(dir=workdir)
            settle()
            add(f"raw_{mode}", raw_write_pass(target, views, 4, mode))
            shutil.rmtree(target)
            target = tempfile.mkdtemp(dir=workdir)
            settle()
            add(f"floor_copy_{mode}", copy_then_write(target, num_chunks, mode))
            shutil.rmtree(target)
        child = (__file__, "--facade-child", root, str(num_chunks))
        add("load", in_new_process(paths, *child)["load_s"])
        listing = Path(workdir, "paths")
        listing.write_text("\n".join(paths))
        for name, (threads, direct) in RAW_COLD_READS.items():
            raw = (disk_raw.__file__, str(listing), str(threads), str(direct))
            add(f"raw_read_{name}", in_new_process(paths, *raw)["read_s"])
    nbytes = sum(os.path.getsize(p) for p in paths)

    def versus(facade: str, raw_prefix: str) -> tuple[str, float]:
        raw = min((k for k in times if k.startswith(raw_prefix)), key=lambda k: median(times[k]))
        pairs = zip(times[raw], times[facade], strict=True)
        return raw, round(median(r / f for r, f in pairs), 3)

    read_baseline, read_ratio = versus("load", "raw_read")
    write_baseline, write_ratio = versus("store", "raw_write")
    floor_baseline, floor_ratio = versus("store", "floor_copy")
    return {
        "facade_chunks": num_chunks,
        "facade_store_call_ms": round(median(times["store_call"]) * 1e3, 1),
        "facade_store_flush_gbps": gbps(nbytes, median(times["store"])),
        "facade_store_baseline": write_baseline,
        "facade_store_baseline_gbps": gbps(nbytes, median(times[write_baseline])),
        "facade_store_vs_best_raw_write_paired": write_ratio,
        "facade_store_floor": floor_baseline,
        "facade_store_floor_gbps": gbps(nbytes, median(times[floor_baseline])),
        "facade_store_vs_copy_then_write_paired": floor_ratio,
        "facade_load_cold_new_process_gbps": gbps(nbytes, median(times["load"])),
        "facade_load_baseline": read_baseline,
        "facade_load_baseline_gbps": gbps(nbytes, median(times[read_baseline])),
        "facade_load_cold_vs_best_raw_paired": read_ratio,
        "facade_load_rounds_s": [round(x, 4) for x in times["load"]],
        "facade_load_baseline_rounds_s": [round(x, 4) for x in times[read_baseline]],
    }


# --- start-up ---------------------------------------------------------------------


def make_small_files(root: str, count: int) -> None:
    """``count`` files named like chunks (64 bytes each: start-up never opens them)."""
    body = b"x" * 64
    layout = DiskTier(root, 1)  # no I/O: only asked where chunk files go
    for shard in range(256):
        os.makedirs(os.path.join(root, "v1", f"{shard:02x}"), exist_ok=True)
    for _ in range(count):
        path = layout.path_of(random_key())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT)
        os.write(fd, body)
        os.close(fd)


async def open_and_close(root: str) -> int:
    tier = await DiskTier.open(root, 1 << 40)
    count = len(tier)
    await tier.close()
    return count


def measure_startup(workdir: str, count: int) -> dict[str, Any]:
    root = os.path.join(workdir, "startup")
    make_small_files(root, count)
    os.sync()
    warm = statistics.median(timed(lambda: asyncio.run(open_and_close(root))) for _ in range(3))
    cold = None
    if os.access(DROP_CACHES, os.W_OK):  # dentries and inodes too: a first open after boot
        drop_page_cache([], level="3")
        cold = timed(lambda: asyncio.run(open_and_close(root)))

    async def traced() -> tuple[int, int]:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        tier = await DiskTier.open(root, 1 << 40)
        after, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert len(tier) == count
        await tier.close()
        return after - before, peak - before

    retained, peak = asyncio.run(traced())
    shutil.rmtree(root)
    return {
        "startup_files": count,
        "startup_warm_s": round(warm, 3),
        "startup_cold_s": None if cold is None else round(cold, 3),
        "index_bytes_per_chunk": round(retained / count, 1),
        "index_peak_bytes_per_chunk_during_rebuild": round(peak / count, 1),
    }


# --- main -------------------------------------------------------------------------


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer chunks and files (< 60 s)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to put the files")
    parser.add_argument("--facade-child", nargs=2, help=argparse.SUPPRESS)  # DIR CHUNKS
    add_contend_argument(parser)
    args = parser.parse_args()
    if args.facade_child:
        facade_child(args.facade_child[0], int(args.facade_child[1]))
        return
    num_chunks, repeats = (128, 3) if args.quick else (128, 7)
    startup_files = 20_000 if args.quick else 100_000
    workdir = tempfile.mkdtemp(prefix="lmtier-bench-disk-", dir=args.dir)
    try:
        with contend(contention_of(args)):
            results = run_all(workdir, num_chunks, repeats, startup_files)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["quick"] = args.quick
    results["contend"] = contention_of(args)
    for name, value in results.items():
        print(f"{name:>44}: {value}")
    print(json.dumps(results))


def run_all(workdir: str, num_chunks: int, repeats: int, startup_files: int) -> dict[str, Any]:
    chunks = make_chunks(num_chunks)
    views = [view for _, view in chunks]
    chunk_bytes = len(chunks[0][1])
    total = chunk_bytes * num_chunks
    cache_method = drop_page_cache([])

    def fresh_dir() -> str:
        return tempfile.mkdtemp(dir=workdir)

    # Raw and tier passes alternate within each repeat, so that the machine's drift
    # (shared, noisy disks) hits both alike; figures are medians over repeats.
    times: dict[str, list[float]] = {}
    for _ in range(repeats):
        for mode in RAW_MODES:
            for threads in (1, 4) if mode in WRITE_MODES else (4, 16):
                d = fresh_dir()
                times.setdefault(f"raw_{mode}_{threads}t", []).append(
                    raw_pass(d, views, threads, mode)
                )
                shutil.rmtree(d)
        for label, (o_direct, fsync) in TIER_WRITES.items():
            d = fresh_dir()
            times.setdefault(label, []).append(asyncio.run(tier_write(d, chunks, o_direct, fsync)))
            if label != list(TIER_WRITES)[-1]:
                shutil.rmtree(d)
        keys, size = [key for key, _ in chunks], len(chunks[0][1])
        for label, (cls, o_direct) in TIER_READS.items():
            cold, warm = asyncio.run(tier_read(d, keys, size, cls, o_direct))
            times.setdefault(f"{label}_cold", []).append(cold)
            times.setdefault(f"{label}_warm", []).append(warm)
        shutil.rmtree(d)
    gb = {f"{k}_gbps": gbps(total, statistics.median(v)) for k, v in times.items()}

    def best(prefix: str, must: str = "") -> float:
        return max(v for k, v in gb.items() if k.startswith(prefix) and must in k)

    def paired(tier_keys: list[str], raw_keys: list[str]) -> float:
        """Median over repeats of (best tier / best raw) within the same repeat."""
        ratios = [
            min(times[k][r] for k in raw_keys) / min(times[k][r] for k in tier_keys)
            for r in range(repeats)
        ]
        return round(statistics.median(ratios), 3)

    tier_writes = ["tier_write_buffered", "tier_write_direct"]  # the default: no sync
    tier_durable = ["tier_write_buffered_fsync", "tier_write_direct_fsync"]
    tier_reads = ["tier_read_buffered_cold", "tier_read_direct_cold"]
    raw_writes = [k for k in times if k.startswith("raw_write")]
    raw_durable = [k for k in raw_writes if "sync" in k]
    raw_reads = [k for k in times if k.startswith("raw_read")]
    tier_write_gbps = max(gb[f"{k}_gbps"] for k in tier_writes)
    tier_durable_gbps = max(gb[f"{k}_gbps"] for k in tier_durable)
    tier_read_gbps = max(gb[f"{k}_gbps"] for k in tier_reads)
    results: dict[str, Any] = {
        "benchmark": "disk",
        "chunk_bytes": chunk_bytes,
        "chunks_per_pass": num_chunks,
        "repeats": repeats,
        "cold_read_method": cache_method,
        **gb,
        "best_raw_write_gbps": best("raw_write"),
        "best_raw_durable_write_gbps": best("raw_write", "sync"),
        "best_raw_read_gbps": best("raw_read"),
        "tier_write_gbps": tier_write_gbps,
        "tier_durable_write_gbps": tier_durable_gbps,
        "tier_read_gbps": tier_read_gbps,
        "tier_write_vs_best_raw": round(tier_write_gbps / best("raw_write"), 3),
        "tier_durable_write_vs_best_raw_durable": round(
            tier_durable_gbps / best("raw_write", "sync"), 3
        ),
        "tier_read_vs_best_raw": round(tier_read_gbps / best("raw_read"), 3),
        "tier_write_vs_best_raw_paired": paired(tier_writes, raw_writes),
        "tier_durable_write_vs_best_raw_durable_paired": paired(tier_durable, raw_durable),
        "tier_read_vs_best_raw_paired": paired(tier_reads, raw_reads),
        "threadpool_vs_aiofiles_cold": round(
            gb["tier_read_buffered_cold_gbps"] / gb["aiofiles_read_buffered_cold_gbps"], 3
        ),
        "threadpool_vs_aiofiles_warm": round(
            gb["tier_read_buffered_warm_gbps"] / gb["aiofiles_read_buffered_warm_gbps"], 3
        ),
        "target_vs_best_raw": 0.9,
    }
    results.update(measure_facade(workdir, num_chunks, repeats))
    results.update(measure_startup(workdir, startup_files))
    return results


if __name__ == "__main__":
    main()
