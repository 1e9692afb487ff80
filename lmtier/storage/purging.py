"""Purging a namespace: what the StorageManager reports per tier, and what keeps the
chunks a purge deleted from coming back.

:meth:`StorageManager.purge <lmtier.storage.manager.StorageManager.purge>` deletes every
chunk of one namespace (keys starting with its 16-byte digest) from the CPU tier, then
from each lower tier in order (:meth:`lmtier.storage.tier.Tier.purge`, through the
tier's guard). It answers, per tier, how many chunks went, or one of two negative
values: :data:`PURGE_FAILED` (the tier failed, timed out or its breaker was open; it
may have deleted some) and :data:`PURGE_UNSUPPORTED` (the tier cannot list its chunks:
nothing was asked of it).

Host memory and the background writes keep moving while a purge runs, so
:class:`~lmtier.storage.barriers.PurgeBarriers` records which namespaces are being
purged and when each last was. With it:

* a background write queued before the purge began (or on its way to its queue from
  a storing thread) is dropped by its writer, never sent; a write already being sent
  is waited for (up to :data:`PURGE_SETTLE_S`) before its tier is purged;
* while the purge runs, a store of the namespace is refused (``put`` returns False:
  not cached, not queued), and a chunk a load reads is served but not promoted;
* a load that read a chunk before the purge and finishes after it serves the chunk
  but does not cache it again.

What it does not cover: chunks of the namespace stored after the purge returns (they
are new), and writes another process or a direct tier caller makes meanwhile.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lmtier.errors import NotSupportedError

if TYPE_CHECKING:
    from lmtier.storage.guard import TierGuard
    from lmtier.storage.writes import BackgroundWrites

__all__ = [
    "PURGE_FAILED",
    "PURGE_SETTLE_S",
    "PURGE_TIMEOUT_S",
    "PURGE_UNSUPPORTED",
    "purge_tier",
]

logger = logging.getLogger(__name__)

PURGE_FAILED = -1
"""A tier's answer to a purge when it failed, timed out or its breaker was open (it
may have deleted some of the namespace's chunks)."""
PURGE_UNSUPPORTED = -2
"""A tier's answer to a purge when it cannot list its chunks
(:class:`~lmtier.errors.NotSupportedError`): skipped, nothing deleted."""
PURGE_TIMEOUT_S = 120.0
"""Deadline of one tier's purge: how many chunks it must delete is not known in
advance. A tier that reports I/O progress is still given up on once it stalls for its
``timeout_s`` (:mod:`lmtier.storage.budget`)."""
PURGE_SETTLE_S = 5.0
"""Longest a purge waits for a background write of its namespace already being sent
to a tier (past that, the write may land after the purge; logged)."""


async def purge_tier(
    guard: TierGuard, writes: BackgroundWrites, namespace: bytes, deadline_s: float
) -> int:
    """Purge ``namespace`` from ``guard``'s tier, a lower tier of the StorageManager:
    how many chunks went, :data:`PURGE_FAILED` or :data:`PURGE_UNSUPPORTED`.

    A batch of the namespace being written to the tier is waited for first (up to
    :data:`PURGE_SETTLE_S`); the purge then runs through the guard (breaker, a deadline
    of ``deadline_s``, a stall of the tier's I/O). NotSupportedError is an answer, not
    a failure: it does not count against the breaker.
    """
    tier = guard.tier
    if not await writes.settled(tier, namespace, PURGE_SETTLE_S):
        msg = "%s: a write of namespace %s still in flight after %s s may land after its purge"
        logger.warning(msg, tier.name, namespace.hex(), PURGE_SETTLE_S)

    async def call() -> int:
        try:
            return await tier.purge(namespace)
        except NotSupportedError:
            return PURGE_UNSUPPORTED

    count, timed_out = await guard.call("purge", call, deadline_s=deadline_s)
    if count is None:
        why = "timed out" if timed_out else "failed or was skipped (breaker open)"
        logger.warning("%s: purge of namespace %s %s", tier.name, namespace.hex(), why)
        return PURGE_FAILED
    if count == PURGE_UNSUPPORTED:
        logger.info("%s: cannot purge (it cannot list its chunks): skipped", tier.name)
    return count
