"""Two SGLang "servers" (two lmtier backends, each with its own host pool and its own
cache) share pages through a real redis-server and through a real ``lmtier serve``;
the shared server killed under them costs misses, never an exception into SGLang and
never a wrong byte in its host pool."""

from __future__ import annotations

import importlib.util
import signal
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.integration]

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (.ci/run's SGLang lane)", allow_module_level=True)
pytest.importorskip("grpc")

with warnings.catch_warnings():  # SGLang's imports warn (torch.jit, CUDA-only kernels)
    warnings.simplefilter("ignore")
    from lmtier.testing.sidecar import SidecarProcess
    from support.redis_servers import RedisServer
    from support.sglang_pools import (
        assert_equal_pages,
        assert_same_kv,
        attached,
        fill_pages,
        hashes,
        mha_pool,
        read_pages,
    )
    from support.sglang_pools import storage_config as make_config

TOKEN = "sglang-sidecar-token"
SIDECAR = {  # slabs sized for these small pages (2 KiB), as docs/sglang.md says to size them
    "cpu": {"capacity_bytes": "4MiB"},
    "sidecar": {"auth_token": TOKEN, "slab_bytes": "64KiB"},
}


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as server:
        yield server


def redis_extra(server: RedisServer) -> dict[str, Any]:
    """An embedded cache of its own (a small CPU tier, no disk) over the shared Redis."""
    return {
        "config": {
            "cpu": {"capacity_bytes": "2MiB"},
            "disk": {"enabled": False},
            "redis": {"url": server.url, "timeout_s": 2.0},
        }
    }


def test_two_servers_share_pages_through_redis(redis: RedisServer) -> None:
    keys = hashes(8)
    writer_pool = mha_pool("page_first_direct")
    config = make_config(redis_extra(redis), layout="page_first_direct")
    with attached(config, writer_pool) as writer:
        indices, pages = fill_pages(writer_pool, 8, seed=1)
        assert writer.batch_set_v1(keys, indices) == [True] * 8
    # closed: its writes landed in Redis. A second server, its CPU tier empty, whose
    # pool keeps the same page order in another layout.
    reader_pool = mha_pool("layer_first")
    with attached(make_config(redis_extra(redis), layout="layer_first"), reader_pool) as reader:
        assert reader.batch_exists(keys) == 8
        target = reader_pool.alloc(8 * reader_pool.page_size)
        assert reader.batch_get_v1(keys, target) == [True] * 8
        assert_same_kv(reader_pool, read_pages(reader_pool, target), writer_pool, pages)
        assert reader.lmtier_stats()["redis"]["hits"] >= 8


def test_redis_killed_under_a_server_costs_misses_and_no_wrong_byte(redis: RedisServer) -> None:
    keys = hashes(8)
    pool = mha_pool("page_first")
    with attached(make_config(redis_extra(redis)), pool) as writer:
        indices, pages = fill_pages(pool, 8, seed=2)
        assert all(writer.batch_set_v1(keys, indices))
    reader_pool = mha_pool("page_first")
    with attached(make_config(redis_extra(redis)), reader_pool) as reader:
        # the first two pages in the reader's own CPU tier, then Redis dies
        assert reader.batch_get_v1(keys[:2], reader_pool.alloc(2 * reader_pool.page_size)) == [
            True,
            True,
        ]
        redis.kill()
        target = reader_pool.alloc(8 * reader_pool.page_size)
        before = read_pages(reader_pool, target)
        got = reader.batch_get_v1(keys, target)
        assert got == [True, True] + [False] * 6  # no exception: the rest are misses
        after = read_pages(reader_pool, target)
        assert_equal_pages(after[:2], pages[:2])
        assert_equal_pages(after[2:], before[2:])  # not a byte written where it missed
        assert reader.batch_exists(keys) == 2
        # a write with Redis down is not an exception either (the CPU tier takes it)
        more, _ = fill_pages(reader_pool, 2, seed=3)
        assert len(reader.batch_set_v1(hashes(2, seed="b"), more)) == 2


def sidecar_extra(sidecar: SidecarProcess, **more: Any) -> dict[str, Any]:
    return {"sidecar": sidecar.target, "sidecar_token": TOKEN, **more}


@pytest.mark.parametrize("shared_memory", [True, False])
def test_two_servers_share_pages_through_one_sidecar(tmp_path: Path, shared_memory: bool) -> None:
    settings = SIDECAR
    keys = hashes(8)
    with SidecarProcess(tmp_path / "sidecar", settings) as sidecar:
        extra = sidecar_extra(sidecar, sidecar_shared_memory=shared_memory, sidecar_timeout_s=5)
        writer_pool = mha_pool("page_first")
        with attached(make_config(extra), writer_pool) as writer:
            indices, pages = fill_pages(writer_pool, 8, seed=4)
            assert writer.batch_set_v1(keys, indices) == [True] * 8
        reader_pool = mha_pool("page_first")
        with attached(make_config(extra), reader_pool) as reader:
            assert reader.batch_exists(keys) == 8
            target = reader_pool.alloc(8 * reader_pool.page_size)
            assert reader.batch_get_v1(keys, target) == [True] * 8
            assert_equal_pages(read_pages(reader_pool, target), pages)


def test_a_sidecar_killed_under_a_server_costs_misses_never_an_exception(tmp_path: Path) -> None:
    settings = SIDECAR
    keys = hashes(4)
    sidecar = SidecarProcess(tmp_path / "sidecar", settings).start()
    try:
        pool = mha_pool("page_first")
        with attached(make_config(sidecar_extra(sidecar, sidecar_timeout_s=2)), pool) as backend:
            indices, _ = fill_pages(pool, 4, seed=5)
            assert all(backend.batch_set_v1(keys, indices))
            sidecar.signal(signal.SIGKILL)
            sidecar.wait()
            target = pool.alloc(4 * pool.page_size)
            before = read_pages(pool, target)
            assert backend.batch_get_v1(keys, target) == [False] * 4
            assert_equal_pages(read_pages(pool, target), before)
            assert backend.batch_exists(keys) == 0
            assert backend.batch_set_v1(hashes(4, seed="c"), indices) == [False] * 4
    finally:
        sidecar.stop()
