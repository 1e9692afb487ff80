"""lmtier as SGLang's HiCache storage backend, against SGLang 0.5.23's real classes:
its ``StorageBackendFactory`` with ``dynamic``, its MHA and MLA host pools on the CPU
in every layout lmtier stores, its failure injector; an embedded lmtier cache (CPU
and disk tiers).

Pages go through the zero-copy path (``batch_set_v1`` / ``batch_get_v1``) and the
older flat-page API, and come back bit for bit; a page of one model, geometry, dtype,
page size or rank is never served to another; bad input is a miss, never an
exception into SGLang's threads.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.sglang, pytest.mark.integration]

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (.ci/run's SGLang lane)", allow_module_level=True)

with warnings.catch_warnings():  # SGLang's imports warn (torch.jit, CUDA-only kernels)
    warnings.simplefilter("ignore")
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.observability.metrics_collector import StorageMetrics

    from lmtier.errors import ConfigError
    from lmtier_connector.sglang import LMTierStorage
    from lmtier_connector.sglang.pages import PoolPages
    from support.sglang_pools import (
        assert_equal_pages,
        assert_same_kv,
        attach,
        attached,
        fill_pages,
        hashes,
        mha_pool,
        mla_pool,
        read_pages,
        storage_config,
    )

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def extra(tmp_path: Path, **more: Any) -> dict[str, Any]:
    """lmtier's keys: a small CPU tier and a disk tier of this test's own."""
    config = {"cpu": {"capacity_bytes": "4MiB"}, "disk": {"path": str(tmp_path / "disk")}}
    return {"config": config, **more}


def pool_of(kind: str, layout: str, **kw: Any) -> Any:
    return mha_pool(layout, **kw) if kind == "mha" else mla_pool(layout, **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_pages_round_trip_bit_exact_through_the_zero_copy_path(
    tmp_path: Path, kind: str, layout: str
) -> None:
    pool = pool_of(kind, layout)
    config = storage_config(extra(tmp_path), mla=kind == "mla", layout=layout)
    with attached(config, pool) as backend:
        assert isinstance(backend, LMTierStorage)
        keys = hashes(5)
        indices, pages = fill_pages(pool, 5, seed=1)
        view = PoolPages.of(pool)  # lmtier's view of a page is SGLang's page, reordered
        first = int(indices[0])
        assert torch.equal(view.page(first), view.flat(pool.get_data_page(first, flat=True)))
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1(keys, indices) == [True] * 5
        assert backend.batch_exists(keys) == 5
        assert backend.batch_exists([*keys[:3], "f" * 64, keys[4]]) == 3  # the leading run
        # into other pages of the same pool
        elsewhere = pool.alloc(5 * pool.page_size)
        assert backend.batch_get_v1(keys, elsewhere) == [True] * 5
        assert_equal_pages(read_pages(pool, elsewhere), pages)
        # a missing page ends the run: it and the pages after it are not loaded
        again = pool.alloc(3 * pool.page_size)
        before = read_pages(pool, again)
        assert backend.batch_get_v1([keys[0], "e" * 64, keys[2]], again) == [True, False, False]
        after = read_pages(pool, again)
        assert_equal_pages(after[:1], pages[:1])
        assert_equal_pages(after[1:], before[1:])  # untouched


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize(
    ("written", "read", "shared"),
    [
        ("page_first_direct", "layer_first", True),  # both keep pages layer-major
        ("layer_first", "page_first_direct", True),
        ("page_first", "page_first", True),
        ("page_first", "layer_first", False),  # token-major pages are keyed apart
        ("layer_first", "page_first", False),
    ],
)
def test_servers_whose_layouts_keep_one_page_order_share_pages(
    tmp_path: Path, kind: str, written: str, read: str, shared: bool
) -> None:
    """Pages are stored in the order of the writer's pool: a server whose pool keeps
    the same order loads them byte for byte (from disk: a new process's cache); one
    whose pool keeps another order never finds them."""
    writer_pool = pool_of(kind, written)
    keys = hashes(4)
    config = storage_config(extra(tmp_path), mla=kind == "mla", layout=written)
    with attached(config, writer_pool) as writer:
        indices, pages = fill_pages(writer_pool, 4, seed=2)
        assert all(writer.batch_set_v1(keys, indices))
    reader_pool = pool_of(kind, read)
    config = storage_config(extra(tmp_path), mla=kind == "mla", layout=read)
    with attached(config, reader_pool) as reader:
        target = reader_pool.alloc(4 * reader_pool.page_size)
        before = read_pages(reader_pool, target)
        assert reader.batch_exists(keys) == (4 if shared else 0)
        assert reader.batch_get_v1(keys, target) == [shared] * 4
        if shared:  # each pool's flat pages are in its own layout's order
            assert_same_kv(reader_pool, read_pages(reader_pool, target), writer_pool, pages)
        else:
            assert_equal_pages(read_pages(reader_pool, target), before)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_flat_page_api_reads_and_writes_the_same_pages(tmp_path: Path, layout: str) -> None:
    pool = mha_pool(layout)
    with attached(storage_config(extra(tmp_path), layout=layout), pool) as backend:
        keys = hashes(3)
        _, pages = fill_pages(pool, 3, seed=3)
        assert backend.batch_set(keys, pages) is True  # SGLang's get_data_page copies
        assert backend.exists(keys[0]) and not backend.exists("0" * 64)
        targets = [pool.get_dummy_flat_data_page() for _ in keys]
        got = backend.batch_get(keys, targets)
        assert all(g is t for g, t in zip(got, targets, strict=True))  # filled in place
        assert_equal_pages(targets, pages)
        # v1 reads what the flat API wrote, and the reverse
        target = pool.alloc(3 * pool.page_size)
        assert backend.batch_get_v1(keys, target) == [True] * 3
        assert_equal_pages(read_pages(pool, target), pages)
        more = hashes(2, seed="b")
        more_indices, more_pages = fill_pages(pool, 2, seed=4)
        assert all(backend.batch_set_v1(more, more_indices))
        one = pool.get_dummy_flat_data_page()
        assert backend.get(more[1], one) is one
        assert_equal_pages([one], more_pages[1:])
        assert backend.get("1" * 64, pool.get_dummy_flat_data_page()) is None
        assert backend.set(more[0], more_pages[0]) is True  # held already: stored
        assert backend.batch_get(["2" * 64, keys[0]], None) == [None, None]


def test_a_page_is_never_served_to_another_model_geometry_dtype_page_size_or_rank(
    tmp_path: Path,
) -> None:
    keys = hashes(2)
    pool = mha_pool("page_first")
    with attached(storage_config(extra(tmp_path)), pool) as backend:
        indices, _ = fill_pages(pool, 2, seed=5)
        assert all(backend.batch_set_v1(keys, indices))
    others: list[tuple[str, Any, Any]] = [
        ("another model", storage_config(extra(tmp_path), model="org/b"), mha_pool("page_first")),
        ("another revision", storage_config(extra(tmp_path, model_revision="r2")), None),
        ("another tenant", storage_config(extra(tmp_path, cache_salt="s")), None),
        ("another dtype", None, mha_pool("page_first", dtype=torch.float16)),
        ("more heads", None, mha_pool("page_first", heads=4)),
        ("another page size", None, mha_pool("page_first", page=32)),
        ("another TP rank", storage_config(extra(tmp_path), tp_rank=1, tp_size=2), None),
        ("an MLA pool", storage_config(extra(tmp_path), mla=True), mla_pool("page_first")),
    ]
    for what, given_config, given_pool in others:
        config = given_config or storage_config(extra(tmp_path))
        other_pool = given_pool or mha_pool("page_first")
        with attached(config, other_pool) as other:
            target = other_pool.alloc(2 * other_pool.page_size)
            assert other.batch_exists(keys) == 0, what
            assert other.batch_get_v1(keys, target) == [False, False], what
    # the same model on the same rank does find them
    with attached(storage_config(extra(tmp_path)), mha_pool("page_first")) as same:
        assert same.batch_exists(keys) == 2


def test_an_mla_page_is_shared_by_every_tp_rank(tmp_path: Path) -> None:
    keys = hashes(2)
    pool = mla_pool("page_first")
    with attached(storage_config(extra(tmp_path), mla=True, tp_size=2), pool) as rank0:
        indices, pages = fill_pages(pool, 2, seed=6)
        assert all(rank0.batch_set_v1(keys, indices))
    other = mla_pool("page_first")
    config = storage_config(extra(tmp_path), mla=True, tp_rank=1, tp_size=2)
    with attached(config, other) as rank1:
        target = other.alloc(2 * other.page_size)
        assert rank1.batch_get_v1(keys, target) == [True, True]
        assert_equal_pages(read_pages(other, target), pages)


def test_a_layout_lmtier_does_not_store_is_refused_at_attach_naming_those_it_does(
    tmp_path: Path,
) -> None:
    pool = mha_pool("page_head")  # heads before tokens: split across TP ranks by SGLang
    with pytest.raises(ConfigError, match=r"layer_first.*page_first.*page_first_direct"):
        attach(storage_config(extra(tmp_path), layout="page_head"), pool)


def test_a_hybrid_model_is_refused_at_attach_naming_its_pools(tmp_path: Path) -> None:
    pool = mha_pool("page_first")
    backend = attach(storage_config(extra(tmp_path)), pool)
    try:
        with pytest.raises(ConfigError, match=r"mamba pool.*hybrid models are not supported"):
            backend.register_mem_host_pool_v2(object(), PoolName.MAMBA)
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("extra_keys", "more", "message"),
    [
        ({"confg": {}}, {}, "unknown hicache-storage-backend-extra-config keys \\['confg'\\]"),
        ({"config": 3}, {}, "config must be a mapping"),
        ({"model_id": 7}, {}, "model_id must be a str"),
        ({"sidecar_token": "t"}, {}, "need 'sidecar'"),
        ({"config": {"cpu": {"capacity_bytes": "lots"}}}, {}, "capacity_bytes"),
        ({}, {"pp_size": 2}, "pp_size=2"),
    ],
)
def test_bad_settings_fail_the_attach_with_one_line(
    tmp_path: Path, extra_keys: dict[str, Any], more: dict[str, Any], message: str
) -> None:
    with pytest.raises((ConfigError, ValueError), match=message) as raised:
        attach(storage_config(extra_keys, **more), mha_pool("page_first"))
    assert "\n" not in str(raised.value)


def test_a_page_size_lmtier_cannot_chunk_is_refused_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--page-size 64"):
        attach(storage_config(extra(tmp_path)), mha_pool("page_first", page=4))


def test_bad_host_indices_are_misses_not_exceptions(tmp_path: Path) -> None:
    pool = mha_pool("page_first")
    with attached(storage_config(extra(tmp_path)), pool) as backend:
        keys = hashes(2)
        indices, _ = fill_pages(pool, 2, seed=7)
        assert all(backend.batch_set_v1(keys, indices))
        size = pool.page_size
        bad = [
            indices[:size],  # too few for two pages
            indices + 1,  # not page-aligned
            torch.flip(indices, [0]),  # pages backwards
            torch.full_like(indices, 10**9),  # beyond the pool
        ]
        for wrong in bad:
            assert backend.batch_get_v1(keys, wrong) == [False, False]
            assert backend.batch_set_v1(hashes(2, seed="z"), wrong) == [False, False]
        assert backend.batch_exists(hashes(2, seed="z")) == 0
        assert backend.batch_get([keys[0]], [torch.zeros(3)]) == [None]  # not a page
        assert backend.batch_set([keys[0]], [torch.zeros(3)]) is False
        assert backend.batch_set(keys, None) is False


def test_sglang_failure_injector_failures_are_misses_never_wrong_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's HiCacheStorageFailureInjector around lmtier's backend: every call it
    fails is reported as a miss; every page reported loaded is the page stored."""
    keys = hashes(16)
    pool = mha_pool("page_first")
    with attached(storage_config(extra(tmp_path)), pool) as backend:
        indices, pages = fill_pages(pool, 16, seed=8)
        assert all(backend.batch_set_v1(keys, indices))
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.5")
    reader_pool = mha_pool("page_first")
    with attached(storage_config(extra(tmp_path)), reader_pool) as flaky:
        assert type(flaky).__name__ == "HiCacheStorageFailureInjector"
        outcomes = []
        for _ in range(12):
            target = reader_pool.alloc(4 * reader_pool.page_size)
            start = len(outcomes) % 4 * 4
            got = flaky.batch_get_v1(keys[start : start + 4], target)
            outcomes.append(all(got))
            assert got in ([False] * 4, [True] * 4)
            if all(got):
                assert_equal_pages(read_pages(reader_pool, target), pages[start : start + 4])
            reader_pool.free(target)
        assert 0 <= flaky.batch_exists(keys) <= 16
    assert True in outcomes and False in outcomes  # p=0.5, 12 draws: both, ~1 - 2^-11


def test_stats_are_sglangs_storage_metrics_since_the_last_call(tmp_path: Path) -> None:
    pool = mha_pool("page_first")
    with attached(storage_config(extra(tmp_path), metrics=True), pool) as backend:
        keys = hashes(3)
        indices, _ = fill_pages(pool, 3, seed=9)
        backend.batch_set_v1(keys, indices)
        backend.batch_get_v1(keys, pool.alloc(3 * pool.page_size))
        stats = backend.get_stats()
        assert isinstance(stats, StorageMetrics)
        assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
        assert len(stats.backup_bandwidth) == len(stats.prefetch_bandwidth) == 1
        assert backend.get_stats().prefetch_pgs == []  # deltas: taken once
        assert backend.lmtier_stats()["cpu"]["puts"] >= 3
    with attached(storage_config(extra(tmp_path)), mha_pool("page_first")) as quiet:
        assert quiet.get_stats() is None  # without --enable-metrics


def test_clear_deletes_this_servers_pages_only(tmp_path: Path) -> None:
    pool = mha_pool("page_first")
    keys = hashes(2)
    with attached(storage_config(extra(tmp_path, cache_salt="other")), mha_pool("page_first")) as b:
        other_pool = b.mem_pool_host
        indices, _ = fill_pages(other_pool, 2, seed=10)
        assert all(b.batch_set_v1(keys, indices))
    with attached(storage_config(extra(tmp_path)), pool) as backend:
        indices, _ = fill_pages(pool, 2, seed=11)
        assert all(backend.batch_set_v1(keys, indices))
        backend.clear()
        assert backend.batch_exists(keys) == 0
    with attached(storage_config(extra(tmp_path, cache_salt="other")), mha_pool("page_first")) as b:
        assert b.batch_exists(keys) == 2


def test_prefetch_and_backup_threads_at_once_get_their_own_pages(tmp_path: Path) -> None:
    """SGLang calls a backend from its prefetch and backup threads at once."""
    import threading

    pool = mha_pool("page_first")
    with attached(storage_config(extra(tmp_path)), pool) as backend:
        held = hashes(4)
        indices, pages = fill_pages(pool, 4, seed=12)
        assert all(backend.batch_set_v1(held, indices))
        more, _ = fill_pages(pool, 2, seed=13)
        targets = [pool.alloc(4 * pool.page_size) for _ in range(3)]
        failures: list[str] = []

        def backup() -> None:
            for round_ in range(20):
                if not all(backend.batch_set_v1(hashes(2, seed=f"t{round_}"), more)):
                    failures.append(f"backup {round_}")

        def prefetch(target: torch.Tensor) -> None:
            for round_ in range(20):
                if backend.batch_get_v1(held, target) != [True] * 4:
                    failures.append(f"prefetch {round_}")

        threads = [threading.Thread(target=backup)]
        threads += [threading.Thread(target=prefetch, args=(t,)) for t in targets]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)  # a hang, not a speed check
        assert not any(thread.is_alive() for thread in threads)
        assert failures == []
        for target in targets:
            assert_equal_pages(read_pages(pool, target), pages)
