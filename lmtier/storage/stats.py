"""Counters and latency histograms for tiers and the StorageManager.

Every tier owns one :class:`TierStats`; the StorageManager reads them, the CLI and
the sidecar print them. Counters are plain ints bumped from the runtime's event loop
(and, for thread-pool I/O, from worker threads under the GIL: an occasional lost
increment under contention is acceptable for monitoring, a lock per I/O is not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["LatencyHistogram", "TierStats"]

_BUCKETS_US: tuple[int, ...] = tuple(1 << i for i in range(25))  # 1 us .. ~16.8 s


@dataclass(slots=True)
class LatencyHistogram:
    """Call latencies in power-of-two microsecond buckets; cheap to record, mergeable."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(_BUCKETS_US) + 1))
    total_s: float = 0.0
    num: int = 0

    def record(self, seconds: float) -> None:
        """Add one observation."""
        micros = seconds * 1e6
        index = 0 if micros <= 1 else min(len(_BUCKETS_US), math.ceil(math.log2(micros)))
        self.counts[index] += 1
        self.total_s += seconds
        self.num += 1

    def quantile(self, q: float) -> float:
        """Upper bound, in seconds, of the bucket holding the q-quantile (0 if empty)."""
        if self.num == 0:
            return 0.0
        rank = q * self.num
        seen = 0
        for index, count in enumerate(self.counts):
            seen += count
            if seen >= rank and count:
                return _BUCKETS_US[min(index, len(_BUCKETS_US) - 1)] / 1e6
        return _BUCKETS_US[-1] / 1e6

    def summary(self) -> dict[str, float]:
        """Count, mean, p50 and p99 (seconds), for printing."""
        mean = self.total_s / self.num if self.num else 0.0
        return {
            "n": self.num,
            "mean_s": mean,
            "p50_s": self.quantile(0.5),
            "p99_s": self.quantile(0.99),
        }


@dataclass(slots=True)
class TierStats:
    """What one tier did: every field counts since the tier was opened."""

    hits: int = 0
    """Chunks served by ``get_into``."""
    misses: int = 0
    """Chunks asked of ``get_into`` and not served (absent, corrupt or failed)."""
    lookups: int = 0
    """Keys asked of ``contains``."""
    bytes_read: int = 0
    bytes_written: int = 0
    puts: int = 0
    """Chunks stored."""
    errors: int = 0
    """Failed calls: I/O errors, timeouts, refused connections."""
    corrupt: int = 0
    """Chunks that failed validation (checksums, key, geometry, MAC) and were deleted."""
    unservable: int = 0
    """Chunks present but impossible to serve (too large, wrong type, unreadable file),
    removed from the tier so that lookups stop finding them."""
    evictions: int = 0
    queue_drops: int = 0
    """Background writes dropped: the tier's queue stayed full past ``write_wait_s``
    without a write landing, the tier was down (breaker open) with its queue full, or
    the cache closed with them queued (:mod:`lmtier.storage.room`)."""
    queue_waits: int = 0
    """Times a store waited for room in this tier's full write queue (the CPU tier: for
    slabs that pending writes held): back-pressure, each wait at most ``write_wait_s``
    without a write landing."""
    skipped: int = 0
    """Calls not made because the tier's circuit breaker was open (fast misses)."""
    purged: int = 0
    """Chunks deleted by namespace purges (:meth:`lmtier.storage.tier.Tier.purge`)."""
    pins_refused: int = 0
    """Pins refused because they would pass the tier's pin cap (``max_pinned_fraction``)."""
    read_latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    write_latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    lookup_latency: LatencyHistogram = field(default_factory=LatencyHistogram)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready snapshot."""
        out: dict[str, Any] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            out[item.name] = value.summary() if isinstance(value, LatencyHistogram) else value
        return out
