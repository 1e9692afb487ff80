"""The fleet index: every node's chunks, by tier, in a shared Redis (:mod:`.index`),
kept current by each node (:mod:`.feeder`) and read by ``lmtier route``."""

from __future__ import annotations

from lmtier.config import FleetConfig
from lmtier.storage.events import NodeFeed
from lmtier_backends.fleet.feeder import FleetFeeder
from lmtier_backends.fleet.index import FleetIndex

__all__ = ["FleetFeeder", "FleetIndex", "open_index", "open_service"]


def open_index(section: FleetConfig) -> FleetIndex:
    """The index ``section`` names (no I/O: it connects on first use)."""
    assert section.index_url is not None  # resolved by the caller
    return FleetIndex(
        section.index_url,
        key_prefix=section.key_prefix,
        ttl_s=section.ttl_s,
        entry_ttl_s=section.entry_ttl_s,
        max_keys=section.max_keys,
        timeout_s=section.timeout_s,
    )


async def open_service(section: FleetConfig, feed: NodeFeed) -> FleetFeeder:
    """The ``lmtier.services`` entry point: this node's feeder, started."""
    return FleetFeeder(
        open_index(section), feed, section.node_id, interval_s=section.interval_s
    ).start()
