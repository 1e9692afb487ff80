"""Keeps this node's part of the fleet index (:mod:`.index`) equal to its tiers.

A task on the node's event loop takes the tiers' events
(:class:`~lmtier.storage.events.NodeFeed`) every ``interval_s``, folds them into one
change per chunk (the last event of a chunk in a tier wins), and writes them in
batched scripts. Every third of ``ttl_s`` it renews the heartbeat, even when nothing
changed.

It starts from what the tiers hold (``feed.held()``: the CPU tier, the disk's index)
and the events queued since it subscribed, and starts over the same way, after
withdrawing this node's entries, whenever its view may have a hole: the subscription
lost events (it fell ``max_events`` behind), a write to the index failed (the events
it carried are gone), or the index did not know the node (its heartbeat expired, or
the Redis lost its data). A shared tier's
purge of a namespace (which names no keys) clears that tier's bit on the chunks of
the namespace the shared owner has entries for. A Redis that is down costs the index
its freshness, never the node a failed call; the outage is logged once.

:meth:`FleetFeeder.close` withdraws this node (heartbeat first, so the routers stop
counting it at once, then its entries), within ``LEAVE_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from lmtier.chunks.keys import ChunkKey
from lmtier.errors import BackendError
from lmtier.storage.events import NodeFeed, Subscription, TierEvent
from lmtier_backends.fleet.index import SHARED, Change, FleetIndex, tier_bit

__all__ = ["LEAVE_TIMEOUT_S", "MAX_EVENTS", "FleetFeeder"]

logger = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 2.0
"""Most time :meth:`FleetFeeder.close` spends telling the index (a dead Redis)."""
MAX_EVENTS = 1_000_000
"""Events the subscription queues before it loses the oldest (then: start over)."""


class FleetFeeder:
    """Writes ``feed``'s changes to ``index`` as node ``node_id`` (module docstring)."""

    def __init__(
        self,
        index: FleetIndex,
        feed: NodeFeed,
        node_id: str,
        *,
        interval_s: float,
        max_events: int = MAX_EVENTS,
    ) -> None:
        self.index = index
        self.feed = feed
        self.node_id = node_id
        self.interval_s = interval_s
        self._subscription: Subscription = feed.events.subscribe(max_events)
        self._task: asyncio.Task[None] | None = None
        self._lost = 0
        self._fresh = False
        """Whether the index holds this node's whole view (False: start over)."""
        self._failing = False
        self.rounds = 0
        """Rounds written to a live index."""
        self.resyncs = 0
        """Times this node's entries were rebuilt from its tiers."""

    def start(self) -> FleetFeeder:
        """Start the task on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="fleet-feeder")
        return self

    async def close(self) -> None:
        """Stop, and withdraw this node from the index (module docstring)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._subscription.close()
        try:
            await asyncio.wait_for(self._leave(), LEAVE_TIMEOUT_S)
        except (BackendError, asyncio.TimeoutError) as exc:
            logger.warning("could not withdraw node %s from the index (%s)", self.node_id, exc)
        await self.index.close()

    async def _leave(self) -> None:
        await self.index.leave(self.node_id)
        await self.index.withdraw(self.node_id)

    # ---- the task ------------------------------------------------------------------------

    async def _run(self) -> None:
        beat = max(self.interval_s, self.index.ttl_s / 3)
        last_write = 0.0
        while True:
            try:
                wrote = await self.round(heartbeat=time.monotonic() - last_write >= beat)
                if wrote:
                    last_write = time.monotonic()
                if self._failing:
                    logger.warning("%s: answers again", self.index.where)
                    self._failing = False
            except BackendError as exc:
                if not self._failing:
                    logger.warning("%s; this node's entries go stale until it answers", exc)
                    self._failing = True
            await asyncio.sleep(self.interval_s)

    async def round(self, *, heartbeat: bool = False) -> bool:
        """Write what changed since the last round (all of it when starting over);
        whether anything was written. BackendError when the index fails (the next
        round starts over: what this one took is gone)."""
        try:
            return await self._round(heartbeat)
        except BackendError:
            self._fresh = False
            raise

    async def _round(self, heartbeat: bool) -> bool:
        events = self._subscription.take()
        lost = self._subscription.lost
        changes: dict[ChunkKey, Change] = {}
        if lost != self._lost or not self._fresh:
            self._lost = lost
            await self._start_over(changes)
        for event in events:
            await self._fold(changes, event)
        if not self._fresh:
            await self.index.apply(self.node_id, changes)
            self._fresh = True
            self.rounds += 1
            return True
        if changes or heartbeat:
            if not await self.index.apply(self.node_id, changes):
                self._fresh = False  # taken for dead, or a Redis that lost its data
            self.rounds += 1
            return True
        return False

    async def _start_over(self, changes: dict[ChunkKey, Change]) -> None:
        """Withdraw this node's entries, and put what its tiers hold now in
        ``changes``. The events taken with it are folded in after: each chunk's last
        event says what the snapshot says, and the tiers that cannot be listed (Redis,
        S3) are known only from them."""
        self.resyncs += 1
        self._fresh = False
        await self.index.withdraw(self.node_id)
        for tier, keys in self.feed.held().items():
            shared = self.feed.tiers.get(tier)
            if shared is None:
                continue
            bit = tier_bit(tier)
            for key in keys:
                changes.setdefault(key, Change()).add(bit, shared=shared, held=True)

    async def _fold(self, changes: dict[ChunkKey, Change], event: TierEvent) -> None:
        shared = self.feed.tiers.get(event.tier)
        if shared is None:
            return  # a tier that holds nothing of its own (the peer tier)
        bit = tier_bit(event.tier)
        if event.kind == "cleared":  # what the index has, and what this round would add
            owner = SHARED if shared else self.node_id
            keys: tuple[ChunkKey, ...] | list[ChunkKey] = [
                *await self.index.owned(owner, event.namespace),
                *(key for key in changes if key.startswith(event.namespace)),
            ]
            held = False
        else:
            keys, held = event.keys, event.kind == "stored"
        for key in keys:
            changes.setdefault(key, Change()).add(bit, shared=shared, held=held)
