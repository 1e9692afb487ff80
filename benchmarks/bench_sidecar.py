"""The sidecar (``lmtier serve``) over its unix socket against gRPC's own floor, the
embedded cache and memcpy, in one run.

Starts a real sidecar (:class:`lmtier.testing.sidecar.SidecarProcess`: 1 GiB CPU tier
+ 256 MiB staging in shared memory, disk off) and a KVSpec(8 layers, 2 KV heads,
head_dim 64) float32 model: 8 KiB of KV per token, 2 MiB chunks of 256 tokens.

1. ``lookup``: ``client.lookup(tokens)`` of a 32k-token prompt (128 chunks, all cached
   in the sidecar: the walk is full length; numpy int64 input; the client hashes and
   sends 128 keys) against (a) the emptiest unary call on the same socket,
   ``grpc.health.v1.Health/Check`` (grpcio's own servicer: a dict lookup; the
   transport floor), and (b) the same lookup in an embedded ``LMTier.open()`` in this
   process with the same chunks cached. Figure: ``lookup / (1.5 * floor + embedded)``,
   the median of paired rounds (target <= 1.0). Also: an empty ``Release`` (the
   sidecar's own handler path: auth, session, metrics, no work), the client's hashing
   alone, ``lookup_keys`` of ready keys, and a Python-list prompt.
2. ``shm``: the shared-memory data path against memcpy of the same bytes in this
   process. store = ``client.store(tokens, kv)`` of N fresh chunks (new token ids each
   round, so none is skipped) against ``copy_`` of the same strided source into N
   preallocated chunk tensors; load = ``with client.load(tokens) as hit:
   hit.kv(out=preallocated)`` (the user's path, the copy out included) against the
   mirror image, ``copy_`` of N contiguous 2 MiB chunk tensors into their places in
   that tensor. Target >= 0.8x. Also against one ``copy_`` of the whole KV into it
   (``load_vs_whole_memcpy``): one 64 MiB memcpy, which glibc does with non-temporal
   stores (above ~3/4 of the L3 cache), ~10% faster here than any copy of 2 MiB
   chunks, the embedded cache's included. The embedded cache's
   store / load on the same rounds are reported beside them (its own ratios bound
   what a client can reach). The shared pool is cycled once before timing (every slab
   stored into by this client: its pages are mapped here, as in a long-running engine;
   the first pass's cost is reported as ``first_pass_store_gb_s``).
3. ``stream``: a client with ``shared_memory=False`` (LoadStream / StoreStream, one
   message per 2 MiB chunk
   pieces) against a raw grpcio stream of the same bytes in the same piece size: a
   grpc.aio server in its own process on a unix socket with generic handlers and
   bytes passthrough (no protobuf): Download yields ready 2 MiB ``bytes``, distinct
   pieces (not one piece N times, which would stay in cache), the client copies each
   into its place in a preallocated buffer; Upload sends ``bytes`` slices of the KV
   tensor, the server copies each into its place in a buffer of the whole upload (as
   a store puts chunks in slabs; until 2026-12-02 all into one 2 MiB buffer, which
   ran 3-15% faster). Both processes keep freed message buffers as ``lmtier serve``
   does (:mod:`lmtier.remote.heap`). Target >= 0.9x.
4. ``concurrency``: 1, 2, 4, 8 client processes (spawn, each its own
   ``lmtier.connect``), each looping lookup (LOOP_CHUNKS cached chunks) -> load with
   ``kv(out=)`` -> store of STORE_CHUNKS fresh chunks for a few seconds; aggregate
   GB/s (loaded + stored KV), lookups/s, and p50 / p99 latency per op.
5. ``peer`` (with ``--lmcache DIR``, a directory that makes lmcache importable; it is
   not a dependency): LMCache 0.5.6's multiprocess server on the CPU (zmq, L1 in
   host memory, 256-token chunks, LRU), driven by LMCache's own ``lmcache bench server
   --mode cpu`` on 32k-token requests of this model's shape, and the same requests
   (cold lookup, store, warm lookup, load into a preallocated tensor) through the
   sidecar: p50 ms each and the sidecar's speedup. Without lmcache: the reason.

torch runs ``--torch-threads`` threads here (default 1, for the client's copies and the
memcpy baseline alike: with 2 on these 2 shared cores, every per-chunk copy waits on a
descheduled worker thread; benchmarks/README.md).

Usage: python benchmarks/bench_sidecar.py [--quick] [--contend N] [--lmcache DIR]
(``--contend N``: N processes spin on the cores throughout; ``--burner``: one.) Last line: JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from bench_common import add_contend_argument, contend, contention_of
from grpc_health.v1 import health_pb2, health_pb2_grpc

import lmtier
from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.config import CPUTierConfig, DiskTierConfig
from lmtier.remote.heap import keep_freed_memory
from lmtier.testing.sidecar import SidecarProcess
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.v1 import sidecar_pb2_grpc as pb_grpc

MIB = 1 << 20
SPEC = KVSpec(num_layers=8, num_kv_heads=2, head_dim=64)  # float32: 8 KiB/token
CHUNK = 256
CHUNK_KV_BYTES = CHUNK * SPEC.bytes_per_token  # 2 MiB
SLAB = SPEC.encoded_chunk_bytes(CHUNK)
SLAB_STRIDE = (SLAB + 63) // 64 * 64  # a slab of the streaming client's pool (64-aligned)
PROMPT_TOKENS = 32 * 1024  # 128 chunks
PIECE = 4 * MIB  # the sidecar's stream_piece_bytes (its default): a chunk per message
RAW_PIECE = CHUNK_KV_BYTES  # the raw stream's messages: the same size as the sidecar's
LOOP_CHUNKS, STORE_CHUNKS = 8, 2  # concurrency loop: chunks looked up + loaded, stored
SIDECAR_SETTINGS: dict[str, Any] = {
    "chunk_size": CHUNK,
    "cpu": {"capacity_bytes": "1GiB", "staging_bytes": "256MiB"},
    "disk": {"enabled": False},
    "sidecar": {"stream_piece_bytes": PIECE},
}
LMCACHE_SHAPE = "(2,2048,16,2,64):float32:8"  # K/V, blocks, block size, heads, dim: SPEC
LMCACHE_ENV = "LMTIER_BENCH_LMCACHE"
LMCACHE_MISSING = (
    "not run: lmcache is not importable here. It is not a dependency: its wheel's "
    "requirements pull a CUDA torch, cupy-cuda13x and transformers>=5.4. Install it "
    "beside the project (benchmarks/README.md, bench_sidecar: `pip install --target DIR "
    "--no-deps lmcache==0.5.6 ...`) and pass --lmcache DIR (or set LMTIER_BENCH_LMCACHE)"
)


def client_config() -> LMTierConfig:
    """The client side's config: only the chunk size matters (the sidecar owns tiers)."""
    return LMTierConfig(chunk_size=CHUNK, disk=DiskTierConfig(enabled=False))


def median(values: list[float]) -> float:
    return statistics.median(values)


def rounds(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Each function once per round, in order, ``repeats`` rounds (after one untimed
    round): noise on the shared machine slows a round's calls alike."""
    for fn in fns.values():
        fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - started)
    return out


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Median over rounds of num/den (times: > 1 means ``num`` is slower)."""
    return median([n / d for n, d in zip(num, den, strict=True)])


def speed_ratios(measured: list[float], baseline: list[float]) -> tuple[float, float]:
    """Throughput of ``measured`` over ``baseline``'s: the median of paired rounds (the
    figure), and best over best (each side's fastest round: what the code costs when
    the shared machine lets it run, for telling code from noise)."""
    return (
        round(1 / paired_ratio(measured, baseline), 3),
        round(min(baseline) / min(measured), 3),
    )


class Tokens:
    """Fresh token ids: every call gives ids no earlier call gave (so nothing is skipped)."""

    def __init__(self, base: int) -> None:
        self.next = base

    def __call__(self, count: int) -> np.ndarray:
        out = np.arange(self.next, self.next + count, dtype=np.int64)
        self.next += count
        return out


def touch_shared_pool(client: LMTier) -> None:
    """Map every page of the sidecar's shared pool in this process (read one byte per
    page): what a long-running engine's mapping looks like once every slab has been
    used. (Private attributes: this is what MAP_POPULATE at attach would do.)"""
    connection = getattr(client.chunk_store, "_connection", None)
    for region, _ in list(getattr(connection, "_regions", {}).values()):
        int(region.tensor[::4096].sum())


# ---- 1. lookup ------------------------------------------------------------------------


def bench_lookup(
    sidecar: SidecarProcess, client: LMTier, embedded: LMTier, repeats: int
) -> dict[str, Any]:
    prompt = np.random.default_rng(0).integers(0, 128_000, size=PROMPT_TOKENS, dtype=np.int64)
    as_list = prompt.tolist()
    kv = torch.randn(SPEC.shape(PROMPT_TOKENS))
    assert client.store(prompt, kv) == PROMPT_TOKENS // CHUNK
    assert embedded.store(prompt, kv) == PROMPT_TOKENS // CHUNK
    del kv
    keys = list(client.keys(prompt))
    channel = grpc.insecure_channel(sidecar.target)
    health = health_pb2_grpc.HealthStub(channel)
    stub = pb_grpc.SidecarStub(channel)  # type: ignore[no-untyped-call]
    session_id = client.chunk_store._connection.sessions()[0].id  # type: ignore[attr-defined]
    check, release = health_pb2.HealthCheckRequest(), pb.ReleaseRequest(session_id=session_id)

    def sidecar_lookup() -> None:
        assert client.lookup(prompt).num_tokens == PROMPT_TOKENS

    def embedded_lookup() -> None:
        assert embedded.lookup(prompt).num_tokens == PROMPT_TOKENS

    fns: dict[str, Callable[[], object]] = {
        "floor": lambda: health.Check(check, timeout=10),
        "embedded": embedded_lookup,
        "sidecar": sidecar_lookup,
        "release_empty": lambda: stub.Release(release, timeout=10),
        "hash": lambda: client.keys(prompt),
        "sidecar_keys": lambda: client.lookup_keys(keys),
        "embedded_keys": lambda: embedded.lookup_keys(keys),
        "sidecar_list": lambda: client.lookup(as_list),
        "embedded_list": lambda: embedded.lookup(as_list),
    }
    times = rounds(fns, repeats)
    channel.close()
    ratios = [
        s / (1.5 * f + e)
        for s, f, e in zip(times["sidecar"], times["floor"], times["embedded"], strict=True)
    ]
    us = {name: round(median(t) * 1e6, 1) for name, t in times.items()}
    ratio = round(median(ratios), 3)
    best = min(times["sidecar"]) / (1.5 * min(times["floor"]) + min(times["embedded"]))
    return {
        "sidecar_us": us["sidecar"],
        "floor_us": us["floor"],
        "floor_call": "grpc.health.v1.Health/Check on the sidecar's socket (grpcio's servicer)",
        "embedded_us": us["embedded"],
        "ratio_vs_1.5floor_plus_embedded": ratio,
        "target": 1.0,
        "met": ratio <= 1.0,
        "ratio_best": round(best, 3),
        "release_empty_us": us["release_empty"],
        "client_hash_us": us["hash"],
        "sidecar_lookup_keys_us": us["sidecar_keys"],
        "embedded_lookup_keys_us": us["embedded_keys"],
        "sidecar_list_us": us["sidecar_list"],
        "embedded_list_us": us["embedded_list"],
        "rounds": repeats,
    }


# ---- 2. shared memory -----------------------------------------------------------------


def bench_shm(client: LMTier, embedded: LMTier, num_chunks: int, repeats: int) -> dict[str, Any]:
    tokens = num_chunks * CHUNK
    nbytes = tokens * SPEC.bytes_per_token
    kv = torch.randn(SPEC.shape(tokens))
    dests = [torch.empty(SPEC.shape(CHUNK)) for _ in range(num_chunks)]
    whole = torch.empty(SPEC.shape(tokens))
    fresh = Tokens(10**8)

    # The first pass over the shared pool (its pages mapped here as they are used), then
    # enough stores to use every slab once.
    stats = client.stats().get("sidecar", {})
    slabs = int(float(stats.get("slabs_total", 640)))  # type: ignore[arg-type]
    started = time.perf_counter()
    assert client.store(fresh(tokens), kv) == num_chunks
    first_pass = time.perf_counter() - started
    for _ in range(slabs // num_chunks + 1):
        client.store(fresh(tokens), kv)
    touch_shared_pool(client)

    def copy_chunks() -> None:
        for i, dest in enumerate(dests):
            dest.copy_(kv.narrow(SPEC.token_axis, i * CHUNK, CHUNK))

    def sidecar_store() -> None:
        assert client.store(fresh(tokens), kv) == num_chunks

    def embedded_store() -> None:
        assert embedded.store(fresh(tokens), kv) == num_chunks

    cached = fresh(tokens)
    assert client.store(cached, kv) == num_chunks
    assert embedded.store(cached, kv) == num_chunks

    sources = [kv.narrow(SPEC.token_axis, i * CHUNK, CHUNK).contiguous() for i in range(num_chunks)]

    def copy_chunks_out() -> None:
        for i, source in enumerate(sources):
            whole.narrow(SPEC.token_axis, i * CHUNK, CHUNK).copy_(source)

    def copy_whole() -> None:
        whole.copy_(kv)

    def sidecar_load() -> None:
        with client.load(cached) as hit:
            assert hit.kv(out=whole) is not None

    def embedded_load() -> None:
        with embedded.load(cached) as hit:
            assert hit.kv(out=whole) is not None

    sidecar_load()
    assert torch.equal(whole, kv), "the sidecar loaded other bytes than it stored"
    times = rounds(
        {
            "copy_chunks": copy_chunks,
            "sidecar_store": sidecar_store,
            "embedded_store": embedded_store,
            "copy_chunks_out": copy_chunks_out,
            "copy_whole": copy_whole,
            "sidecar_load": sidecar_load,
            "embedded_load": embedded_load,
        },
        repeats,
    )
    gbps = {name: round(nbytes / median(t) / 1e9, 2) for name, t in times.items()}
    store_ratio, store_best = speed_ratios(times["sidecar_store"], times["copy_chunks"])
    load_ratio, load_best = speed_ratios(times["sidecar_load"], times["copy_chunks_out"])
    load_whole, load_whole_best = speed_ratios(times["sidecar_load"], times["copy_whole"])
    embedded_store, embedded_store_best = speed_ratios(
        times["embedded_store"], times["copy_chunks"]
    )
    embedded_load, embedded_load_best = speed_ratios(
        times["embedded_load"], times["copy_chunks_out"]
    )
    return {
        "chunks": num_chunks,
        "store_gb_s": gbps["sidecar_store"],
        "memcpy_store_gb_s": gbps["copy_chunks"],
        "store_vs_memcpy": store_ratio,
        "store_vs_memcpy_best": store_best,
        "load_gb_s": gbps["sidecar_load"],
        "memcpy_load_gb_s": gbps["copy_chunks_out"],
        "load_vs_memcpy": load_ratio,
        "load_vs_memcpy_best": load_best,
        "whole_memcpy_gb_s": gbps["copy_whole"],
        "load_vs_whole_memcpy": load_whole,
        "load_vs_whole_memcpy_best": load_whole_best,
        "target": 0.8,
        "met": store_ratio >= 0.8 and load_ratio >= 0.8,
        "embedded_store_vs_memcpy": embedded_store,
        "embedded_store_vs_memcpy_best": embedded_store_best,
        "embedded_load_vs_memcpy": embedded_load,
        "embedded_load_vs_memcpy_best": embedded_load_best,
        "embedded_store_gb_s": gbps["embedded_store"],
        "embedded_load_gb_s": gbps["embedded_load"],
        "first_pass_store_gb_s": round(nbytes / first_pass / 1e9, 2),
        "rounds": repeats,
    }


# ---- 3. streaming against raw grpcio --------------------------------------------------


RAW_SERVICE = "rawbytes.Bytes"
RAW_OPTIONS = [
    ("grpc.max_receive_message_length", 8 * MIB),
    ("grpc.max_send_message_length", 8 * MIB),
]


def raw_server(path: str) -> None:
    """A raw grpcio server (``--raw-server PATH``): generic handlers, bytes passthrough."""

    async def serve() -> None:
        # The same bytes as the sidecar moves: distinct pieces, as many as asked (one
        # piece sent N times would stay in cache, as no N pieces of KV do), and an
        # upload put in place piece after piece, as a store puts its chunks.
        ready: list[bytes] = []
        sink = bytearray()

        async def download(request: bytes, context: Any) -> AsyncIterator[bytes]:
            count = int.from_bytes(request[:8], "little")
            ready.extend(os.urandom(RAW_PIECE) for _ in range(count - len(ready)))
            for piece in ready[:count]:
                yield piece

        async def upload(pieces: AsyncIterator[bytes], context: Any) -> bytes:
            total = 0
            async for data in pieces:
                if total + len(data) > len(sink):
                    sink.extend(bytes(total + len(data) - len(sink)))
                sink[total : total + len(data)] = data
                total += len(data)
            return total.to_bytes(8, "little")

        handler = grpc.method_handlers_generic_handler(
            RAW_SERVICE,
            {
                "Download": grpc.unary_stream_rpc_method_handler(download),
                "Upload": grpc.stream_unary_rpc_method_handler(upload),
            },
        )
        server = grpc.aio.server(options=RAW_OPTIONS)
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())


def start_raw_server(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    path = directory / "raw.sock"
    process = subprocess.Popen(
        [sys.executable, __file__, "--raw-server", str(path)], stdout=subprocess.PIPE
    )
    assert process.stdout is not None
    if process.stdout.readline().strip() != b"ready":
        process.kill()
        sys.exit("the raw grpcio server did not start")
    return process, f"unix://{path}"


def bench_stream(target: str, directory: Path, num_chunks: int, repeats: int) -> dict[str, Any]:
    tokens = num_chunks * CHUNK
    nbytes = tokens * SPEC.bytes_per_token
    kv = torch.randn(SPEC.shape(tokens))
    whole = torch.empty(SPEC.shape(tokens))
    source = kv.reshape(-1).view(torch.uint8).numpy().data  # the KV's bytes, for the raw upload
    dest = memoryview(bytearray(nbytes))
    pieces = nbytes // RAW_PIECE
    fresh = Tokens(2 * 10**8)
    process, raw_target = start_raw_server(directory)
    channel = grpc.insecure_channel(raw_target, options=RAW_OPTIONS)
    download = channel.unary_stream(f"/{RAW_SERVICE}/Download")
    upload = channel.stream_unary(f"/{RAW_SERVICE}/Upload")
    client = lmtier.connect(
        target,
        client_config(),
        kv=SPEC,
        model_id="bench",
        shared_memory=False,
        staging_bytes=(num_chunks + 2) * SLAB_STRIDE,
    )
    try:

        def raw_load() -> None:
            at = 0
            for data in download(pieces.to_bytes(8, "little"), timeout=60):
                dest[at : at + len(data)] = data
                at += len(data)
            assert at == nbytes

        def raw_store() -> None:
            def gen() -> Iterator[bytes]:
                for at in range(0, nbytes, RAW_PIECE):
                    yield bytes(source[at : at + RAW_PIECE])

            assert int.from_bytes(upload(gen(), timeout=60), "little") == nbytes

        def stream_store() -> None:
            assert client.store(fresh(tokens), kv) == num_chunks

        cached = fresh(tokens)
        assert client.store(cached, kv) == num_chunks

        def stream_load() -> None:
            with client.load(cached) as hit:
                assert hit.num_tokens == tokens
                assert hit.kv(out=whole) is not None

        stream_load()
        assert torch.equal(whole, kv), "the stream loaded other bytes than it stored"
        times = rounds(
            {
                "raw_store": raw_store,
                "stream_store": stream_store,
                "raw_load": raw_load,
                "stream_load": stream_load,
            },
            repeats,
        )
    finally:
        client.close()
        channel.close()
        process.kill()
        process.wait()
    gbps = {name: round(nbytes / median(t) / 1e9, 3) for name, t in times.items()}
    store_ratio, store_best = speed_ratios(times["stream_store"], times["raw_store"])
    load_ratio, load_best = speed_ratios(times["stream_load"], times["raw_load"])
    return {
        "chunks": num_chunks,
        "piece_bytes": PIECE,
        "raw_piece_bytes": RAW_PIECE,
        "store_gb_s": gbps["stream_store"],
        "raw_upload_gb_s": gbps["raw_store"],
        "store_vs_raw": store_ratio,
        "store_vs_raw_best": store_best,
        "load_gb_s": gbps["stream_load"],
        "raw_download_gb_s": gbps["raw_load"],
        "load_vs_raw": load_ratio,
        "load_vs_raw_best": load_best,
        "target": 0.9,
        "met": store_ratio >= 0.9 and load_ratio >= 0.9,
        "rounds": repeats,
    }


# ---- 4. concurrent clients ------------------------------------------------------------


def worker(index: int, target: str, commands: Any, results: Any) -> None:
    """One client process: connect, cache its prompt, then run the loop when told."""
    torch.set_num_threads(1)
    client = lmtier.connect(target, client_config(), kv=SPEC, model_id="bench")
    fresh = Tokens((index + 4) * 10**8)
    prompt = fresh(LOOP_CHUNKS * CHUNK)
    kv = torch.randn(SPEC.shape(LOOP_CHUNKS * CHUNK))
    out = torch.empty_like(kv)
    new_kv = torch.randn(SPEC.shape(STORE_CHUNKS * CHUNK))
    assert client.store(prompt, kv) == LOOP_CHUNKS
    touch_shared_pool(client)
    results.put(("ready", index))
    while True:
        command = commands.get()
        if command is None:
            break
        start_at, duration = command
        client.store(prompt, kv)  # evicted by others' stores while this one idled
        latencies: dict[str, list[float]] = {"lookup": [], "load": [], "store": []}
        moved = 0
        misses = {"lookup": 0, "load": 0, "store": 0}
        time.sleep(max(0.0, start_at - time.time()))
        began = time.perf_counter()
        end = began + duration
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            found = client.lookup(prompt).num_tokens
            t1 = time.perf_counter()
            with client.load(prompt) as hit:
                hit.kv(out=out)
                loaded = hit.num_tokens
            t2 = time.perf_counter()
            stored = client.store(fresh(STORE_CHUNKS * CHUNK), new_kv)
            t3 = time.perf_counter()
            latencies["lookup"].append(t1 - t0)
            latencies["load"].append(t2 - t1)
            latencies["store"].append(t3 - t2)
            moved += (loaded + stored * CHUNK) * SPEC.bytes_per_token
            misses["lookup"] += found < len(prompt)
            misses["load"] += loaded < len(prompt)
            misses["store"] += stored < STORE_CHUNKS
        results.put(("done", index, time.perf_counter() - began, moved, misses, latencies))
    client.close()


def bench_concurrency(target: str, levels: list[int], duration: float) -> dict[str, Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    commands = [context.Queue() for _ in range(max(levels))]
    workers = [
        context.Process(target=worker, args=(i, target, commands[i], results), daemon=True)
        for i in range(max(levels))
    ]
    for process in workers:
        process.start()
    out: dict[str, Any] = {
        "loop": f"lookup {LOOP_CHUNKS} cached chunks, load them with kv(out=), "
        f"store {STORE_CHUNKS} fresh chunks",
        "seconds_per_level": duration,
    }
    try:
        for _ in workers:
            assert results.get(timeout=180)[0] == "ready"
        for level in levels:
            start_at = time.time() + 0.2
            for i in range(level):
                commands[i].put((start_at, duration))
            done = [results.get(timeout=duration + 120) for _ in range(level)]
            wall = max(d[2] for d in done)
            merged: dict[str, list[float]] = {"lookup": [], "load": [], "store": []}
            for d in done:
                for op, values in d[5].items():
                    merged[op].extend(values)
            row: dict[str, Any] = {
                "gb_s": round(sum(d[3] for d in done) / wall / 1e9, 3),
                "lookups_s": round(len(merged["lookup"]) / wall, 1),
                "misses": {op: sum(d[4][op] for d in done) for op in ("lookup", "load", "store")},
            }
            for op, values in merged.items():
                ms = np.percentile(np.asarray(values) * 1e3, [50, 99]) if values else [0, 0]
                row[f"{op}_p50_ms"] = round(float(ms[0]), 2)
                row[f"{op}_p99_ms"] = round(float(ms[1]), 2)
            out[str(level)] = row
    finally:
        for queue in commands:
            queue.put(None)
        for process in workers:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return out


# ---- 5. the peer: LMCache's multiprocess server ---------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def lmcache_env(path: str | None) -> dict[str, str] | None:
    """The environment that imports lmcache (``path`` first on PYTHONPATH), or None."""
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1"}
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
    probe = subprocess.run(
        [sys.executable, "-c", "import lmcache.v1.multiprocess.server"],
        check=False,
        env=env,
        capture_output=True,
        timeout=300,
    )
    return env if probe.returncode == 0 else None


def run_lmcache(env: dict[str, str], directory: Path, sequences: int) -> dict[str, Any]:
    """LMCache's MP server (CPU L1 of the sidecar's size, 256-token chunks, LRU) driven by
    its own ``lmcache bench server --mode cpu`` (lmcache_driven: the client's KV tensors
    in POSIX shared memory, the server copies in and out of them) on 32k-token requests
    of this model's shape: p50 ms of cold lookup, store, warm lookup, retrieve."""
    port, http_port = free_port(), free_port()
    log_path = directory / "lmcache-server.log"
    module = [sys.executable, "-m", "lmcache.cli.main"]
    server_args = [
        *("server", "--port", str(port), "--http-port", str(http_port), "--chunk-size"),
        *(str(CHUNK), "--l1-size-gb", "1.25", "--no-l1-use-lazy", "--eviction-policy", "LRU"),
        *("--shm-name", f"lmtier-bench-{os.getpid()}"),
    ]
    bench_args = [
        *("bench", "server", "--rpc-url", f"tcp://localhost:{port}", "--mode", "cpu"),
        *("--url", f"http://localhost:{http_port}", "--transfer-mode", "lmcache_driven"),
        *("--kvcache-shape-spec", LMCACHE_SHAPE, "--num-tokens", str(PROMPT_TOKENS - 1)),
        *("--start", "0", "--end", str(sequences), "--interval", "0", "--format", "json"),
    ]
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [*module, *server_args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + 180
        while b"cache server is running" not in log_path.read_bytes():
            if server.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"LMCache's server did not start:\n{tail}")
            time.sleep(0.2)
        output = directory / "lmcache-bench.json"
        subprocess.run(
            [*module, *bench_args, "--output", str(output), "-q"],
            env=env,
            check=True,
            timeout=600,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        metrics = json.loads(output.read_text())["metrics"]
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return metrics


PEER_OPS = ("cold_lookup", "cold_store", "warm_lookup", "warm_retrieve")


def lmtier_requests(
    client: LMTier, fresh: Tokens, sequences: int, out: torch.Tensor
) -> dict[str, list[float]]:
    """The same requests through the sidecar, in seconds: a cold lookup (a miss), the
    store of its 128 chunks, a warm lookup, and the load into a preallocated tensor."""
    kv = torch.randn(SPEC.shape(PROMPT_TOKENS))
    times: dict[str, list[float]] = {name: [] for name in PEER_OPS}
    for _ in range(sequences):
        prompt = fresh(PROMPT_TOKENS)
        t0 = time.perf_counter()
        assert client.lookup(prompt).num_tokens == 0
        t1 = time.perf_counter()
        assert client.store(prompt, kv) == PROMPT_TOKENS // CHUNK
        t2 = time.perf_counter()
        assert client.lookup(prompt).num_tokens == PROMPT_TOKENS
        t3 = time.perf_counter()
        with client.load(prompt) as hit:
            assert hit.kv(out=out) is not None
        t4 = time.perf_counter()
        for name, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[name].append(seconds)
    return times


def bench_peer(
    client: LMTier, lmcache: str | None, directory: Path, sequences: int
) -> dict[str, Any] | str:
    env = lmcache_env(lmcache)
    if env is None:
        return LMCACHE_MISSING
    fresh, out = Tokens(3 * 10**8), torch.empty(SPEC.shape(PROMPT_TOKENS))
    lmtier_requests(client, fresh, 1, out)  # a warm-up
    # Half the sidecar's requests before LMCache's run and half after, so that a noisy
    # spell of the shared machine falls on both.
    ours = lmtier_requests(client, fresh, sequences // 2, out)
    try:
        metrics = run_lmcache(env, directory, sequences)
        theirs = {op: float(metrics[op][f"{op}_p50"]) for op in PEER_OPS}
        theirs_best = {op: float(metrics[op][f"{op}_min"]) for op in PEER_OPS}
    except (OSError, RuntimeError, KeyError, ValueError, subprocess.SubprocessError) as exc:
        return f"failed: {type(exc).__name__}: {exc}"
    for op, seconds in lmtier_requests(client, fresh, sequences - sequences // 2, out).items():
        ours[op].extend(seconds)
    p50 = {op: round(median(t) * 1e3, 3) for op, t in ours.items()}
    best = {op: round(min(t) * 1e3, 3) for op, t in ours.items()}
    return {
        "what": "lmcache 0.5.6 MP server (zmq, CPU L1 1.25 GB, LRU) and its own "
        "`lmcache bench server --mode cpu --transfer-mode lmcache_driven`, 32k-token "
        f"requests of shape {LMCACHE_SHAPE}; the same requests through the sidecar",
        "sequences": sequences,
        "lmtier_p50_ms": p50,
        "lmcache_p50_ms": theirs,
        "lmtier_speedup": {op: round(theirs[op] / p50[op], 2) for op in PEER_OPS},
        "lmtier_best_ms": best,
        "lmcache_best_ms": theirs_best,
        "lmtier_speedup_best": {op: round(theirs_best[op] / best[op], 2) for op in PEER_OPS},
        "lmcache_counts": {op: metrics[op].get(f"{op}_count") for op in PEER_OPS},
        "lmcache_checksums": metrics.get("results", {}),
    }


# ---- main -----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, 3 s levels")
    add_contend_argument(parser)
    parser.add_argument(
        "--lmcache",
        default=os.environ.get(LMCACHE_ENV),
        help="a directory that makes lmcache importable (pip --target), for the peer",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch's threads in this process (its copies and the memcpy baseline alike)",
    )
    parser.add_argument("--raw-server", help=argparse.SUPPRESS)
    args = parser.parse_args()
    # As `lmtier serve` does: the raw server and this process (both streaming clients)
    # reuse freed 2 MiB message buffers instead of faulting their pages in again.
    keep_freed_memory()
    if args.raw_server:
        raw_server(args.raw_server)
        return
    lookup_rounds, chunks, data_rounds, duration = (
        (150, 32, 11, 3.0) if args.quick else (500, 64, 21, 10.0)
    )
    torch.set_num_threads(args.torch_threads)
    results: dict[str, Any] = {
        "benchmark": "sidecar",
        "quick": args.quick,
        "contend": contention_of(args),
        "torch_threads": args.torch_threads,
    }
    directory = Path(tempfile.mkdtemp(prefix="lmtier-bench-sidecar-"))
    embedded_config = LMTierConfig(
        chunk_size=CHUNK,
        cpu=CPUTierConfig(
            capacity_bytes=(3 * PROMPT_TOKENS // CHUNK + 4 * chunks) * SLAB,
            staging_bytes=(PROMPT_TOKENS // CHUNK + 4) * SLAB,
        ),
        disk=DiskTierConfig(enabled=False),
    )
    with (
        contend(contention_of(args)),
        SidecarProcess(directory, SIDECAR_SETTINGS) as sidecar,
        lmtier.connect(sidecar.target, client_config(), kv=SPEC, model_id="bench") as client,
        LMTier.open(embedded_config, kv=SPEC, model_id="bench") as embedded,
    ):
        results["lookup"] = bench_lookup(sidecar, client, embedded, lookup_rounds)
        results["shm"] = bench_shm(client, embedded, chunks, data_rounds)
        # The 32k-token prompt of the lookup row (128 chunks, 256 MiB): a round trip's
        # fixed cost weighs a quarter as much as on 32 chunks.
        prompt_chunks = PROMPT_TOKENS // CHUNK
        results["shm_prompt"] = bench_shm(client, embedded, prompt_chunks, max(5, data_rounds // 2))
        results["stream"] = bench_stream(sidecar.target, directory, chunks, data_rounds)
        results["concurrency"] = bench_concurrency(sidecar.target, [1, 2, 4, 8], duration)
        results["peer"] = bench_peer(client, args.lmcache, directory, 6 if args.quick else 12)
        results["sidecar_stats"] = client.stats().get("sidecar", {})
    results["targets_met"] = all(results[part]["met"] for part in ("lookup", "shm", "stream"))
    for name, value in results.items():
        print(f"{name:>14}: {value}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
