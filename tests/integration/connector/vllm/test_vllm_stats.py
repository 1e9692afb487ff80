"""lmtier's counters inside vLLM (lmtier_connector.vllm.stats): what a worker moved
comes out of ``get_kv_connector_stats``, sums over workers and steps as vLLM sums it,
lands on real Prometheus counters through ``build_prom_metrics``, and lmtier's log
records go through vLLM's handler. The live lane reads the same counters off a real
``vllm serve``'s ``/metrics`` (tests/live)."""

from __future__ import annotations

import importlib.util
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from lmtier_connector.vllm.connector import LMTierConnector
    from lmtier_connector.vllm.stats import (
        COUNTERS,
        LMTierConnectorStats,
        route_logs_to_vllm,
    )
    from support.vllm_helpers import (
        PREFIX,
        Engine,
        drain_finished,
        finish,
        lmtier_overrides,
        make_vllm_config,
    )

PROMPT = PREFIX[:200]  # three 64-token chunks and 8 tokens


def summed(engine: Engine) -> LMTierConnectorStats:
    """What vLLM sums: the stats of every step so far, and what the worker has now."""
    total = LMTierConnectorStats()
    for stats in [*engine.stats_seen, engine.worker.get_kv_connector_stats()]:
        if stats is not None:
            total.aggregate(stats)
    return total


def test_a_worker_counts_its_saves_and_its_loads_by_tier_and_path(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    writer = Engine(make_vllm_config(model_dir, {"config": lmtier_overrides(tmp_path)}))
    engines.append(writer)
    writer.add("w", PROMPT)
    writer.run_step()
    finish(writer, "w")
    assert drain_finished(writer, {"w"}) == {"w"}
    saved = summed(writer)
    assert saved.count("saved_chunks") == 3 and saved.count("save_dropped_chunks") == 0
    assert writer.worker.get_kv_connector_stats() is None  # taken: nothing since
    assert writer.connector.get_kv_connector_stats() is None  # the scheduler moves nothing
    writer.connector.lmtier.flush()

    config = lmtier_overrides(tmp_path, cpu={"enabled": False})
    for mode, path in (("never", "sync"), ("always", "async")):
        reader = Engine(make_vllm_config(model_dir, {"config": config, "async_loads": mode}))
        engines.append(reader)
        reader.add("r", [*PROMPT, 1])
        for _ in range(20):
            reader.worker._work().loader.wait()
            out, _ = reader.run_step()
            if "r" in out.num_scheduled_tokens:
                break
        total = summed(reader)
        assert total.count("loaded_chunks", "disk", path) == 3
        per_token = reader.worker.lmtier.kv_spec.bytes_per_token
        assert total.count("loaded_bytes", "disk") == 3 * 64 * per_token
        assert total.count("read_bytes", "disk") == total.count("loaded_bytes", "disk")
        assert total.count("load_seconds", path) > 0
        assert total.count("load_failed_chunks") == 0
        reduced = total.reduce()
        assert reduced["loaded_chunks"] == 3 and reduced["load_MiB_per_s"] > 0


def test_counters_reach_prometheus_with_vllms_engine_labels(model_dir: Path) -> None:
    registry = CollectorRegistry()

    class RegistryCounter(Counter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, registry=registry, **kwargs)

    types: dict[type, type] = {Counter: RegistryCounter, Gauge: Gauge, Histogram: Histogram}
    config = make_vllm_config(model_dir, {})
    metrics = LMTierConnector.build_prom_metrics(
        config, types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    stats = LMTierConnector.build_kv_connector_stats({"loaded_chunks|disk|sync": 3})
    stats.aggregate(LMTierConnectorStats({"loaded_chunks|disk|sync": 2, "saved_chunks": 4}))
    metrics.observe(stats.to_dict(), engine_idx=0)
    labels = {"model_name": "m", "engine": "0"}
    sample = registry.get_sample_value
    assert sample("lmtier:loaded_chunks_total", {**labels, "tier": "disk", "mode": "sync"}) == 5
    assert sample("lmtier:saved_chunks_total", labels) == 4
    assert {f"lmtier:{name}" for name in COUNTERS} <= {m.name for m in registry.collect()}


def test_lmtier_logs_through_vllms_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm_logger = logging.getLogger("vllm")
    handler = logging.StreamHandler()
    monkeypatch.setattr(vllm_logger, "handlers", [handler])
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # no logging of the app's own
    for name in ("lmtier", "lmtier_backends", "lmtier_connector"):
        target = logging.getLogger(name)
        monkeypatch.setattr(target, "handlers", [])
        monkeypatch.setattr(target, "propagate", True)
        monkeypatch.setattr(target, "level", logging.NOTSET)
    route_logs_to_vllm()
    route_logs_to_vllm()  # idempotent
    for name in ("lmtier", "lmtier_backends", "lmtier_connector"):
        target = logging.getLogger(name)
        assert target.handlers == [handler] and not target.propagate
        assert target.level == vllm_logger.level


def test_an_application_that_configured_logging_keeps_lmtiers_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    monkeypatch.setattr(logging.getLogger("lmtier"), "handlers", [])
    route_logs_to_vllm()
    assert logging.getLogger("lmtier").handlers == []
