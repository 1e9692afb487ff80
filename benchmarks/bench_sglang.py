"""lmtier as SGLang's HiCache storage backend, against a plain copy and SGLang's own
``file`` backend, in one run.

The pages are SGLang 0.5.23's: its real ``MHATokenToKVPoolHost`` (``page_first``, bf16,
8 layers x 8 KV heads x 128, pages of 64 tokens: 2 MiB a page) built on the CPU, and
the backends are made by its ``StorageBackendFactory`` and driven as its cache
controller drives them: lmtier through the zero-copy path (``interface_v1``:
``batch_set_v1`` / ``batch_get_v1`` at host indices), SGLang's ``file`` backend through
the flat-page path it uses (``get_data_page`` + ``batch_set``; ``batch_get`` into
``get_dummy_flat_data_page`` tensors + ``set_from_flat_data_page``).

Rows (64 pages a call; medians, cache and baseline alternating):
  * ``cpu``: lmtier's CPU tier (embedded); ``sidecar``: a real ``lmtier serve`` on
    this machine, its shared memory mapped. Set and get against the plain copy of
    the same 64 pages' bytes between two host pools (one torch ``copy_``; the
    bound). Target >= 0.8x.
  * ``disk``: lmtier's disk tier alone (no CPU tier: every get reads the files, warm
    in the page cache, as the file backend's do) against the file backend in the same
    filesystem: set (with lmtier's ``flush``: the files written) and get throughput.
    Target >= 1.5x.
  * ``exists``: ``batch_exists`` of 256 stored pages, lmtier's disk tier against the
    file backend. Target >= 10x faster.

Run it where SGLang imports (.ci/run's SGLang lane):
  PYTHONPATH=.venv-ci/sglang-site:tests/support/sglang_stubs \\
      python benchmarks/bench_sglang.py [--quick] [--contend N]   (last line: one JSON object)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from bench_common import add_contend_argument, contend, contention_of, paired_median_s

# SGLang's pools are built as the tests build them (tests/support/sglang_pools.py):
# benchmarks run from a checkout, so put its tests/ folder on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from support.sglang_pools import mha_pool

from lmtier.testing.sidecar import SidecarProcess

LAYERS, HEADS, HEAD_DIM, PAGE = 8, 8, 128, 64
PAGES = 64
EXISTS_PAGES = 256
TOKEN = "bench-sglang"
LMTIER = {
    "backend_name": "lmtier",
    "module_path": "lmtier_connector.sglang",
    "class_name": "LMTierStorage",
    "interface_v1": 1,
}


def host_pool(pages: int, *, layers: int = LAYERS, heads: int = HEADS, dim: int = HEAD_DIM) -> Any:
    """SGLang's page_first MHA host pool with room for ``pages`` pages (bf16), touched."""
    pool = mha_pool(
        "page_first", layers=layers, heads=heads, head_dim=dim, page=PAGE,
        device_tokens=pages * PAGE, ratio=1.0,
    )  # fmt: skip
    pool.kv_buffer.normal_()  # touched, and not zeros
    return pool


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2)


def storage_config(extra: dict[str, Any]) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="bench/model", extra_config=extra,
    )  # fmt: skip


@contextmanager
def backend(name: str, extra: dict[str, Any], pool: Any) -> Iterator[Any]:
    made = StorageBackendFactory.create_backend(name, storage_config(extra), pool)
    made.register_mem_pool_host(pool)
    made.register_mem_host_pool_v2(pool, PoolName.KV)
    made.on_host_pools_registered()
    try:
        yield made
    finally:
        if hasattr(made, "close"):
            made.close()


class Keys:
    """Fresh page hashes (a set of held pages is not written again)."""

    def __init__(self) -> None:
        self.round = 0

    def next(self, count: int) -> list[str]:
        self.round += 1
        return [hashlib.sha256(f"{self.round}:{i}".encode()).hexdigest() for i in range(count)]


def pages_of(pool: Any, count: int, first_page: int = 0) -> torch.Tensor:
    start = first_page * PAGE
    return torch.arange(start, start + count * PAGE, dtype=torch.int64)


def rows_against_copy(make: Callable[[Any], Any], repeats: int) -> dict[str, Any]:
    """Set of PAGES pages from one half of a host pool, and get into the other half,
    through the backend ``make(pool)`` yields (one server: as SGLang backs up and
    prefetches its own pool), against one copy of the same bytes between the halves."""
    pool = host_pool(2 * PAGES)
    buffer, half = pool.kv_buffer, PAGES * PAGE
    source, target = slice(0, half), slice(half, 2 * half)

    def copy() -> None:
        buffer[:, target].copy_(buffer[:, source])

    keys = Keys()
    from_indices, to_indices = pages_of(pool, PAGES), pages_of(pool, PAGES, PAGES)
    with make(pool) as server:

        def set_pages() -> None:
            assert all(server.batch_set_v1(keys.next(PAGES), from_indices))

        def get_pages() -> None:
            assert all(server.batch_get_v1(stored, to_indices))

        copy_s, set_s = paired_median_s(copy, set_pages, repeats)
        stored = keys.next(PAGES)  # stored after the sets: the CPU tier holds the latest
        assert all(server.batch_set_v1(stored, from_indices))
        copy2_s, get_s = paired_median_s(copy, get_pages, repeats)
        assert torch.equal(buffer[:, target], buffer[:, source])
    nbytes = PAGES * pool.get_size_per_token() * PAGE
    return {
        "copy_gbps": round(nbytes / min(copy_s, copy2_s) / 1e9, 2),
        "set_gbps": round(nbytes / set_s / 1e9, 2),
        "get_gbps": round(nbytes / get_s / 1e9, 2),
        "set_vs_copy": round(copy_s / set_s, 3),
        "get_vs_copy": round(copy2_s / get_s, 3),
    }


def cpu_row(workdir: Path, repeats: int) -> dict[str, Any]:
    config = {"cpu": {"capacity_bytes": f"{4 * PAGES * 3}MiB"}, "disk": {"enabled": False}}
    return rows_against_copy(
        lambda pool: backend("dynamic", {**LMTIER, "config": config}, pool), repeats
    )


def sidecar_row(workdir: Path, repeats: int) -> dict[str, Any]:
    settings = {
        "cpu": {"capacity_bytes": f"{4 * PAGES * 3}MiB"},
        "sidecar": {"auth_token": TOKEN, "slab_bytes": f"{2 * 1024 * 1024 + 4096}"},
    }
    with SidecarProcess(workdir / "sidecar", settings) as sidecar:
        extra = {**LMTIER, "sidecar": sidecar.target, "sidecar_token": TOKEN}
        return rows_against_copy(lambda pool: backend("dynamic", extra, pool), repeats)


def disk_row(workdir: Path, repeats: int) -> dict[str, Any]:
    """lmtier's disk tier (no CPU tier) against SGLang's file backend, same pages."""
    pool = host_pool(2 * PAGES)
    indices = pages_of(pool, PAGES)
    starts = [int(indices[i * PAGE]) for i in range(PAGES)]
    nbytes = PAGES * pool.get_size_per_token() * PAGE
    keys = Keys()
    lmtier_dir, file_dir = workdir / "lmtier-disk", workdir / "sglang-file"
    config = {
        "cpu": {"enabled": False, "staging_bytes": f"{4 * PAGES * 3}MiB"},
        "disk": {"path": str(lmtier_dir)},
    }
    times: dict[str, list[float]] = {}
    with (
        backend("dynamic", {**LMTIER, "config": config}, pool) as ours,
        backend("file", {"file_storage_path": str(file_dir)}, pool) as theirs,
    ):
        held = keys.next(PAGES)
        assert all(ours.batch_set_v1(held, indices))
        assert theirs.batch_set(held, [pool.get_data_page(s) for s in starts])

        def ours_set() -> None:
            assert all(ours.batch_set_v1(keys.next(PAGES), indices))
            ours.flush()  # the files written, as the file backend's are

        def theirs_set() -> None:  # SGLang's generic backup path
            assert theirs.batch_set(keys.next(PAGES), [pool.get_data_page(s) for s in starts])

        def ours_get() -> None:
            assert all(ours.batch_get_v1(held, indices))

        def theirs_get() -> None:  # SGLang's generic prefetch path
            dummy = [pool.get_dummy_flat_data_page() for _ in held]
            got = theirs.batch_get(held, dummy)
            for start, page in zip(starts, got, strict=True):
                pool.set_from_flat_data_page(start, page)

        for name, (a, b) in {"set": (theirs_set, ours_set), "get": (theirs_get, ours_get)}.items():
            file_s, lmtier_s = paired_median_s(a, b, repeats)
            times[name] = [file_s, lmtier_s]
    exists = exists_rows(workdir, repeats)
    return {
        **{
            f"{name}_gbps": {
                "lmtier": round(nbytes / s[1] / 1e9, 2),
                "file": round(nbytes / s[0] / 1e9, 2),
            }
            for name, s in times.items()
        },
        **{f"{name}_vs_file": round(s[0] / s[1], 2) for name, s in times.items()},
        "exists": exists,
    }


def exists_rows(workdir: Path, repeats: int) -> dict[str, Any]:
    """batch_exists of EXISTS_PAGES stored pages: lmtier's disk tier against the file
    backend (small pages: the answer does not depend on their size)."""
    pool = host_pool(EXISTS_PAGES, layers=1, heads=1, dim=16)
    indices = pages_of(pool, EXISTS_PAGES)
    starts = [int(indices[i * PAGE]) for i in range(EXISTS_PAGES)]
    keys = Keys().next(EXISTS_PAGES)
    config = {"cpu": {"enabled": False}, "disk": {"path": str(workdir / "lmtier-exists")}}
    with (
        backend("dynamic", {**LMTIER, "config": config}, pool) as ours,
        backend("file", {"file_storage_path": str(workdir / "file-exists")}, pool) as theirs,
    ):
        assert all(ours.batch_set_v1(keys, indices))
        ours.flush()
        assert theirs.batch_set(keys, [pool.get_data_page(s) for s in starts])

        def ours_exists() -> None:
            assert ours.batch_exists(keys) == EXISTS_PAGES

        def theirs_exists() -> None:
            assert theirs.batch_exists(keys) == EXISTS_PAGES

        file_s, lmtier_s = paired_median_s(theirs_exists, ours_exists, 5 * repeats)
    return {
        "pages": EXISTS_PAGES,
        "lmtier_ms": round(lmtier_s * 1e3, 3),
        "file_ms": round(file_s * 1e3, 3),
        "speedup": round(file_s / lmtier_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (CI)")
    add_contend_argument(parser)
    args = parser.parse_args()
    repeats = 3 if args.quick else 9
    workdir = Path(tempfile.mkdtemp(prefix="bench-sglang-"))
    started = time.perf_counter()
    try:
        with contend(contention_of(args)):
            result = {
                "benchmark": "sglang",
                "pages_per_call": PAGES,
                "page_bytes": 2 * LAYERS * HEADS * HEAD_DIM * 2 * PAGE,
                "cpu": cpu_row(workdir, repeats),
                "sidecar": sidecar_row(workdir, repeats),
                "disk": disk_row(workdir, repeats),
            }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result.update(
        {
            "targets": {
                "cpu/sidecar vs copy": ">= 0.8",
                "disk vs file": ">= 1.5",
                "exists": ">= 10x",
            },
            "quick": args.quick,
            "contend": contention_of(args),
            "seconds": round(time.perf_counter() - started, 1),
            "python": sys.version.split()[0],
        }
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
