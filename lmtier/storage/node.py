"""What a sidecar offers the other nodes of its cluster, and the tiers that publish it.

The :class:`~lmtier.storage.tier.Tier` contract knows nothing of nodes: a tier that
shares the node's memory with a cluster (the peer tier) says so by having
``attach_node`` (:class:`SharesNode`), and the sidecar tells only those tiers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from lmtier.storage.cpu_tier import CPUTier

__all__ = ["LocalNode", "SharesNode"]


@dataclass(frozen=True, slots=True)
class LocalNode:
    """This node's CPU tier as other nodes may reach it.

    ``cpu_tier`` is the StorageManager's CPU tier and ``lock`` the lock that guards it
    (read its keys or lease its slabs only under it); ``address`` is the ``host:port``
    where this node's ``lmtier.v1.Peer`` service answers.
    """

    cpu_tier: CPUTier
    lock: threading.RLock
    address: str


@runtime_checkable
class SharesNode(Protocol):
    """A tier that shares this node's CPU tier with a cluster (the peer tier)."""

    async def attach_node(self, node: LocalNode) -> None:
        """Told by a sidecar, once its StorageManager runs, what this node offers other
        nodes (its CPU tier and the address of its peer listener): the tier starts
        publishing it."""
