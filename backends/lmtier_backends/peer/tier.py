"""The peer tier: chunks that sit in other nodes' CPU tiers, fetched from their sidecars.

``contains`` asks the directory in the shared Redis (:mod:`.directory`) who holds
each key, in one script call, and counts the leading keys with a live owner. Reads
group the keys by owner and stream each group from the owner's ``lmtier.v1.Peer``
service (:mod:`.fetch`), concurrently, authenticated with a node token. The chunks
are validated like any tier's (checksums, the key asked for, and a MAC when an
integrity key is set: the tier is ``shared``), each as soon as its last piece has
landed (``_read_checked``), and the StorageManager promotes them into this node's
CPU and disk tiers.

The tier takes no background writes (write policy ``none``): what it offers other
nodes is this node's CPU tier, published by :class:`~.publisher.Publisher` once a
sidecar attaches the node (:meth:`PeerTier.attach_node`). Its ``put`` stores chunks
in that CPU tier and claims them at once, and ``delete`` withdraws directory entries
(an entry whose chunk turned out corrupt or unservable is withdrawn from whichever
node claims it; the owner claims it again at its next full refresh, ``ttl_s``); so
the tier passes the conformance suite against a real directory and real fetches.

Failures cost misses: a directory that does not answer raises BackendError (the
manager's breaker then skips the tier), a peer that is dead, hung or refuses the
token makes its chunks misses (all of a read's peers failing raises, for the breaker).
A purge is not the tier's to do: each node purges its own CPU tier, which withdraws
the chunks from the directory at the next round (NotSupportedError here).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from lmtier.chunks.keys import ChunkKey
from lmtier.config.secrets import Secret, SecretURL
from lmtier.errors import BackendError
from lmtier.storage.budget import CallBudget, Progress
from lmtier.storage.node import LocalNode
from lmtier.storage.stats import TierStats
from lmtier.storage.tier import Buffer, CheckedRead, Tier, TierProperties
from lmtier_backends.peer.directory import Owner, PeerDirectory
from lmtier_backends.peer.fetch import Check, PeerClient
from lmtier_backends.peer.publisher import Publisher

__all__ = ["OWNER_CACHE", "PeerTier"]

logger = logging.getLogger(__name__)

OWNER_CACHE = 65536
"""Owners remembered from lookups, so that the read after a lookup needs no second
directory call (a stale one costs a miss: the peer no longer has the chunk)."""
LOOKUP_KEY_S = 0.00001
"""Seconds a lookup's deadline grows per key (one script answers a whole batch)."""


class PeerTier(Tier):
    """Reads other nodes' CPU tiers (module docstring). The constructor does no I/O."""

    def __init__(
        self,
        directory_url: str | SecretURL,
        *,
        token: Secret | None,
        key_prefix: str = "lmtier:",
        node_id: str = "",
        tls_ca_file: Path | None = None,
        ttl_s: float = 15.0,
        publish_interval_s: float = 0.5,
        timeout_s: float = 1.0,
        min_bytes_per_s: float = 64 * 1024**2,
        max_keys_per_fetch: int = 256,
        name: str = "peer",
    ) -> None:
        self.name = name
        self.properties = TierProperties(shared=True, write_policy="none", timeout_s=timeout_s)
        self.stats = TierStats()
        self.budget = CallBudget(timeout_s, min_bytes_per_s, LOOKUP_KEY_S)
        self.io_progress = Progress()
        self.directory = PeerDirectory(
            directory_url, key_prefix=key_prefix, ttl_s=ttl_s, timeout_s=timeout_s
        )
        self.client = PeerClient(token, tls_ca_file=tls_ca_file, progress=self.io_progress)
        self.node_id = node_id
        self.publish_interval_s = publish_interval_s
        self.max_keys_per_fetch = max_keys_per_fetch
        self.node: LocalNode | None = None
        self.publisher: Publisher | None = None
        self._owners: OrderedDict[ChunkKey, Owner] = OrderedDict()

    def __repr__(self) -> str:
        return f"PeerTier({self.name!r}, {self.directory.where}, node={self.node_id or None})"

    # ---- the node this tier publishes -------------------------------------------------

    async def attach_node(self, node: LocalNode) -> None:
        """Publish ``node``'s CPU tier from now on (as ``node_id``, default its address)."""
        if self.publisher is not None:
            raise RuntimeError(f"{self.name}: a node is attached already")
        self.node = node
        self.node_id = self.node_id or node.address
        self.publisher = Publisher(
            self.directory, node, self.node_id, self.publish_interval_s, self.stats
        )
        await self.publisher.start()

    # ---- lookups and reads ------------------------------------------------------------

    async def contains(self, keys: Sequence[ChunkKey]) -> int:
        self.stats.lookups += len(keys)
        if not keys:
            return 0
        owners = await self.directory.lookup(keys)
        self.io_progress.tick()
        for key, owner in zip(keys, owners, strict=False):
            if owner is not None:
                self._remember(key, owner)
        return len(owners)

    def _remember(self, key: ChunkKey, owner: Owner) -> None:
        self._owners[key] = owner
        self._owners.move_to_end(key)
        if len(self._owners) > OWNER_CACHE:
            self._owners.popitem(last=False)

    async def _owners_of(self, keys: Sequence[ChunkKey]) -> list[Owner | None]:
        owners: list[Owner | None] = [self._owners.get(key) for key in keys]
        unknown = [i for i, owner in enumerate(owners) if owner is None]
        if unknown:
            found = await self.directory.lookup([keys[i] for i in unknown], every=True)
            self.io_progress.tick()
            for i, owner in zip(unknown, found, strict=True):
                owners[i] = owner
        return owners

    async def _read_checked(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview]
    ) -> list[int | CheckedRead | None]:
        """Fetches; each chunk checked (:meth:`check_read`) as its last piece lands,
        while its bytes are still in the CPU's caches, not after the whole batch."""
        return await self._fetch(keys, buffers, self.check_read)

    async def _read_into(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        outcomes = await self._fetch(keys, buffers, None)
        return [o.size if isinstance(o, CheckedRead) else o for o in outcomes]

    async def _fetch(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview], check: Check | None
    ) -> list[int | CheckedRead | None]:
        """Each key's outcome (:meth:`PeerClient.fetch_into`), fetched from its owner."""
        sizes: list[int | CheckedRead | None] = [None] * len(keys)
        if not keys:
            return sizes
        groups: dict[str, list[int]] = {}
        for index, owner in enumerate(await self._owners_of(keys)):
            if owner is not None:
                groups.setdefault(owner[1], []).append(index)
        step = self.max_keys_per_fetch
        failures: list[BackendError] = []
        fetched = 0

        async def fetch(address: str, indices: list[int]) -> None:
            # One call after another: two streams from one peer at once share its
            # connection and CPU, and finish later than one after the other.
            nonlocal fetched
            for start in range(0, len(indices), step):
                batch = indices[start : start + step]
                try:
                    got = await self.client.fetch_into(
                        address, [keys[i] for i in batch], [buffers[i] for i in batch], check
                    )
                except BackendError as exc:  # the peer's other keys: misses too
                    failures.append(exc)
                    self._forget_address(address)
                    return
                fetched += 1
                for i, size in zip(batch, got, strict=True):
                    sizes[i] = size

        async with asyncio.TaskGroup() as group:
            for address, indices in groups.items():
                group.create_task(fetch(address, indices))
        if failures:
            if not fetched:
                raise failures[0]
            self.stats.errors += len(failures)
            logger.debug(
                "%s: %d of %d peers failed: %s",
                self.name,
                len(failures),
                len(groups),
                failures[0],
            )
        return sizes

    def _forget_address(self, address: str) -> None:
        for key in [k for k, owner in self._owners.items() if owner[1] == address]:
            del self._owners[key]

    # ---- writes (the node's own chunks) ----------------------------------------------

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> int:
        """Store chunks in the attached node's CPU tier and claim them now; 0 when no
        node is attached (the StorageManager never writes here: policy ``none``)."""
        node, publisher = self.node, self.publisher
        if node is None or publisher is None or not items:
            return 0
        with node.lock:  # the CPU tier's put never suspends: the lock is not held across I/O
            stored = await node.memory.put(items)
        keys = [key for key, _ in items if key in node.memory]
        try:
            await publisher.publish_now(keys)
        except BackendError as exc:
            self.stats.errors += len(items)
            logger.debug("%s: claim failed (the publisher retries): %s", self.name, exc)
            return 0
        self.stats.puts += stored
        return stored

    async def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Withdraw the directory entries of ``keys`` (whoever claims them) and drop the
        ones this node holds from its CPU tier; how many entries went."""
        if not keys:
            return 0
        node, publisher = self.node, self.publisher
        if node is None or publisher is None:
            return (await self._withdraw(keys))[0]
        async with publisher.lock:  # no round in between: it could claim them again
            removed, mine = await self._withdraw(keys)
            with node.lock:
                node.memory.discard(mine)
            publisher.forget(mine)
        return removed

    async def _withdraw(self, keys: Sequence[ChunkKey]) -> tuple[int, list[ChunkKey]]:
        """Withdraw the entries of ``keys``: how many went, and those this node owned."""
        owners = await self.directory.lookup(keys, every=True)
        by_owner: dict[str, list[ChunkKey]] = {}
        for key, owner in zip(keys, owners, strict=True):
            self._owners.pop(key, None)
            if owner is not None:
                by_owner.setdefault(owner[0], []).append(key)
        removed = 0
        for node_id, owned in by_owner.items():
            removed += await self.directory.withdraw(node_id, owned)
        return removed, by_owner.get(self.node_id, [])

    def usage(self) -> dict[str, int]:
        """With a node attached: ``chunks`` published and ``pending``, held in the CPU
        tier but not published yet (the sidecar reports it as the tier's queue depth)."""
        publisher = self.publisher
        if publisher is None:
            return {}
        return {"chunks": len(publisher.published), "pending": publisher.pending()}

    async def close(self) -> None:
        """Withdraw this node's claims (if attached), close channels and the directory."""
        publisher, self.publisher = self.publisher, None
        if publisher is not None:
            await publisher.stop()
        await self.client.close()
        await self.directory.close()
