"""Waiting for a sidecar's background writes, read from its Prometheus ``/metrics``.

A store answers once its chunks are in the sidecar's host memory; the disk, Redis
and S3 writes follow in the background. A client that wants another node to find
them in Redis must wait for those writes, and the sidecar says how far they are:
``lmtier_tier_queue_depth{tier}`` (writes waiting; a batch being sent is no longer
counted) and ``lmtier_tier_puts_total{tier}`` (chunks written). A request's writes
are done when every queue is empty and every queued tier's puts (or drops) have grown
by the chunks it stored; a tier whose errors grew instead is down and takes nothing,
which is done too. Only these metric names and the single ``tier`` label are relied
on (``lmtier.sidecar.metrics``).
"""

from __future__ import annotations

import re
import time
import urllib.error

from lmtier_apps.cluster.health import LOCAL_OPENER

__all__ = ["TierMetrics", "WriteWatch", "scrape_tier_metrics", "settled"]

TierMetrics = dict[tuple[str, str], float]
"""Values by (name, tier); the name without ``lmtier_tier_`` and ``_total``."""
_METRIC = re.compile(r'^lmtier_tier_(\w+?)(?:_total)?\{tier="([^"]+)"\} (\S+)$')
_POLL_S = 0.05


def scrape_tier_metrics(url: str) -> TierMetrics | None:
    """The per-tier values of a sidecar's ``/metrics`` (``("puts", "redis")``,
    ``("queue_depth", "s3")``, ...); None when it does not answer."""
    try:
        with LOCAL_OPENER.open(url, timeout=5.0) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    values = {}
    for line in text.splitlines():
        found = _METRIC.match(line)
        if found is not None:
            values[(found.group(1), found.group(2))] = float(found.group(3))
    return values


def settled(before: TierMetrics, now: TierMetrics, chunks: int) -> bool:
    """Every tier with a write queue has it empty and has taken ``chunks`` more writes
    (stored or dropped) since ``before``, or has failed since."""
    for (name, tier), depth in now.items():
        if name != "queue_depth":
            continue

        def grown(metric: str, tier: str = tier) -> float:
            return now.get((metric, tier), 0.0) - before.get((metric, tier), 0.0)

        failed = grown("errors") + grown("skipped") > 0
        if depth > 0 or (grown("puts") + grown("queue_drops") < chunks and not failed):
            return False
    return True


class WriteWatch:
    """The metrics of one sidecar before a request, to wait for its writes after it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.before = scrape_tier_metrics(url)

    def wait(self, chunks: int, timeout_s: float) -> bool:
        """Wait until the request's ``chunks`` are written (:func:`settled`); False at
        the deadline, or at once when the metrics did not answer before the request
        (``before`` is None: there is nothing to compare with)."""
        if self.before is None:
            return False
        deadline = time.monotonic() + timeout_s
        while True:
            now = scrape_tier_metrics(self.url)
            if now is not None and settled(self.before, now, chunks):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
