"""Where an external hit's KV came from, in vLLM's terms (``CacheHitSource``, vLLM's
per-source prefix-cache metrics): the connector's answer to vLLM's
``get_external_cache_hit_sources``, from the tiers lmtier's lookup found.

lmtier's tiers map to vLLM's sources by what they are: ``cpu`` (host memory) is
``host``, ``disk`` is ``disk``, ``peer`` (another node's host memory) is ``p2p``; the
remote stores (``redis``, ``s3``) and any plugin tier are ``external_unspecified``,
vLLM's label for a remote store (it has none of its own for one). Over a sidecar the
spans name the sidecar's tiers: on a unix socket the sidecar is on this host and its
tiers map as above; over TCP it may be another machine, and every hit is
``external_unspecified``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from lmtier import TierSpan

__all__ = ["TIER_SOURCES", "FoundHit", "source_of"]


TIER_SOURCES: Mapping[str, CacheHitSource] = {
    "cpu": CacheHitSource.HOST,
    "disk": CacheHitSource.DISK,
    "peer": CacheHitSource.P2P,
}
"""vLLM's source of each lmtier tier that has one; any other tier is a remote store."""


def source_of(tier: str, *, on_this_host: bool = True) -> CacheHitSource:
    """vLLM's source for hits of lmtier's tier ``tier`` (``on_this_host``: False for a
    sidecar reached over TCP, whose tiers may be on another machine)."""
    if not on_this_host:
        return CacheHitSource.EXTERNAL_UNSPECIFIED
    return TIER_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)


@dataclass(frozen=True, slots=True)
class FoundHit:
    """What a lookup found for a request: the local hit it counted from (``start``,
    tokens), the first chunk it asked for, and its spans (chunks counted from that
    one), until vLLM asks where the loaded tokens came from."""

    start: int
    first_chunk: int
    spans: Sequence[TierSpan]

    def sources(
        self, num_tokens: int, chunk_size: int, *, on_this_host: bool = True
    ) -> dict[CacheHitSource, int]:
        """``num_tokens`` tokens from ``start`` split by the source of the span holding
        each (only non-zero counts); tokens no span holds (vLLM never asks for more
        than the hit) count as ``external_unspecified``, as vLLM counts a mismatch."""
        found: dict[CacheHitSource, int] = {}
        end = self.start + num_tokens
        for span in self.spans:
            low = max(self.start, (self.first_chunk + span.start) * chunk_size)
            high = min(end, (self.first_chunk + span.stop) * chunk_size)
            if high > low:
                source = source_of(span.tier, on_this_host=on_this_host)
                found[source] = found.get(source, 0) + high - low
        rest = num_tokens - sum(found.values())
        if rest > 0:
            unspecified = CacheHitSource.EXTERNAL_UNSPECIFIED
            found[unspecified] = found.get(unspecified, 0) + rest
        return found
