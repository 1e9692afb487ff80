"""Redis tier put/get throughput and lookup latency against raw redis-py, in one run.

Starts its own redis-server (no persistence) on a free loopback port, then measures:
  (a) put and get of 2 MiB and 8 MiB chunks through the tier (``put`` /
      ``get_into`` into preallocated slab-like buffers) against the raw baseline:
      redis-py's asyncio client with its non-copying Python packer, one SET / GET per
      chunk, at the same concurrency; plus redis-py GET followed by the copy into the
      buffer (what a tier built on plain redis-py has to do). Writes overwrite keys
      written once before timing, for both sides (a fresh key costs Redis an allocation
      that has nothing to do with the client);
  (b) a lookup of 512 keys (``contains``, which names and packs the keys too) against
      one pipelined batch of 512 EXISTS through redis-py (``lookup_ratio``) and, as
      the floor, the same batch packed from ready names and written to a plain asyncio
      socket in one go (``lookup_ratio_vs_raw_socket``); one PING for scale;
  (c) for context, the default redis-py SET path (sync client; the hiredis packer,
      which copies every value, when hiredis is importable);
  (d) ``close()`` time;
  (e) through the facade (``LMTier``, default Redis settings; benchmarks/remote_facade.py):
      store + flush, lookup, load, and lookup + load_keys of 2 MiB chunks, against raw
      redis-py at the facade's concurrency (16): SETs, one pipeline of EXISTS, GETs;
  (f) ``defaults``: 512 chunks looked up and loaded by new caches at the default
      settings, N times: the chunks found and loaded each time (all, every time).
Tier and baseline runs alternate, and medians are reported. Targets: tier put and get
>= 0.9x raw; lookup <= 1.2x one pipelined batch; facade store/load >= 0.9x raw.

Usage: python benchmarks/bench_redis.py [--quick] [--concurrency N] [--contend N]
(``--contend N``: N processes spin on the cores throughout; ``--burner``: one.) Last line: JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import redis
import redis.asyncio as aredis
from bench_common import add_contend_argument, contend, contention_of
from remote_facade import CHUNK_BYTES, RawClient, defaults_row, facade_rows

from lmtier import LMTierConfig
from lmtier.chunks.encoding import encode
from lmtier.chunks.format import ChunkMeta
from lmtier.chunks.keys import ChunkKey, split_key
from lmtier.config import RedisTierConfig
from lmtier.testing import random_key
from lmtier_backends.redis.tier import RedisTier

MIB = 1 << 20
SIZES = {"2MiB": 1024, "8MiB": 4096}  # hidden size of a 256-token fp32 chunk


def start_server(directory: str) -> tuple[subprocess.Popen[bytes], int]:
    server = shutil.which("redis-server")
    if server is None:
        sys.exit("redis-server not found on PATH (apt-get install redis-server)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
    args += ["no", "--dir", directory, "--logfile", os.path.join(directory, "redis.log")]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return process, port
        except OSError:
            time.sleep(0.02)
    process.kill()
    sys.exit("redis-server did not start")


def make_chunks(hidden: int, count: int) -> list[tuple[ChunkKey, memoryview]]:
    """``count`` valid chunks of 256 tokens, each in its own slab-like buffer."""
    payload = np.random.default_rng(0).standard_normal((1, 2, 256, 1, hidden), np.float32)
    out = []
    for _ in range(count):
        key = random_key()
        namespace, chain = split_key(key)
        data = encode(ChunkMeta(chain, namespace, "float32", payload.shape, "LKTHD", 256), payload)
        slab = bytearray(len(data) + 4096)
        slab[: len(data)] = data
        out.append((key, memoryview(slab)[: len(data)]))
    return out


async def timed(call: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await call()
    return time.perf_counter() - started


async def bounded(concurrency: int, calls: Sequence[Callable[[], Awaitable[Any]]]) -> None:
    permits = asyncio.Semaphore(concurrency)

    async def one(call: Callable[[], Awaitable[Any]]) -> None:
        async with permits:
            await call()

    await asyncio.gather(*(one(call) for call in calls))


async def get_copies(
    client: Any, names: Sequence[bytes], buffers: Sequence[memoryview], concurrency: int
) -> None:
    """redis-py GETs of ``names``, each value copied into its buffer (a plain client's
    read path: the baseline the tier's zero-copy reads are held against)."""

    async def one(name: bytes, buffer: memoryview) -> None:
        value = await client.get(name)
        buffer[: len(value)] = value

    await bounded(
        concurrency, [lambda n=n, b=b: one(n, b) for n, b in zip(names, buffers, strict=True)]
    )


async def raw_exists_batch(port: int, names: Sequence[bytes]) -> float:
    """One pipelined batch of EXISTS on a plain asyncio socket (connected before timing):
    pack the names, write once, read until every reply line is in."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        times = []
        for _ in range(15):
            started = time.perf_counter()
            writer.write(
                b"".join([b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%b\r\n" % (len(n), n) for n in names])
            )
            replies = b""
            while replies.count(b"\n") < len(names):
                replies += await reader.read(65536)
            assert replies.count(b":1") == len(names)
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    finally:
        writer.close()
        await writer.wait_closed()


def default_set_path(port: int, chunks: Sequence[tuple[ChunkKey, memoryview]]) -> dict[str, Any]:
    """The sync redis-py client as installed: which packer it uses, and its SET GB/s."""
    try:
        import hiredis  # noqa: F401, PLC0415

        hiredis_found = True
    except ImportError:
        hiredis_found = False
    client = redis.Redis(port=port)
    try:
        client.ping()
        packer = type(client.connection_pool.get_connection()._command_packer).__name__
        names = [b"default:" + key.hex().encode() for key, _ in chunks]
        for name, (_, view) in zip(names, chunks, strict=True):
            client.set(name, view)
        times = []
        for _ in range(3):
            started = time.perf_counter()
            for name, (_, view) in zip(names, chunks, strict=True):
                client.set(name, view)
            times.append(time.perf_counter() - started)
        nbytes = sum(len(view) for _, view in chunks)
        client.delete(*names)
    finally:
        client.close()
    note = (
        "hiredis importable: this is its packer, which copies every value"
        if hiredis_found
        else "hiredis is not installed here: the default path is redis-py's Python packer"
    )
    return {
        "hiredis_importable": hiredis_found,
        "packer": packer,
        "sequential_set_gbps": round(nbytes / statistics.median(times) / 1e9, 3),
        "note": note,
    }


async def throughput(
    port: int, label: str, hidden: int, count: int, reps: int, concurrency: int
) -> dict[str, Any]:
    chunks = make_chunks(hidden, count)
    nbytes = sum(len(view) for _, view in chunks)
    size = len(chunks[0][1])
    tier = await RedisTier.open(
        f"redis://127.0.0.1:{port}/0", max_connections=concurrency, timeout_s=5.0
    )
    client = aredis.Redis(port=port, max_connections=concurrency, protocol=2)
    raw_names = [b"raw:" + key.hex().encode() for key, _ in chunks]
    keys = [key for key, _ in chunks]
    buffers = [memoryview(bytearray(size + 4096)) for _ in chunks]

    async def raw_put() -> None:
        await bounded(
            concurrency,
            [
                lambda n=n, v=v: client.set(n, v)
                for n, (_, v) in zip(raw_names, chunks, strict=True)
            ],
        )

    async def raw_get() -> None:
        await bounded(concurrency, [lambda n=n: client.get(n) for n in raw_names])

    async def raw_get_copy() -> None:
        await get_copies(client, raw_names, buffers, concurrency)

    async def tier_put() -> None:
        assert await tier.put(chunks) == count

    async def tier_get() -> None:
        sizes = await tier.get_into(keys, buffers)
        assert sizes == [size] * count, sizes

    runs: dict[str, list[float]] = {
        name: [] for name in ("tier_put", "raw_put", "tier_get", "raw_get", "raw_get_copy")
    }
    try:
        await tier_put()  # keys exist before timing: both sides overwrite
        await raw_put()
        for _ in range(reps):
            runs["tier_put"].append(await timed(tier_put))
            runs["raw_put"].append(await timed(raw_put))
            runs["tier_get"].append(await timed(tier_get))
            runs["raw_get"].append(await timed(raw_get))
            runs["raw_get_copy"].append(await timed(raw_get_copy))
        assert bytes(buffers[0][:size]) == bytes(chunks[0][1])
        await tier.delete(keys)
        await client.delete(*raw_names)
    finally:
        await tier.close()
        await client.aclose()
    gbps = {name: nbytes / statistics.median(times) / 1e9 for name, times in runs.items()}
    return {
        "chunk_bytes": size,
        "chunks": count,
        "put_gbps": {"tier": round(gbps["tier_put"], 3), "raw_redis_py": round(gbps["raw_put"], 3)},
        "put_ratio": round(gbps["tier_put"] / gbps["raw_put"], 3),
        "get_gbps": {
            "tier": round(gbps["tier_get"], 3),
            "raw_redis_py": round(gbps["raw_get"], 3),
            "redis_py_get_then_copy": round(gbps["raw_get_copy"], 3),
        },
        "get_ratio": round(gbps["tier_get"] / gbps["raw_get"], 3),
        "label": label,
    }


async def lookup(port: int, reps: int) -> dict[str, Any]:
    tier = await RedisTier.open(f"redis://127.0.0.1:{port}/0")
    client = aredis.Redis(port=port, protocol=2)
    try:
        keys = [random_key() for _ in range(512)]
        names = [tier.redis_key(key) for key in keys]
        await client.mset(dict.fromkeys(names, b"x"))
        await tier.contains(keys)  # warm connections
        tier_times, pipe_times, ping_times = [], [], []
        for _ in range(reps):
            started = time.perf_counter()
            assert await tier.contains(keys) == 512
            tier_times.append(time.perf_counter() - started)
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            started = time.perf_counter()
            await pipe.execute()
            pipe_times.append(time.perf_counter() - started)
            ping_times.append(await timed(client.ping))
        raw = await raw_exists_batch(port, names)
        await client.delete(*names)
        closing = await RedisTier.open(f"redis://127.0.0.1:{port}/0")
        await closing.contains(keys)
        close_s = await timed(closing.close)
    finally:
        await tier.close()
        await client.aclose()
    tier_s = statistics.median(tier_times)
    return {
        "lookup_512_ms": {
            "tier": round(tier_s * 1e3, 3),
            "raw_socket_batch": round(raw * 1e3, 3),
            "redis_py_pipeline": round(statistics.median(pipe_times) * 1e3, 3),
            "ping": round(statistics.median(ping_times) * 1e3, 3),
        },
        # DESIGN 11's baseline is raw redis-py: its pipeline is the "one pipelined batch".
        # The hand-written socket batch (names already made, no client) is the floor.
        "lookup_ratio": round(tier_s / statistics.median(pipe_times), 3),
        "lookup_ratio_vs_raw_socket": round(tier_s / raw, 3),
        "close_ms": round(close_s * 1e3, 3),
    }


FACADE_CONCURRENCY = RedisTierConfig().max_connections


def raw_client(port: int, count: int, loop: asyncio.AbstractEventLoop) -> tuple[RawClient, Any]:
    """(e)'s baseline on ``loop``: redis-py at the facade's concurrency; and its client."""
    client = aredis.Redis(port=port, max_connections=FACADE_CONCURRENCY, protocol=2)
    names = [b"raw-facade:%d" % i for i in range(count)]
    value = memoryview(bytearray(os.urandom(CHUNK_BYTES)))

    def put() -> None:
        calls = [lambda n=n: client.set(n, value) for n in names]
        loop.run_until_complete(bounded(FACADE_CONCURRENCY, calls))

    def get() -> None:
        calls = [lambda n=n: client.get(n) for n in names]
        loop.run_until_complete(bounded(FACADE_CONCURRENCY, calls))

    async def exists_all() -> None:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        assert sum(await pipe.execute()) == count

    return RawClient(put, get, lambda: loop.run_until_complete(exists_all())), client


def facade(port: int, count: int, reps: int) -> dict[str, Any]:
    """(e) and (f)."""
    url = f"redis://127.0.0.1:{port}/0"

    def at_defaults(base: LMTierConfig) -> LMTierConfig:
        return base.replace(redis=RedisTierConfig(url=url))

    loop = asyncio.new_event_loop()
    raw, client = raw_client(port, count, loop)
    try:
        rows = facade_rows(at_defaults, "redis", raw, count, reps)
        loop.run_until_complete(client.flushdb())
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
    rows["defaults"] = defaults_row(at_defaults, "redis", reps=3 if reps < 9 else 6)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer chunks and repetitions")
    parser.add_argument("--concurrency", type=int, default=4, help="GETs/SETs in flight")
    add_contend_argument(parser)
    args = parser.parse_args()
    total_bytes = (64 if args.quick else 256) * MIB
    reps = 5 if args.quick else 9
    with tempfile.TemporaryDirectory() as directory, contend(contention_of(args)):
        process, port = start_server(directory)
        try:
            results: dict[str, Any] = {"bench": "redis", "quick": args.quick}
            results["concurrency"], results["contend"] = args.concurrency, contention_of(args)
            for label, hidden in SIZES.items():
                count = max(4, total_bytes // (2 * 256 * hidden * 4))
                results[label] = asyncio.run(
                    throughput(port, label, hidden, count, reps, args.concurrency)
                )
            results.update(asyncio.run(lookup(port, 3 * reps)))
            results["default_redis_py_set"] = default_set_path(port, make_chunks(SIZES["2MiB"], 8))
            results["facade"] = facade(port, 64 if args.quick else 256, reps)
        finally:
            process.terminate()
            process.wait(timeout=10)
    results["targets"] = {
        "put_ratio": ">= 0.9",
        "get_ratio": ">= 0.9",
        "lookup_ratio": "<= 1.2",
        "facade store/load ratio": ">= 0.9",
        "facade defaults": "all_complete",
    }
    results["python"] = sys.version.split()[0]
    for name, value in results.items():
        print(f"{name:>28}: {value}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
