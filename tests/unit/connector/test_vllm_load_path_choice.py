"""The synchronous-or-asynchronous choice of a hit's load (lmtier_connector.vllm.load_paths):
the expected read, its bytes over each tier's measured rate, against the budget."""

from __future__ import annotations

import pytest

from lmtier import TierSpan
from lmtier_connector.vllm.load_paths import DEFAULT_RATES, UNKNOWN_TIER_RATE, LoadPaths

MIB = 2**20


def paths(mode: str = "auto", max_sync_s: float = 0.02) -> LoadPaths:
    return LoadPaths(mode, max_sync_s, chunk_bytes=MIB)


def test_host_memory_costs_nothing_and_other_tiers_their_bytes_over_their_rate() -> None:
    choice = paths()
    assert choice.expected_seconds([TierSpan("cpu", 0, 100)]) == 0
    spans = [TierSpan("cpu", 0, 2), TierSpan("disk", 2, 6), TierSpan("s3", 6, 7)]
    expected = 4 * MIB / DEFAULT_RATES["disk"] + MIB / DEFAULT_RATES["s3"]
    assert choice.expected_seconds(spans) == pytest.approx(expected)
    assert choice.rate("a-plugin") == UNKNOWN_TIER_RATE


def test_short_reads_load_in_the_step_and_long_ones_in_the_background() -> None:
    choice = paths(max_sync_s=0.02)
    assert not choice.asynchronous([TierSpan("cpu", 0, 1000)])
    assert not choice.asynchronous([TierSpan("disk", 0, 4)])  # 4 MiB at 500 MB/s: 8 ms
    assert choice.asynchronous([TierSpan("disk", 0, 40)])  # 84 ms
    assert choice.asynchronous([TierSpan("s3", 0, 1)])  # 35 ms


def test_always_and_never_decide_alone() -> None:
    assert paths("always").asynchronous([TierSpan("cpu", 0, 1)])
    assert not paths("never").asynchronous([TierSpan("s3", 0, 1000)])


def test_measured_rates_replace_the_defaults_and_move_smoothly() -> None:
    choice = paths()
    assert not choice.asynchronous([TierSpan("disk", 0, 4)])
    # The workers saw the disk read 8 MiB in 0.8 s: 10 MiB/s, a busy or slow disk.
    choice.observe(
        {"read_bytes|disk": 8 * MIB, "read_seconds|disk": 0.8, "loaded_chunks|disk|sync": 8}
    )
    assert choice.rate("disk") == pytest.approx(10 * MIB)
    assert choice.asynchronous([TierSpan("disk", 0, 4)])
    choice.observe({"read_bytes|disk": 100 * MIB, "read_seconds|disk": 0.1})  # 1000 MiB/s
    assert 10 * MIB < choice.rate("disk") < 1000 * MIB  # a moving average, not a jump
    assert choice.rate("redis") == DEFAULT_RATES["redis"]  # other tiers untouched


def test_tiny_or_empty_samples_are_not_rates() -> None:
    choice = paths()
    choice.observe({"read_bytes|disk": 1000, "read_seconds|disk": 0.5})  # latency, not rate
    choice.observe({"read_bytes|redis": 8 * MIB, "read_seconds|redis": 0.0})
    choice.observe({"read_seconds|s3": 1.0})
    assert choice.rates == {}
