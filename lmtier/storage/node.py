"""What a sidecar offers the other nodes of its cluster (:meth:`Tier.attach_node`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from lmtier.storage.cpu_tier import CPUTier

__all__ = ["LocalNode"]


@dataclass(frozen=True, slots=True)
class LocalNode:
    """This node's CPU tier as other nodes may reach it.

    ``memory`` is the StorageManager's CPU tier and ``lock`` the lock that guards it
    (read its keys or lease its slabs only under it); ``address`` is the ``host:port``
    where this node's ``lmtier.v1.Peer`` service answers.
    """

    memory: CPUTier
    lock: threading.RLock
    address: str
