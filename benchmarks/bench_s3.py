"""S3 tier put/get throughput and lookup latency against raw boto3 on the same endpoint.

Measures, in one run, against a moto server it starts itself (or ``--endpoint``):
  (a) put and get GB/s of 2 MiB and 8 MiB chunks: raw boto3 ``put_object`` (bytes
      bodies) and ``get_object().read()``, at concurrency 1, 4, 8 and 16 (a thread
      pool over one client), twice: with boto3's default client settings and with the
      tier's settings (no CRC32 checksums, no SigV4 payload hash: the chunk format's
      xxh3 checks every read end to end); then the tier's ``put`` (from slab
      memoryviews) and ``get_into`` (into slabs, validated) with ``max_concurrency``
      1, 4, 8 and 16. Ratios: the tier's best over raw's best, and the median over
      concurrencies of tier / raw at the same concurrency; target >= 0.9x raw.
  (b) lookup of 512 present keys: ``contains`` at ``max_concurrency`` 1, 4, 16, 32
      against raw HEADs on a thread pool of the same size; and 512 fresh keys (a miss
      at the first key: the tier stops after one round of HEADs).
      (``--quick``: (a) and (b) at concurrency 4 and 16 only).
  (c) the transfer choices, against a null endpoint in another process (it answers
      GETs with a fixed 8 MiB body and swallows PUTs, so the client's own cost shows;
      moto would hide it): client CPU per GiB (``time.process_time``) and GB/s of a
      GET streamed into a slab by http.client ``readinto`` against ``read(1 MiB)``
      copies and a plain ``read()``; of a PUT whose body is a zero-copy reader over
      the slab against ``bytes(slab)``.
  (d) through the facade (``LMTier``, default S3 settings; benchmarks/remote_facade.py):
      store + flush, lookup, load, and lookup + load_keys of 2 MiB chunks, against raw
      boto3 with the tier's client (``make_client``: same settings) on 16 threads:
      PUTs, HEADs, GETs read into preallocated buffers. Target: load >= 0.9x raw.
  (e) ``defaults``: 512 chunks looked up and loaded by new caches at the default
      settings, N times: the chunks found and loaded each time (all, every time).

Usage: python benchmarks/bench_s3.py [--quick] [--endpoint URL] [--contend N]
(``--contend N``: N processes spin on the cores throughout; ``--burner``: one.) Last line: JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.server
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
from bench_common import add_contend_argument, contend, contention_of
from botocore.config import Config
from botocore.exceptions import ClientError
from remote_facade import CHUNK_BYTES, RawClient, defaults_row, facade_rows

from lmtier import LMTierConfig
from lmtier.config import S3TierConfig
from lmtier.testing import make_chunk, random_key
from lmtier_backends.s3.io import ViewReader, make_client, read_body_into
from lmtier_backends.s3.tier import S3Tier

BUCKET = "lmtier-bench"
MIB = 1 << 20
GIB = 1 << 30
CONCURRENCY = (1, 4, 8, 16)
LOOKUP_CONCURRENCY = (1, 4, 16, 32)
QUICK_CONCURRENCY = (4, 16)
"""--quick: (a) and (b) at these concurrencies only (the facade rows need the time)."""
LOOKUP_KEYS = 512
TIER_SETTINGS: dict[str, Any] = {
    "request_checksum_calculation": "when_required",
    "response_checksum_validation": "when_required",
    "s3": {"payload_signing_enabled": False},
}


def wait_until_up(process: subprocess.Popen[bytes], url: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        if process.poll() is not None:
            sys.exit(f'server for {url} did not start (moto: pip install "moto[server]")')
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1):
            return
        if time.monotonic() > deadline:
            sys.exit(f"{url} did not answer within 30 s")
        time.sleep(0.05)


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """A ``python -m moto.server`` on a free loopback port; yields its URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(process, url)
        yield url
    finally:
        process.terminate()
        process.wait()


def client(endpoint: str, workers: int, tier_settings: bool) -> Any:
    extra = TIER_SETTINGS if tier_settings else {}
    config = Config(max_pool_connections=max(workers, 10), **extra)
    return boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)


def raw_put(s3: Any, pool: ThreadPoolExecutor, names: list[str], bodies: list[bytes]) -> None:
    def one(job: tuple[str, bytes]) -> None:
        s3.put_object(Bucket=BUCKET, Key=job[0], Body=job[1])

    list(pool.map(one, zip(names, bodies, strict=True)))


def raw_get(s3: Any, pool: ThreadPoolExecutor, names: list[str]) -> None:
    list(pool.map(lambda name: s3.get_object(Bucket=BUCKET, Key=name)["Body"].read(), names))


def raw_heads(s3: Any, pool: ThreadPoolExecutor, names: list[str]) -> None:
    list(pool.map(lambda name: s3.head_object(Bucket=BUCKET, Key=name), names))


def seconds(fn: Callable[..., object], *args: Any) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


async def throughput(
    endpoint: str, payload_mib: int, count: int, reps: int, concurrency: tuple[int, ...]
) -> dict[str, Any]:
    """(a) for one chunk size: GB/s per variant and concurrency, and the best ratios.

    Variants run interleaved at each concurrency, so drift in the machine's load
    touches them alike.
    """
    chunks = [make_chunk(num_tokens=256 * payload_mib, hidden=512, seed=i) for i in range(count)]
    bodies = [data for _, data in chunks]
    nbytes = sum(len(data) for data in bodies)
    slabs = [memoryview(bytearray(len(data) + 4096)) for data in bodies]
    for slab, data in zip(slabs, bodies, strict=True):
        slab[: len(data)] = data
    items = [(key, slab[: len(data)]) for slab, (key, data) in zip(slabs, chunks, strict=True)]
    keys = [key for key, _ in chunks]
    names = [f"raw/{payload_mib}/{i}" for i in range(count)]
    gbps: dict[str, dict[int, float]] = {}
    for workers in concurrency:
        raw = {"raw_default": client(endpoint, workers, False)}
        raw["raw_same_settings"] = client(endpoint, workers, True)
        tier = await open_tier(endpoint, workers)
        times: dict[str, list[float]] = {}
        with ThreadPoolExecutor(workers) as pool:
            for _ in range(reps):
                for label, s3 in raw.items():
                    times.setdefault(f"put_{label}", []).append(
                        seconds(raw_put, s3, pool, names, bodies)
                    )
                    times.setdefault(f"get_{label}", []).append(seconds(raw_get, s3, pool, names))
                times.setdefault("put_tier", []).append(await timed(tier.put(items)))
                times.setdefault("get_tier", []).append(await timed(tier.get_into(keys, slabs)))
        assert tier.stats.corrupt == 0 and tier.stats.errors == 0, tier.stats
        await tier.close()
        for s3 in raw.values():
            s3.close()
        for name, values in times.items():
            gbps.setdefault(name, {})[workers] = round(nbytes / statistics.median(values) / 1e9, 3)
    best = {name: max(values.values()) for name, values in gbps.items()}
    ratios: dict[str, float] = {}
    for op in ("put", "get"):
        for base in ("raw_same_settings", "raw_default"):
            tier_gbps, raw_gbps = gbps[f"{op}_tier"], gbps[f"{op}_{base}"]
            ratios[f"{op}_ratio_vs_{base}"] = round(
                max(tier_gbps.values()) / max(raw_gbps.values()), 3
            )
            # The same concurrency, measured interleaved: less exposed to one lucky run.
            paired = [tier_gbps[w] / raw_gbps[w] for w in concurrency]
            ratios[f"{op}_paired_ratio_vs_{base}"] = round(statistics.median(paired), 3)
    return {"best_gbps": best, **ratios, "by_concurrency_gbps": gbps}


async def timed(call: Awaitable[object]) -> float:
    started = time.perf_counter()
    await call
    return time.perf_counter() - started


def open_tier(endpoint: str, workers: int, prefix: str = "tier/") -> Awaitable[S3Tier]:
    return S3Tier.open(
        BUCKET, endpoint_url=endpoint, prefix=prefix, max_concurrency=workers, timeout_s=30
    )


async def lookups(endpoint: str, reps: int, concurrency: tuple[int, ...]) -> dict[str, Any]:
    """(b) 512 present keys at each concurrency, tier and raw HEADs; 512 fresh keys."""
    chunks = [make_chunk(num_tokens=1, hidden=8) for _ in range(LOOKUP_KEYS)]
    keys = [key for key, _ in chunks]
    fresh = [random_key() for _ in range(LOOKUP_KEYS)]
    figures: dict[str, dict[int, float]] = {"tier": {}, "raw_heads": {}, "tier_fresh": {}}
    for workers in concurrency:
        tier = await open_tier(endpoint, workers, prefix="lookup/")
        if workers == concurrency[0]:
            assert await tier.put(chunks) == LOOKUP_KEYS
        names = [tier.object_key(key) for key in keys]
        s3 = client(endpoint, workers, tier_settings=True)
        times: dict[str, list[float]] = {name: [] for name in figures}
        with ThreadPoolExecutor(workers) as pool:
            for _ in range(reps):
                started = time.perf_counter()
                assert await tier.contains(keys) == LOOKUP_KEYS
                times["tier"].append(time.perf_counter() - started)
                times["raw_heads"].append(seconds(raw_heads, s3, pool, names))
                times["tier_fresh"].append(await timed(tier.contains(fresh)))
        await tier.close()
        s3.close()
        for name, values in times.items():
            figures[name][workers] = round(1e3 * statistics.median(values), 1)
    return {
        "present_512_ms": figures["tier"],
        "raw_head_512_ms": figures["raw_heads"],
        "fresh_512_ms": figures["tier_fresh"],
        "present_ratio_vs_raw_best": round(
            min(figures["tier"].values()) / min(figures["raw_heads"].values()), 3
        ),
    }


class _NullS3(http.server.BaseHTTPRequestHandler):
    """Answers every GET with the same 8 MiB body and swallows PUT bodies: an endpoint
    that costs almost nothing, so the client's own cost shows."""

    protocol_version = "HTTP/1.1"
    body = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.send_header("Last-Modified", "Wed, 01 Jan 2025 00:00:00 GMT")
        self.end_headers()
        self.wfile.write(self.body)

    def do_PUT(self) -> None:
        remaining = int(self.headers["Content-Length"])
        sink = memoryview(bytearray(MIB))
        while remaining:
            remaining -= self.rfile.readinto(sink[: min(remaining, MIB)]) or remaining
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def serve_null(port: int) -> None:
    _NullS3.body = os.urandom(8 * MIB)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _NullS3)
    server.serve_forever()


def transfer_choices(count: int) -> dict[str, Any]:
    """(c) client CPU per GiB and GB/s, one 8 MiB request at a time, against a null
    endpoint in another process (moto would hide the client's cost)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve-null", str(port)])
    try:
        wait_until_up(server, f"http://127.0.0.1:{port}")
        return measure_choices(client(f"http://127.0.0.1:{port}", 1, True), count)
    finally:
        server.terminate()
        server.wait()


def measure_choices(s3: Any, count: int) -> dict[str, Any]:
    slab = memoryview(bytearray(os.urandom(8 * MIB)))

    def streamed(direct: bool) -> None:
        body = s3.get_object(Bucket=BUCKET, Key="choice")["Body"]
        read_body_into(body, slab, direct=direct)
        body.close()

    def plain_read() -> None:
        slab[:] = s3.get_object(Bucket=BUCKET, Key="choice")["Body"].read()

    def put(body: Any) -> None:
        s3.put_object(Bucket=BUCKET, Key="choice", Body=body, ContentLength=len(slab))

    variants: dict[str, Callable[[], object]] = {
        "get_readinto_direct": lambda: streamed(True),
        "get_read_1mib_copies": lambda: streamed(False),
        "get_read_all_then_copy": plain_read,
        "put_zero_copy_reader": lambda: put(ViewReader(slab)),
        "put_bytes_copy": lambda: put(bytes(slab)),
    }
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    wall: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(count):  # interleaved, so drift in the machine's load hits all alike
        for name, fn in variants.items():
            started, started_cpu = time.perf_counter(), time.process_time()
            fn()
            cpu[name].append(time.process_time() - started_cpu)
            wall[name].append(time.perf_counter() - started)
    s3.close()
    scale = GIB / len(slab)
    return {
        name: {
            "client_cpu_ms_per_gib": round(1e3 * statistics.median(cpu[name]) * scale, 1),
            "gbps": round(len(slab) / statistics.median(wall[name]) / 1e9, 3),
        }
        for name in variants
    }


def facade(endpoint: str, count: int, reps: int) -> dict[str, Any]:
    """(d) and (e)."""
    settings = S3TierConfig(bucket=BUCKET, endpoint_url=endpoint, prefix="facade/")

    def at_defaults(base: LMTierConfig) -> LMTierConfig:
        return base.replace(s3=settings)

    s3 = make_client(settings)  # the tier's own client settings
    workers = settings.max_concurrency
    names = [f"raw-facade/{i}" for i in range(count)]
    body = os.urandom(CHUNK_BYTES)
    buffers = [memoryview(bytearray(CHUNK_BYTES)) for _ in names]

    def get_into(index: int) -> None:
        data = s3.get_object(Bucket=BUCKET, Key=names[index])["Body"].read()
        buffers[index][: len(data)] = data

    def get_all(pool: ThreadPoolExecutor) -> None:
        list(pool.map(get_into, range(count)))

    with ThreadPoolExecutor(workers) as pool:
        raw = RawClient(
            put=lambda: raw_put(s3, pool, names, [body] * count),
            get=lambda: get_all(pool),
            exists=lambda: raw_heads(s3, pool, names),
        )
        rows = facade_rows(at_defaults, "s3", raw, count, reps)
    s3.close()
    rows["defaults"] = defaults_row(at_defaults, "s3", reps=3 if reps < 5 else 6)
    return rows


async def main(endpoint: str, quick: bool) -> dict[str, Any]:
    reps = 2 if quick else 5
    s3 = client(endpoint, 1, tier_settings=False)
    with contextlib.suppress(ClientError):  # an endpoint given may already have it
        s3.create_bucket(Bucket=BUCKET)
    s3.close()
    results: dict[str, Any] = {"bench": "s3", "quick": quick}
    workers = QUICK_CONCURRENCY if quick else CONCURRENCY
    results["chunk_2mib"] = await throughput(endpoint, 2, 32 if quick else 64, reps, workers)
    results["chunk_8mib"] = await throughput(endpoint, 8, 8 if quick else 16, reps, workers)
    lookup_workers = QUICK_CONCURRENCY if quick else LOOKUP_CONCURRENCY
    results["lookup"] = await lookups(endpoint, 1 if quick else 3, lookup_workers)
    results["transfer_choices"] = transfer_choices(12 if quick else 60)
    return results


def summary(results: dict[str, Any]) -> None:
    for size in ("chunk_2mib", "chunk_8mib"):
        block = results[size]
        for name, value in block["best_gbps"].items():
            by_workers = block["by_concurrency_gbps"][name]
            print(f"{size} {name:>24}: {value:.3f} GB/s best; by concurrency {by_workers}")
        for name, value in block.items():
            if "ratio" in name:
                print(f"{size} {name:>34}: {value:.3f}x")
    for name, value in results["lookup"].items():
        print(f"lookup {name:>26}: {value}")
    for name, value in results["transfer_choices"].items():
        print(f"{name:>30}: {value}")
    for name, value in results["facade"].items():
        print(f"facade {name:>23}: {value}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (< 60 s)")
    parser.add_argument("--endpoint", help="an S3 endpoint (MinIO) instead of a moto server")
    add_contend_argument(parser)
    parser.add_argument("--serve-null", type=int, help=argparse.SUPPRESS)  # for (c)
    args = parser.parse_args()
    if args.serve_null:
        serve_null(args.serve_null)
    for name, value in (
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        os.environ.setdefault(name, value)
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(contend(contention_of(args)))
        url = args.endpoint or stack.enter_context(moto_server())
        results = asyncio.run(main(url, args.quick))
        # The facade runs its own event loop thread: called from plain code.
        results["facade"] = facade(url, 48 if args.quick else 128, 3 if args.quick else 5)
    results["endpoint"] = "given" if args.endpoint else "moto server"
    results["contend"] = contention_of(args)
    results["seconds"] = round(time.perf_counter() - started, 1)
    summary(results)
    print(json.dumps(results))
