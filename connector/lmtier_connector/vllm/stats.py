"""lmtier's counters inside vLLM: its connector stats, its Prometheus metrics and its
log records.

The workers count what they move (:class:`StepCounters`: chunks loaded by tier and
path, bytes, seconds, chunks that could not be loaded, chunks saved and dropped); vLLM
takes them every step (``get_kv_connector_stats``), sums them over its workers and
steps (:class:`LMTierConnectorStats`, a flat dict that crosses its processes as it
is), logs them with its throughput line ("KV Transfer metrics: ...") and hands them
to :class:`LMTierPromMetrics`, which counts them on vLLM's own ``/metrics`` as
``lmtier:*_total`` with vLLM's engine labels.

:func:`route_logs_to_vllm` gives lmtier's loggers vLLM's handler, so the connector's
and the tiers' warnings (a tier down, a failed save) appear in vLLM's log, formatted
as vLLM's own, in every vLLM process.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

__all__ = [
    "COUNTERS",
    "LMTierConnectorStats",
    "LMTierPromMetrics",
    "StepCounters",
    "route_logs_to_vllm",
]

COUNTERS: dict[str, tuple[tuple[str, ...], str]] = {
    "loaded_chunks": (("tier", "mode"), "Chunks loaded into vLLM's KV pages, by tier and path"),
    "loaded_bytes": (("tier",), "Bytes of chunks loaded into vLLM's KV pages, by tier"),
    "load_seconds": (("mode",), "Seconds spent loading (read and scatter), by path"),
    "read_bytes": (("tier",), "Bytes read from the tiers, by the tier serving most of each read"),
    "read_seconds": (("tier",), "Seconds reading from the tiers, by the tier serving most of each"),
    "load_failed_chunks": ((), "Chunks a load could not serve (vLLM recomputes them)"),
    "saved_chunks": ((), "Chunks saved from vLLM's KV pages into lmtier's tiers"),
    "save_dropped_chunks": ((), "Chunks not saved: no free host slab (the pool was busy)"),
    "save_failed_steps": ((), "Steps whose saves failed (logged; nothing stored)"),
}
"""Each counter's labels (beyond vLLM's engine labels) and help. In the stats dict a
counter is ``name`` or ``name|label value|...`` (flat keys cross vLLM's IPC as is)."""

_LOGGER_NAMES = ("lmtier", "lmtier_backends", "lmtier_connector")


def _key(name: str, labels: tuple[str, ...]) -> str:
    if len(labels) != len(COUNTERS[name][0]):
        raise ValueError(f"counter {name} takes labels {COUNTERS[name][0]}, got {labels}")
    return "|".join((name, *labels))


@dataclass
class LMTierConnectorStats(KVConnectorStats):
    """Counters summed over vLLM's workers and steps (module docstring)."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> LMTierConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """What vLLM's periodic log line shows: totals per counter and a load rate."""
        totals: dict[str, float] = {}
        for key, value in self.data.items():
            name = key.split("|", 1)[0]
            totals[name] = totals.get(name, 0) + value
        seconds = totals.get("load_seconds", 0.0)
        reduced: dict[str, int | float] = {
            name: round(value, 4) if name == "load_seconds" else int(value)
            for name, value in totals.items()
        }
        if seconds > 0:
            reduced["load_MiB_per_s"] = round(totals.get("loaded_bytes", 0) / seconds / 2**20, 1)
        return reduced

    def is_empty(self) -> bool:
        return not self.data

    def count(self, name: str, *labels: str) -> float:
        """One counter's value (0 when never counted)."""
        return float(self.data.get(_key(name, labels), 0))


class StepCounters:
    """What a worker moved since vLLM last asked, counted from several threads (the
    step's, the loader's and the save thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = {}

    def add(self, name: str, value: float = 1, *labels: str) -> None:
        key = _key(name, labels)
        with self._lock:
            self._data[key] = self._data.get(key, 0) + value

    def take(self) -> LMTierConnectorStats | None:
        """The counts since the last call (None if nothing moved)."""
        with self._lock:
            data, self._data = self._data, {}
        return LMTierConnectorStats(data) if data else None


class LMTierPromMetrics(KVConnectorPromMetrics):
    """lmtier's counters on vLLM's ``/metrics`` (``lmtier:<counter>_total``), labelled
    with vLLM's engine labels and each counter's own (:data:`COUNTERS`)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM's counter class (multiprocess-aware under its API server's workers).
        self._metrics: dict[str, Any] = {
            name: self._counter_cls(
                name=f"lmtier:{name}",
                documentation=help_text,
                labelnames=[*labelnames, *labels],
            )
            for name, (labels, help_text) in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for key, value in transfer_stats_data.items():
            name, *labels = key.split("|")
            metric = self._metrics.get(name)
            if metric is not None and value > 0:
                metric.labels(*engine, *labels).inc(value)


def route_logs_to_vllm() -> None:
    """Hand lmtier's log records to vLLM's handler, at vLLM's level, where the
    application configured no logging of its own (no handler on the root logger or
    on lmtier's): otherwise lmtier's INFO records are dropped and its warnings reach
    stderr unformatted, through logging's last resort. Idempotent."""
    if logging.getLogger().handlers:
        return  # the application configured logging: its handlers get lmtier's records
    source = logging.getLogger("vllm")
    if not source.handlers:
        return
    for name in _LOGGER_NAMES:
        target = logging.getLogger(name)
        if target.handlers:
            continue
        for handler in source.handlers:
            target.addHandler(handler)
        target.setLevel(source.level)
        target.propagate = False
