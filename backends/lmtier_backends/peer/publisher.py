"""Keeps the directory's view of this node's CPU tier current.

A background task compares the CPU tier's key set with what it last published,
every ``publish_interval_s``: new chunks are claimed, gone ones (evicted, purged)
withdrawn, each a batched script call (:mod:`.directory`). Every ``ttl_s`` all held
chunks are claimed again (it refreshes their TTLs), and every third of ``ttl_s`` the
node's heartbeat is renewed.

Polling, not hooks: evictions and stores happen under the StorageManager's lock, in
any thread, and must never wait on the network; a snapshot of the keys is one copy
of the index under the lock. A directory that fails is retried at the next interval,
from scratch (everything held is claimed again once it answers), and logged once per
outage. :meth:`Publisher.stop` withdraws what it published and removes the heartbeat,
so that peers stop asking this node at once rather than after the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from lmtier.chunks.keys import ChunkKey
from lmtier.errors import BackendError
from lmtier.storage.node import LocalNode
from lmtier.storage.stats import TierStats
from lmtier_backends.peer.directory import PeerDirectory

__all__ = ["LEAVE_TIMEOUT_S", "Publisher"]

logger = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 2.0
"""Most time :meth:`Publisher.stop` spends telling the directory (a dead Redis)."""


class Publisher:
    """Publishes ``node``'s CPU tier as ``node_id`` (module docstring)."""

    def __init__(
        self,
        directory: PeerDirectory,
        node: LocalNode,
        node_id: str,
        interval_s: float,
        stats: TierStats | None = None,
    ) -> None:
        self.directory = directory
        self.stats = stats or TierStats()
        """The tier's stats: ``puts`` counts chunks published for the first time,
        ``errors`` rounds the directory failed."""
        self.node = node
        self.node_id = node_id
        self.interval_s = interval_s
        self.published: set[ChunkKey] = set()
        self.rounds = 0
        """Rounds completed against a live directory."""
        self.lock = asyncio.Lock()
        """Held by each round; a ``delete`` holds it too, so that a round's snapshot of
        the held keys is never published after the delete withdrew them."""
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._failing = False

    async def start(self) -> None:
        """Announce the node (a directory that fails is retried by the rounds), then
        publish in the background, on the running loop."""
        if self._task is not None:
            return
        try:
            await self.directory.heartbeat(self.node_id, self.node.address)
        except BackendError as exc:
            logger.warning("peer: cannot announce this node yet: %s", exc)
        self._task = asyncio.create_task(self._run(), name=f"peer publisher {self.node_id}")

    async def publish_now(self, keys: list[ChunkKey]) -> None:
        """Claim ``keys`` at once (the tier's ``put``), without waiting for a round."""
        await self.directory.publish(self.node_id, keys)
        self.published.update(keys)

    def forget(self, keys: list[ChunkKey]) -> None:
        """``keys`` were withdrawn by someone else: claim them again when held."""
        self.published.difference_update(keys)

    async def _run(self) -> None:
        ttl = self.directory.ttl_s
        beat_at = full_at = 0.0
        while not self._stopping:  # a flag as well as cancel(): a client may swallow one
            now = time.monotonic()
            try:
                if now >= beat_at:
                    await self.directory.heartbeat(self.node_id, self.node.address)
                    beat_at = now + ttl / 3
                async with self.lock:
                    await self._round(full=now >= full_at)
                if now >= full_at:
                    full_at = now + ttl
                if self._failing:
                    logger.info("peer directory answers again: %s", self.directory.where)
                    self._failing = False
                self.rounds += 1
            except BackendError as exc:
                self.stats.errors += 1
                if not self._failing:
                    logger.warning("peer: cannot publish this node's chunks: %s", exc)
                    self._failing = True
                beat_at = full_at = 0.0
                self.published.clear()  # claim everything again once it answers
            await asyncio.sleep(self.interval_s)

    async def _round(self, *, full: bool) -> None:
        with self.node.lock:
            held = set(self.node.cpu_tier.keys())
        gone = [key for key in self.published if key not in held]
        new = [key for key in held if key not in self.published]
        if gone:
            await self.directory.withdraw(self.node_id, gone)
            self.published.difference_update(gone)
        fresh = list(held) if full else new
        if fresh:
            await self.directory.publish(self.node_id, fresh)
            self.published.update(fresh)
            self.stats.puts += len(new)

    def pending(self) -> int:
        """Chunks the CPU tier holds that are not published yet (a snapshot, O(n)); 0
        while the directory fails (nothing is waiting: it is all claimed anew later)."""
        if self._failing:
            return 0
        with self.node.lock:
            held = self.node.cpu_tier.keys()
        return sum(key not in self.published for key in held)

    async def stop(self) -> None:
        """Stop the task; withdraw every claim and the heartbeat (bounded, best effort)."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping = True
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), LEAVE_TIMEOUT_S)
        try:
            await asyncio.wait_for(self._leave(), LEAVE_TIMEOUT_S)
        except (BackendError, TimeoutError) as exc:
            logger.info("peer: left without withdrawing (they expire with the TTL): %s", exc)
        self.published.clear()

    async def _leave(self) -> None:
        await self.directory.leave(self.node_id, self.node.address)
        await self.directory.withdraw(self.node_id, list(self.published))
