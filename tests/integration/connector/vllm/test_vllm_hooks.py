"""LMTierConnector's answers to the hooks vLLM's scheduler asks connectors (0.34's
included; each is never called by a vLLM that lacks it), under vLLM's real Scheduler
with real CPU and disk tiers: where an external hit came from (by tier), whether a
request may load asynchronously (``--max-num-inflight-kv-loads``), lookahead block
hashes, how the workers reach the KV cache, and KV delivery on preemption."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.config import KVTransferConfig, SchedulerConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.metrics.stats import PrefixCacheStats
    from vllm.v1.request import RequestStatus

    from lmtier_connector.vllm.connector import LMTierConnector
    from support.vllm_helpers import (
        PREFIX,
        Engine,
        drain_finished,
        finish,
        lmtier_overrides,
        make_vllm_config,
    )

HOST, DISK = CacheHitSource.HOST, CacheHitSource.DISK
PROMPT = PREFIX[:200]  # three 64-token chunks and 8 tokens
INFLIGHT_LOADS = "max_num_inflight_kv_loads" in SchedulerConfig.__dataclass_fields__
"""vLLM >= 0.34: ``--max-num-inflight-kv-loads`` and ``may_load_async``."""


def engine(engines: list[Engine], model_dir: Path, config: dict[str, Any], **extra: Any) -> Engine:
    """An engine whose ``auto`` loads every hit below host memory in the background (a
    zero read budget; test_vllm_load_paths.py tests the budget)."""
    extra.setdefault("sync_load_max_ms", 0)
    made = Engine(make_vllm_config(model_dir, {"config": config, **extra}))
    engines.append(made)
    return made


def save(writer: Engine, req_id: str, tokens: list[int]) -> None:
    """``writer`` computes ``tokens`` and stores their whole chunks (CPU and disk)."""
    writer.add(req_id, tokens)
    for _ in range(20):
        writer.worker._work().loader.wait()
        out, _ = writer.run_step()
        if req_id in out.num_scheduled_tokens:
            break
    finish(writer, req_id)
    assert drain_finished(writer, {req_id}) == {req_id}
    writer.connector.lmtier.flush()


def reader_config(tmp_path: Path) -> dict[str, Any]:
    """Another cache (its own, empty CPU tier) over the same disk tier."""
    return lmtier_overrides(tmp_path, cpu={"capacity_bytes": "32MiB"})


# ---- hit sources --------------------------------------------------------------------


def test_a_disk_hit_is_counted_as_disk_by_vllms_scheduler(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    save(engine(engines, model_dir, lmtier_overrides(tmp_path)), "w", PROMPT)
    reader = engine(engines, model_dir, reader_config(tmp_path))
    stats = reader.scheduler.connector_prefix_cache_stats = PrefixCacheStats()  # log_stats
    request = reader.add("b", [*PROMPT, 5])
    reader.run_step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert stats.hits == 192
    assert stats.hits_by_source == {DISK: 192}  # not "external_unspecified"


def test_a_hit_from_host_memory_and_disk_is_split_by_tier(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    # The reader stores two chunks (its CPU tier and the disk); the writer, with a
    # CPU tier of its own, stores the third on the disk.
    reader = engine(engines, model_dir, reader_config(tmp_path))
    save(reader, "r", PROMPT[:129])
    save(engine(engines, model_dir, lmtier_overrides(tmp_path)), "w", PROMPT)
    request = reader.add("b", [*PROMPT, 5])
    connector = reader.connector
    assert connector.get_num_new_matched_tokens(request, 16) == (176, True)
    assert connector.get_external_cache_hit_sources(request, 176) == {HOST: 112, DISK: 64}
    # vLLM asks once per hit; a request with no hit has no sources.
    assert connector.get_external_cache_hit_sources(request, 0) == {}


def test_a_host_memory_hit_is_counted_as_host(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    writer = engine(engines, model_dir, lmtier_overrides(tmp_path))
    save(writer, "w", PROMPT)
    request = writer.add("b", [*PROMPT, 5])
    assert writer.connector.get_num_new_matched_tokens(request, 0) == (192, False)
    assert writer.connector.get_external_cache_hit_sources(request, 192) == {HOST: 192}


# ---- asynchronous loads while the batch is full ------------------------------------


def test_may_load_async_follows_what_the_tiers_hold(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    writer = engine(engines, model_dir, lmtier_overrides(tmp_path))
    save(writer, "w", PROMPT)
    reader = engine(engines, model_dir, reader_config(tmp_path))
    on_disk = reader.add("b", [*PROMPT, 5])
    assert reader.connector.may_load_async(on_disk)  # a disk hit loads in the background
    assert not writer.connector.may_load_async(writer.add("c", [*PROMPT, 6]))  # host memory
    assert not reader.connector.may_load_async(reader.add("m", [9] * 200))  # a miss
    assert not reader.connector.may_load_async(reader.add("s", PROMPT[:64]))  # no chunk
    always = engine(engines, model_dir, lmtier_overrides(tmp_path), async_loads="always")
    assert always.connector.may_load_async(always.add("c", [*PROMPT, 6]))  # host memory
    never = engine(engines, model_dir, reader_config(tmp_path), async_loads="never")
    assert not never.connector.may_load_async(never.add("b", [*PROMPT, 5]))
    # With the default budget, 72 KiB from a disk is a short read: inside the step.
    budget = engine(engines, model_dir, reader_config(tmp_path), sync_load_max_ms=20)
    assert not budget.connector.may_load_async(budget.add("b", [*PROMPT, 5]))


@pytest.mark.skipif(not INFLIGHT_LOADS, reason="vLLM < 0.34: no --max-num-inflight-kv-loads")
def test_a_disk_hit_starts_loading_while_the_batch_is_full(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    save(engine(engines, model_dir, lmtier_overrides(tmp_path)), "w", PROMPT)
    extra = {"config": reader_config(tmp_path), "sync_load_max_ms": 0}
    config = make_vllm_config(model_dir, extra)
    config.scheduler_config.max_num_seqs = 1  # one running request fills the batch
    config.scheduler_config.max_num_inflight_kv_loads = 1
    reader = Engine(config)
    engines.append(reader)
    running = reader.add("x", [(i * 11 + 2) % 1000 for i in range(40)], max_tokens=50)
    reader.run_step()
    assert running.status == RequestStatus.RUNNING
    request = reader.add("b", [*PROMPT, 5])
    reader.run_step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # no running slot needed


# ---- configuration hooks -----------------------------------------------------------


def test_lookahead_block_hashes_need_vllms_block_hashes() -> None:
    def supports(extra: dict[str, Any]) -> bool:
        config = KVTransferConfig(
            kv_connector="LMTierConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )
        return LMTierConnector.supports_lookahead_block_hashes(config)

    assert supports({}) and supports({"vllm_block_hashes": True})
    assert not supports({"vllm_block_hashes": False})


def test_the_workers_reach_the_kv_cache_in_process(model_dir: Path, tmp_path: Path) -> None:
    kv_transfer = pytest.importorskip("vllm.config.kv_transfer")
    if not hasattr(kv_transfer, "KVCacheAccess"):
        pytest.skip("vLLM < 0.34: no KVCacheAccess")
    config = make_vllm_config(model_dir, {"config": lmtier_overrides(tmp_path)})
    transfer = config.kv_transfer_config
    assert transfer is not None
    assert transfer.kv_cache_access() == kv_transfer.KVCacheAccess.IN_PROCESS
    assert not transfer.registers_kv_cache_memory()


def test_a_preempted_request_keeps_its_output(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    made = engine(engines, model_dir, lmtier_overrides(tmp_path))
    assert made.scheduler.requires_kv_delivery is False  # a best-effort cache
