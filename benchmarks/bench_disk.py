"""Disk tier write and cold-read throughput against raw file I/O of the same sizes.

Measures, in one run, on ~2 MiB chunks (256 tokens x 1024 hidden, fp32):
  (a) raw file I/O, the baseline: buffered write+fsync, O_DIRECT write (with and
      without fdatasync), buffered cold read, O_DIRECT read; 1 and 4 threads each;
  (b) the disk tier (fsync on, the default) writing and cold-reading the same
      chunks through put / get_into, buffered and with O_DIRECT, 4 I/O threads;
  (c) the tier's read path on a plain thread pool (one hop per file: what it ships)
      against the same path through aiofiles (one executor hop per call);
  (d) start-up: rebuilding the index over 100k chunk files (20k with --quick),
      with warm and, where the page cache can be dropped, cold metadata caches; and
      the index's memory per chunk (tracemalloc around the rebuild).
Reads are cold: after writing, every file is fsynced and dropped from the page cache
(``/proc/sys/vm/drop_caches`` when writable, else ``posix_fadvise(DONTNEED)`` per
file). Read buffers are 4096-aligned (mmap), like the host pool's slabs, so the tier
can use O_DIRECT. Target: the tier's best write and read at >= 0.9x the best raw.

Usage: python benchmarks/bench_disk.py [--quick] [--dir DIR]   (last line: one JSON object)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiofiles
import numpy as np
import torch
from disk_raw import (
    DROP_CACHES,
    READ_MODES,
    WRITE_MODES,
    aligned_buffers,
    drop_page_cache,
    files_under,
    raw_cold_read,
    raw_pass,
    raw_write_pass,
    timed,
)

from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.chunks.encoding import encode
from lmtier.chunks.format import ChunkMeta, align_up
from lmtier.chunks.keys import ChunkKey, split_key
from lmtier.config import CPUTierConfig, DiskTierConfig
from lmtier.testing import random_key
from lmtier_backends.disk.tier import DiskTier

NUM_TOKENS, HIDDEN = 256, 1024  # the payload of make_chunk(num_tokens=256, hidden=1024)
ALIGN = 4096
DROP_CACHES = "/proc/sys/vm/drop_caches"
RAW_MODES = (
    "write_buffered_fsync",
    "write_direct",
    "write_direct_fsync",
    "read_buffered",
    "read_direct",
)


def make_chunks(count: int) -> list[tuple[ChunkKey, memoryview]]:
    """``count`` valid chunks with distinct keys, each in its own aligned buffer."""
    payload = np.random.default_rng(0).standard_normal((1, 2, NUM_TOKENS, 1, HIDDEN), np.float32)
    chunks = []
    for _ in range(count):
        key = random_key()
        namespace, chain = split_key(key)
        meta = ChunkMeta(chain, namespace, "float32", payload.shape, "LKTHD", NUM_TOKENS)
        data = encode(meta, payload)
        slab = memoryview(mmap.mmap(-1, align_up(len(data))))
        slab[: len(data)] = data
        chunks.append((key, slab[: len(data)]))
    return chunks


def aligned_buffers(count: int, size: int) -> list[memoryview]:
    return [memoryview(mmap.mmap(-1, align_up(size))) for _ in range(count)]


def files_under(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]


def drop_page_cache(paths: Sequence[str], level: str = "1") -> str:
    """Evict ``paths`` from the page cache; returns the method used."""
    os.sync()
    if os.access(DROP_CACHES, os.W_OK):
        with open(DROP_CACHES, "w") as f:
            f.write(level)
        return "drop_caches"
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


# --- raw file I/O: the baseline -----------------------------------------------------


def raw_write(path: str, data: memoryview, direct: bool, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0))
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: str, buf: memoryview, direct: bool) -> int:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        size = os.fstat(fd).st_size
        return os.preadv(fd, [buf[: align_up(size) if direct else size]], 0)
    finally:
        os.close(fd)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def raw_pass(
    workdir: str, chunks: list[tuple[ChunkKey, memoryview]], threads: int, mode: str
) -> float:
    """Seconds for one raw pass; ``mode``: write_buffered_fsync, write_direct,
    write_direct_fsync, read_buffered, read_direct (reads use files of a write first)."""
    paths = [os.path.join(workdir, f"{i}.raw") for i in range(len(chunks))]
    views = [view for _, view in chunks]
    with ThreadPoolExecutor(threads) as pool:
        if mode.startswith("write"):
            direct, sync = "direct" in mode, mode.endswith("fsync")
            return timed(
                lambda: list(pool.map(lambda p, v: raw_write(p, v, direct, sync), paths, views))
            )
        list(pool.map(lambda p, v: raw_write(p, v, False, True), paths, views))
        drop_page_cache(paths)
        buffers = aligned_buffers(len(chunks), len(views[0]))
        direct = mode == "read_direct"
        return timed(lambda: list(pool.map(lambda p, b: raw_read(p, b, direct), paths, buffers)))


# --- the tier ---------------------------------------------------------------------


class AiofilesDiskTier(DiskTier):
    """The tier with its read path on aiofiles (open, readinto, close: three hops)."""

    async def _read_into(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        async def one(key: ChunkKey, buf: memoryview) -> int | None:
            async with aiofiles.open(
                self.path_of(key), "rb", buffering=0, executor=self._pool
            ) as f:
                got: int | None = await f.readinto(buf)
                return got

        return list(await asyncio.gather(*(one(k, b) for k, b in zip(keys, buffers, strict=True))))


TIER_WRITES = {  # label: (o_direct, fsync)
    "tier_write_buffered": (False, True),
    "tier_write_direct": (True, True),
    "tier_write_direct_nofsync": (True, False),  # not the default: where the time goes
}
TIER_READS = {  # label: (tier class, o_direct)
    "tier_read_buffered": (DiskTier, False),  # the shipped path: one pool hop per file
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
    args = parser.parse_args()
    num_chunks, repeats = (128, 3) if args.quick else (128, 7)
    startup_files = 20_000 if args.quick else 100_000
    workdir = tempfile.mkdtemp(prefix="lmtier-bench-disk-", dir=args.dir)
    try:
        results = run_all(workdir, num_chunks, repeats, startup_files)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["quick"] = args.quick
    for name, value in results.items():
        print(f"{name:>44}: {value}")
    print(json.dumps(results))


def run_all(workdir: str, num_chunks: int, repeats: int, startup_files: int) -> dict[str, Any]:
    chunks = make_chunks(num_chunks)
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
            for threads in (1, 4):
                d = fresh_dir()
                times.setdefault(f"raw_{mode}_{threads}t", []).append(
                    raw_pass(d, chunks, threads, mode)
                )
                shutil.rmtree(d)
        for label, (o_direct, fsync) in TIER_WRITES.items():
            d = fresh_dir()
            times.setdefault(label, []).append(asyncio.run(tier_write(d, chunks, o_direct, fsync)))
            if label != "tier_write_direct_nofsync":
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

    tier_writes = ["tier_write_buffered", "tier_write_direct"]  # fsync on: the default
    tier_reads = ["tier_read_buffered_cold", "tier_read_direct_cold"]
    raw_writes = [k for k in times if k.startswith("raw_write")]
    raw_durable = [k for k in raw_writes if "fsync" in k]
    raw_reads = [k for k in times if k.startswith("raw_read")]
    tier_write_gbps = max(gb[f"{k}_gbps"] for k in tier_writes)
    tier_read_gbps = max(gb[f"{k}_gbps"] for k in tier_reads)
    results: dict[str, Any] = {
        "benchmark": "disk",
        "chunk_bytes": chunk_bytes,
        "chunks_per_pass": num_chunks,
        "repeats": repeats,
        "cold_read_method": cache_method,
        **gb,
        "best_raw_write_gbps": best("raw_write"),
        "best_raw_durable_write_gbps": best("raw_write", "fsync"),
        "best_raw_read_gbps": best("raw_read"),
        "tier_write_gbps": tier_write_gbps,
        "tier_read_gbps": tier_read_gbps,
        "tier_write_vs_best_raw": round(tier_write_gbps / best("raw_write"), 3),
        "tier_write_vs_best_raw_durable": round(tier_write_gbps / best("raw_write", "fsync"), 3),
        "tier_read_vs_best_raw": round(tier_read_gbps / best("raw_read"), 3),
        "tier_write_vs_best_raw_paired": paired(tier_writes, raw_writes),
        "tier_write_vs_best_raw_durable_paired": paired(tier_writes, raw_durable),
        "tier_read_vs_best_raw_paired": paired(tier_reads, raw_reads),
        "threadpool_vs_aiofiles_cold": round(
            gb["tier_read_buffered_cold_gbps"] / gb["aiofiles_read_buffered_cold_gbps"], 3
        ),
        "threadpool_vs_aiofiles_warm": round(
            gb["tier_read_buffered_warm_gbps"] / gb["aiofiles_read_buffered_warm_gbps"], 3
        ),
        "target_vs_best_raw": 0.9,
    }
    results.update(measure_startup(workdir, startup_files))
    return results


if __name__ == "__main__":
    main()
