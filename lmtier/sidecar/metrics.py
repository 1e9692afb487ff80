"""The sidecar's Prometheus metrics: its calls, its own gauges, and every tier's stats.

Names follow Prometheus conventions: prefix ``lmtier_``, ``_total`` on counters,
units in the name (``_seconds``, ``_bytes``), labels ``tier``, ``method`` and ``code``.

Call metrics are ordinary prometheus_client objects updated per call. Tier stats are
*not* copied into prometheus_client objects as they change: a custom collector reads
the live :class:`~lmtier.storage.stats.TierStats` at scrape time, so the hot path pays
nothing for metrics and a scrape always sees current values. Their power-of-two
microsecond latency buckets become real Prometheus histograms (cumulative ``le``
buckets in seconds, ``_sum``, ``_count``).

The HTTP endpoint itself, bounded against hostile connections, is :mod:`.scrape`.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import fields
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from lmtier.errors import ConfigError
from lmtier.sidecar.scrape import MetricsServer, serve_metrics
from lmtier.storage.stats import LatencyHistogram, TierStats
from lmtier.wire.address import parse_listen

__all__ = ["MetricsServer", "SidecarMetrics", "TierSource", "ExtraSource", "GaugeSource"]

logger = logging.getLogger(__name__)

TierSource = Callable[[], Mapping[str, TierStats]]
"""Each tier's live stats, by tier name."""
ExtraSource = Callable[[], Mapping[str, Mapping[str, object]]]
"""More values per tier (``{"disk": {"queue_depth": 3}}``); the numeric ones become gauges."""
GaugeSource = Callable[[], Mapping[str, float]]
"""The sidecar's own values (``{"sessions": 2, "leases": 10}``), exported as gauges."""

# TierStats counter field -> metric name between ``lmtier_tier_`` and ``_total``, and
# its help. A counter TierStats gains later is exported under its own name (below).
_TIER_COUNTERS: dict[str, tuple[str, str]] = {
    "hits": ("hits", "Chunks served by reads."),
    "misses": ("misses", "Chunks asked of reads and not served (absent, corrupt or failed)."),
    "lookups": ("lookups", "Keys asked of lookups."),
    "bytes_read": ("read_bytes", "Bytes of chunks read."),
    "bytes_written": ("written_bytes", "Bytes of chunks written."),
    "puts": ("puts", "Chunks stored."),
    "errors": ("errors", "Failed calls: I/O errors, timeouts, refused connections."),
    "corrupt": ("corrupt", "Chunks that failed validation and were deleted."),
    "unservable": ("unservable", "Chunks present but impossible to serve, removed."),
    "evictions": ("evictions", "Chunks evicted to make room."),
    "queue_drops": (
        "queue_drops",
        "Background writes dropped: the queue stayed full past write_wait_s, or the tier was down.",
    ),
    "queue_waits": ("queue_waits", "Stores that waited for room in the full write queue."),
    "skipped": ("skipped", "Calls not made because the circuit breaker was open."),
    "pins_refused": ("pins_refused", "Pins refused because they would pass the tier's pin cap."),
}
_TIER_COUNTERS.update(
    {
        item.name: (item.name, f"TierStats.{item.name} of the tier.")
        for item in fields(TierStats)
        if item.type in (int, "int") and item.name not in _TIER_COUNTERS
    }
)
# TierStats histogram field -> metric name between ``lmtier_tier_`` and ``_seconds``.
_TIER_HISTOGRAMS: dict[str, tuple[str, str]] = {
    "read_latency": ("read_duration", "Latency of the tier's read calls."),
    "write_latency": ("write_duration", "Latency of the tier's write calls."),
    "lookup_latency": ("lookup_duration", "Latency of the tier's lookup calls."),
}
# Upper bounds (seconds) of LatencyHistogram.counts[0..24]; counts[25] is the overflow.
_LE_SECONDS: tuple[float, ...] = tuple((1 << i) / 1e6 for i in range(25))
# Per-call latency: sidecar calls run from ~50 us (a lookup) to seconds (a remote load).
_CALL_BUCKETS = (
    *(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1),
    *(0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_SIDECAR_OWN = frozenset({"requests", "request_duration_seconds", "metrics_source_errors"})
# What prometheus_client appends to a family's name in its samples.
_SAMPLE_SUFFIXES = ("_total", "_created", "_bucket", "_count", "_sum")


def _reserved_tier_names() -> frozenset[str]:
    """``extra`` names that would collide with (or repeat) the TierStats metrics."""
    names = {item.name for item in fields(TierStats)}
    names.update(base for base, _ in _TIER_COUNTERS.values())
    names.update(f"{base}_seconds" for base, _ in _TIER_HISTOGRAMS.values())
    return frozenset(names)


_RESERVED_TIER = _reserved_tier_names()


class SidecarMetrics:
    """The sidecar's metrics, in a registry of their own (several can live in one
    process, as tests need).

    :meth:`observe_call` records each call; :meth:`set_sources` names where tier stats
    and gauges are read at scrape time; :meth:`serve` exposes ``/metrics`` over HTTP.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._durations = Histogram(
            "lmtier_sidecar_request_duration_seconds",
            "Time to serve a sidecar call, by gRPC method.",
            ["method"],
            registry=self.registry,
            buckets=_CALL_BUCKETS,
        )
        self._requests = Counter(
            "lmtier_sidecar_requests_total",
            "Sidecar calls served, by gRPC method and status code.",
            ["method", "code"],
            registry=self.registry,
        )
        self._collector: _SourceCollector | None = None

    def observe_call(self, method: str, seconds: float, code: str) -> None:
        """Record one call: its duration under ``method``, its status ``code`` (``"OK"``,
        ``"NOT_FOUND"``...)."""
        self._durations.labels(method).observe(seconds)
        self._requests.labels(method, code).inc()

    def set_sources(self, tiers: TierSource, extra: ExtraSource, gauges: GaugeSource) -> None:
        """Read tier stats and gauges from these callables at every scrape.

        ``tiers()``: each tier's TierStats (counters and latency histograms).
        ``extra()``: more numeric values per tier, each a gauge
        ``lmtier_tier_<name>{tier}`` (``queue_depth``); names TierStats already covers
        and values that are not numbers are skipped, so ``StorageManager.stats()``
        entries can be passed as they are. ``gauges()``: the sidecar's own values, each
        ``lmtier_sidecar_<name>`` (``sessions``, ``leases``, ``slabs_in_use``, ...).

        They are called from the HTTP server's thread, concurrently with the sidecar's
        event loop: each must return a snapshot that is safe to take from another
        thread (plain reads of ints, a copy made under the lock that guards the data),
        and must not block. A source that raises costs only its own metrics: it is
        logged at DEBUG and counted in ``lmtier_sidecar_metrics_source_errors_total``.
        Calling again replaces the sources.
        """
        if self._collector is None:
            self._collector = _SourceCollector(tiers, extra, gauges)
            self.registry.register(self._collector)
        else:
            self._collector.sources = (tiers, extra, gauges)

    def serve(self, listen: str) -> MetricsServer:
        """Serve ``/metrics`` over HTTP on ``listen`` (``host:port``; port 0: any free
        port, read it from :attr:`MetricsServer.port`). Raises ConfigError if the
        address is not ``host:port`` or cannot be bound."""
        key = "sidecar.metrics_listen"
        address = parse_listen(listen, key=key)
        if address.kind != "tcp":
            raise ConfigError(f"{key}: Prometheus scrapes over TCP; give host:port", key=key)
        try:
            return serve_metrics(address.host, address.port, self.registry)
        except OSError as exc:
            raise ConfigError(
                f"{key}: cannot listen on {address}: {exc.strerror or exc}", key=key
            ) from None


class _SourceCollector:
    """Builds the tier and gauge metric families from the sources at each scrape."""

    def __init__(self, tiers: TierSource, extra: ExtraSource, gauges: GaugeSource) -> None:
        self.sources = (tiers, extra, gauges)
        self._lock = threading.Lock()  # scrapes run in concurrent server threads
        self._errors = 0

    def describe(self) -> Iterable[Metric]:
        """Nothing: the names depend on the sources, and registering must not call them."""
        return []

    def collect(self) -> Iterator[Metric]:
        tiers, extra, gauges = self.sources
        yield from self._tier_metrics(self._call(tiers, "tiers"))
        yield from self._extra_metrics(self._call(extra, "extra"))
        yield from self._gauge_metrics(self._call(gauges, "gauges"))
        errors = CounterMetricFamily(
            "lmtier_sidecar_metrics_source_errors",
            "Metric sources that raised during a scrape (their metrics were left out).",
        )
        errors.add_metric([], self._errors)
        yield errors

    def _call(self, source: Callable[[], Mapping[str, Any]], what: str) -> Mapping[str, Any]:
        try:
            return dict(source())
        except Exception:
            self._failed("the %s metrics source raised", what)
            return {}

    def _failed(self, message: str, *args: object) -> None:
        with self._lock:
            self._errors += 1
        logger.debug(message, *args, exc_info=True)

    def _tier_metrics(self, tiers: Mapping[str, TierStats]) -> Iterator[Metric]:
        counters = {
            field: CounterMetricFamily(f"lmtier_tier_{base}", doc, labels=["tier"])
            for field, (base, doc) in _TIER_COUNTERS.items()
        }
        histograms = {
            field: HistogramMetricFamily(f"lmtier_tier_{base}_seconds", doc, labels=["tier"])
            for field, (base, doc) in _TIER_HISTOGRAMS.items()
        }
        for tier, stats in tiers.items():
            try:
                for field, family in counters.items():
                    family.add_metric([str(tier)], float(getattr(stats, field)))
                for field, histogram in histograms.items():
                    buckets, total = _buckets(getattr(stats, field))
                    histogram.add_metric([str(tier)], buckets, total)
            except Exception:
                self._failed("the stats of tier %r could not be exported", tier)
        yield from counters.values()
        yield from histograms.values()

    def _extra_metrics(self, extra: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
        families: dict[str, GaugeMetricFamily] = {}
        for tier, values in extra.items():
            try:
                for name, value in dict(values).items():
                    if not _exportable(name, value, _RESERVED_TIER):
                        continue
                    family = families.get(name)
                    if family is None:
                        family = GaugeMetricFamily(
                            f"lmtier_tier_{name}", f"The tier's {name}.", labels=["tier"]
                        )
                        families[name] = family
                    family.add_metric([str(tier)], float(value))
            except Exception:
                self._failed("the extra values of tier %r could not be exported", tier)
        yield from families.values()

    def _gauge_metrics(self, gauges: Mapping[str, Any]) -> Iterator[Metric]:
        for name, value in gauges.items():
            if _exportable(name, value, _SIDECAR_OWN):
                yield GaugeMetricFamily(
                    f"lmtier_sidecar_{name}", f"The sidecar's {name}.", value=float(value)
                )


def _exportable(name: object, value: object, reserved: frozenset[str]) -> bool:
    """Whether ``name`` makes a valid metric name that no other family claims (nor any
    of its samples) and ``value`` is a number."""
    if not isinstance(name, str) or not _NAME.match(name) or name in reserved:
        return False
    for suffix in _SAMPLE_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in reserved:
            return False
    return isinstance(value, (int, float))


def _buckets(histogram: LatencyHistogram) -> tuple[list[tuple[str, float]], float]:
    """Cumulative Prometheus buckets (``le`` in seconds) and the sum of a
    LatencyHistogram. ``+Inf`` is the sum of the counts rather than ``num``, so the
    histogram stays consistent when a racing increment was lost."""
    counts = list(histogram.counts)  # one copy: the loop thread may be recording
    buckets: list[tuple[str, float]] = []
    seen = 0
    for upper, count in zip(_LE_SECONDS, counts[:-1], strict=True):  # [-1]: overflow
        seen += count
        buckets.append((repr(upper), float(seen)))
    buckets.append(("+Inf", float(sum(counts))))
    return buckets, float(histogram.total_s)
