"""The sidecar's Prometheus metrics, scraped from the real HTTP endpoint."""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import fields

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from lmtier.errors import ConfigError
from lmtier.sidecar.metrics import MetricsServer, SidecarMetrics
from lmtier.storage.stats import TierStats


@pytest.fixture
def metrics() -> SidecarMetrics:
    return SidecarMetrics()


@pytest.fixture
def server(metrics: SidecarMetrics) -> Iterator[MetricsServer]:
    running = metrics.serve("127.0.0.1:0")
    yield running
    running.close()


def scrape(server: MetricsServer) -> dict[str, Sample]:
    """Every sample of one scrape, keyed ``name{label=value,...}`` (labels sorted)."""
    url = f"http://127.0.0.1:{server.port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    samples: dict[str, Sample] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            assert key not in samples, f"{key} exported twice"
            samples[key] = sample
    return samples


def types(server: MetricsServer) -> dict[str, str]:
    url = f"http://127.0.0.1:{server.port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    return {family.name: family.type for family in text_string_to_metric_families(text)}


def no_extra() -> Mapping[str, Mapping[str, float]]:
    return {}


def no_gauges() -> Mapping[str, float]:
    return {}


def test_calls_are_counted_and_timed(metrics: SidecarMetrics, server: MetricsServer) -> None:
    metrics.observe_call("Lookup", 0.002, "OK")
    metrics.observe_call("Lookup", 0.004, "OK")
    metrics.observe_call("Load", 1.5, "UNAVAILABLE")
    samples = scrape(server)
    assert samples["lmtier_sidecar_requests_total{code=OK,method=Lookup}"].value == 2
    assert samples["lmtier_sidecar_requests_total{code=UNAVAILABLE,method=Load}"].value == 1
    assert samples["lmtier_sidecar_request_duration_seconds_count{method=Lookup}"].value == 2
    assert samples["lmtier_sidecar_request_duration_seconds_sum{method=Lookup}"].value == (
        pytest.approx(0.006)
    )
    assert (
        samples["lmtier_sidecar_request_duration_seconds_bucket{le=0.0025,method=Lookup}"].value
        == 1
    )
    assert types(server)["lmtier_sidecar_request_duration_seconds"] == "histogram"


def test_registries_are_separate() -> None:
    first, second = SidecarMetrics(), SidecarMetrics()
    first.observe_call("Lookup", 0.1, "OK")
    assert (
        second.registry.get_sample_value(
            "lmtier_sidecar_requests_total", {"method": "Lookup", "code": "OK"}
        )
        is None
    )
    assert (
        first.registry.get_sample_value(
            "lmtier_sidecar_requests_total", {"method": "Lookup", "code": "OK"}
        )
        == 1
    )


def test_tier_stats_are_read_at_scrape_time(metrics: SidecarMetrics, server: MetricsServer) -> None:
    cpu, disk = TierStats(), TierStats()
    metrics.set_sources(lambda: {"cpu": cpu, "disk": disk}, no_extra, no_gauges)
    cpu.hits, cpu.bytes_read, disk.queue_drops, disk.skipped = 7, 4096, 2, 5
    samples = scrape(server)
    assert samples["lmtier_tier_hits_total{tier=cpu}"].value == 7
    assert samples["lmtier_tier_read_bytes_total{tier=cpu}"].value == 4096
    assert samples["lmtier_tier_hits_total{tier=disk}"].value == 0
    assert samples["lmtier_tier_queue_drops_total{tier=disk}"].value == 2
    assert samples["lmtier_tier_skipped_total{tier=disk}"].value == 5
    for name in ("misses", "lookups", "written_bytes", "puts", "errors", "corrupt"):
        assert f"lmtier_tier_{name}_total{{tier=cpu}}" in samples
    for name in ("unservable", "evictions"):
        assert f"lmtier_tier_{name}_total{{tier=disk}}" in samples
    counters = [f.name for f in fields(TierStats) if f.type in (int, "int")]
    exported = {k for k in samples if k.startswith("lmtier_tier_") and "_total{tier=cpu}" in k}
    assert len(exported) == len(counters)  # every counter, including ones added later
    cpu.hits = 8  # live: the next scrape sees it
    assert scrape(server)["lmtier_tier_hits_total{tier=cpu}"].value == 8
    assert types(server)["lmtier_tier_hits"] == "counter"


def test_pins_refused_is_a_counter_with_its_meaning(
    metrics: SidecarMetrics, server: MetricsServer
) -> None:
    disk = TierStats()
    disk.pins_refused = 3
    metrics.set_sources(lambda: {"disk": disk}, no_extra, no_gauges)
    assert scrape(server)["lmtier_tier_pins_refused_total{tier=disk}"].value == 3
    url = f"http://127.0.0.1:{server.port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    assert "# HELP lmtier_tier_pins_refused_total Pins refused because" in text


def test_latency_histograms_become_prometheus_histograms(
    metrics: SidecarMetrics, server: MetricsServer
) -> None:
    stats = TierStats()
    for seconds in (0.5e-6, 3e-6, 3e-6, 0.010, 100.0):  # 100 s: past the last bucket
        stats.read_latency.record(seconds)
    metrics.set_sources(lambda: {"redis": stats}, no_extra, no_gauges)
    samples = scrape(server)

    def bucket(le: str) -> float:
        return samples[f"lmtier_tier_read_duration_seconds_bucket{{le={le},tier=redis}}"].value

    assert bucket("1e-06") == 1
    assert bucket("2e-06") == 1
    assert bucket("4e-06") == 3
    assert bucket("0.008192") == 3
    assert bucket("0.016384") == 4
    assert bucket("16.777216") == 4
    assert bucket("+Inf") == 5
    les = [s.labels["le"] for k, s in samples.items() if "read_duration_seconds_bucket" in k]
    assert len(les) == 26  # 25 power-of-two bounds from 1 us, and +Inf
    assert samples["lmtier_tier_read_duration_seconds_count{tier=redis}"].value == 5
    assert samples["lmtier_tier_read_duration_seconds_sum{tier=redis}"].value == pytest.approx(
        100.0100065
    )
    assert samples["lmtier_tier_write_duration_seconds_count{tier=redis}"].value == 0
    assert samples["lmtier_tier_lookup_duration_seconds_bucket{le=+Inf,tier=redis}"].value == 0
    assert types(server)["lmtier_tier_read_duration_seconds"] == "histogram"


def test_extra_values_and_sidecar_gauges(metrics: SidecarMetrics, server: MetricsServer) -> None:
    extra = {
        "disk": {"queue_depth": 3, "breaker": "closed", "breaker_opens": 1, "hits": 99},
        "redis": {"queue_depth": 0.0, "read_latency": {"n": 1}, "bad name": 1},
    }
    gauges = {"sessions": 2, "leases": 10, "slabs_in_use": 4, "slabs_total": 64, "clients": 1}
    gauges |= {"requests": 5, "requests_total": 5}  # would clash with the call counter
    metrics.set_sources(lambda: {}, lambda: extra, lambda: gauges)
    samples = scrape(server)
    assert samples["lmtier_tier_queue_depth{tier=disk}"].value == 3
    assert samples["lmtier_tier_queue_depth{tier=redis}"].value == 0
    assert samples["lmtier_tier_breaker_opens{tier=disk}"].value == 1
    assert not any(key.startswith(("lmtier_tier_breaker{", "lmtier_tier_hits{")) for key in samples)
    assert not any("read_latency" in key or "bad" in key for key in samples)
    for name, value in gauges.items():
        if not name.startswith("requests"):
            assert samples[f"lmtier_sidecar_{name}"].value == value
    assert "lmtier_sidecar_requests" not in samples
    kinds = types(server)
    assert kinds["lmtier_tier_queue_depth"] == kinds["lmtier_sidecar_sessions"] == "gauge"


def test_a_failing_source_costs_only_its_own_metrics(
    metrics: SidecarMetrics, server: MetricsServer, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> Mapping[str, TierStats]:
        raise RuntimeError("source broke")

    metrics.set_sources(broken, lambda: {"cpu": {"queue_depth": 1}}, lambda: {"sessions": 3})
    with caplog.at_level(logging.DEBUG, logger="lmtier.sidecar.metrics"):
        samples = scrape(server)
    assert samples["lmtier_sidecar_sessions"].value == 3
    assert samples["lmtier_tier_queue_depth{tier=cpu}"].value == 1
    assert samples["lmtier_sidecar_metrics_source_errors_total"].value == 1
    assert "source broke" in caplog.text

    good = TierStats(hits=1)
    metrics.set_sources(lambda: {"bad": object(), "good": good}, no_extra, no_gauges)  # type: ignore[dict-item]
    samples = scrape(server)
    assert samples["lmtier_tier_hits_total{tier=good}"].value == 1
    assert samples["lmtier_sidecar_metrics_source_errors_total"].value == 2
    assert "lmtier_sidecar_sessions" not in samples  # the sources were replaced


def test_serve_refuses_bad_addresses(metrics: SidecarMetrics, server: MetricsServer) -> None:
    with pytest.raises(ConfigError, match=r"^sidecar.metrics_listen: .*has no port"):
        metrics.serve("localhost")
    with pytest.raises(ConfigError, match="over TCP"):
        metrics.serve("unix:///tmp/metrics.sock")
    with pytest.raises(ConfigError, match=r"cannot listen on 127.0.0.1:"):
        metrics.serve(f"127.0.0.1:{server.port}")  # taken by the fixture's server


def test_close_stops_the_server(metrics: SidecarMetrics) -> None:
    running = metrics.serve("127.0.0.1:0")
    assert running.port > 0
    assert "lmtier_sidecar_metrics_source_errors_total" not in scrape(running)  # no sources
    running.close()
    running.close()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{running.port}/metrics", timeout=30)
