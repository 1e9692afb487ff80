"""The peer tier: chunks that sit in other nodes' CPU tiers, fetched from their sidecars.

``contains`` asks the directory in the shared Redis (:mod:`.directory`) who holds
each key, in one script call, then asks each owner of the leading run whether it
still holds its keys (``Peer/Contains``, concurrently), and counts the leading keys
an owner confirmed: a lookup names only what a load would get, so a dead or planted
owner never makes an engine wait for chunks that will not come. Only owners that
``peer.allowed_peers`` allows and that have not just failed are asked (:mod:`.owners`).
Reads group the keys by owner and stream each group from the owner's
``lmtier.v1.Peer`` service (:mod:`.fetch`), concurrently, each call carrying a proof
of the node secret rather than the secret itself. The chunks
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
manager's breaker then skips the tier), a peer that is dead, hung, refuses this
node's proof or cannot prove its own makes its chunks misses and is left alone for
a backoff (all of a read's peers failing raises, for the breaker).
A purge is not the tier's to do: each node purges its own CPU tier, which withdraws
the chunks from the directory at the next round (NotSupportedError here).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from lmtier.chunks.keys import ChunkKey
from lmtier.config.peer import AddressPolicy
from lmtier.config.secrets import SecretURL
from lmtier.errors import BackendError
from lmtier.storage.budget import CallBudget, Progress
from lmtier.storage.node import LocalNode
from lmtier.storage.stats import TierStats
from lmtier.storage.tier import Buffer, CheckedRead, Tier, TierProperties
from lmtier.wire.peer_auth import NodeKey
from lmtier_backends.peer.directory import Owner, PeerDirectory
from lmtier_backends.peer.fetch import Check, PeerClient, PeerTLS
from lmtier_backends.peer.owners import Owners
from lmtier_backends.peer.publisher import Publisher

__all__ = ["PeerTier"]

logger = logging.getLogger(__name__)

LOOPBACK = AddressPolicy.parse(["127.0.0.0/8", "::1/128", "localhost"])
LOOKUP_KEY_S = 0.00001
"""Seconds a lookup's deadline grows per key (one script answers a whole batch)."""


class PeerTier(Tier):
    """Reads other nodes' CPU tiers (module docstring). The constructor does no I/O."""

    def __init__(
        self,
        directory_url: str | SecretURL,
        *,
        key: NodeKey,
        policy: AddressPolicy = LOOPBACK,
        key_prefix: str = "lmtier:",
        node_id: str = "",
        tls: PeerTLS | None = None,
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
        self.client = PeerClient(key, tls=tls, timeout_s=timeout_s, progress=self.io_progress)
        self.owners = Owners(policy)
        self.node_id = node_id
        self.publish_interval_s = publish_interval_s
        self.max_keys_per_fetch = max_keys_per_fetch
        self.node: LocalNode | None = None
        self.publisher: Publisher | None = None

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
        found = await self.directory.lookup(keys)
        self.io_progress.tick()
        leading: list[tuple[ChunkKey, Owner]] = []
        for key, owner in zip(keys, found, strict=False):
            if owner is None or not self.owners.dialable(owner):
                break
            leading.append((key, owner))
        groups: dict[str, list[ChunkKey]] = {}
        for key, owner in leading:
            groups.setdefault(owner[1], []).append(key)
        held: dict[str, int] = {}

        async def ask(address: str, owned: list[ChunkKey]) -> None:
            try:
                held[address] = await self.client.count(address, owned)
            except BackendError as exc:
                held[address] = 0
                self._failed(address, exc)
            else:
                self.owners.succeeded(address)

        async with asyncio.TaskGroup() as group:
            for address, owned in groups.items():
                group.create_task(ask(address, owned))
        counted = dict.fromkeys(groups, 0)
        total = 0
        for key, owner in leading:  # the leading run every owner confirmed, in order
            address = owner[1]
            if counted[address] >= held[address]:
                break
            counted[address] += 1
            self.owners.remember(key, owner)
            total += 1
        return total

    def _failed(self, address: str, exc: BackendError) -> None:
        self.stats.errors += 1
        self.owners.failed(address)
        logger.debug("%s: peer %s failed: %s", self.name, address, exc)

    async def _owners_of(self, keys: Sequence[ChunkKey]) -> list[Owner | None]:
        owners: list[Owner | None] = [self.owners.get(key) for key in keys]
        unknown = [i for i, owner in enumerate(owners) if owner is None]
        if unknown:
            found = await self.directory.lookup([keys[i] for i in unknown], every=True)
            self.io_progress.tick()
            for i, owner in zip(unknown, found, strict=True):
                owners[i] = owner
        return [owner if self.owners.dialable(owner) else None for owner in owners]

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
                    self.owners.failed(address)
                    return
                self.owners.succeeded(address)
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

    # ---- writes (the node's own chunks) ----------------------------------------------

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> int:
        """Store chunks in the attached node's CPU tier and claim them now; 0 when no
        node is attached (the StorageManager never writes here: policy ``none``)."""
        node, publisher = self.node, self.publisher
        if node is None or publisher is None or not items:
            return 0
        with node.lock:  # the CPU tier's put never suspends: the lock is not held across I/O
            stored = await node.cpu_tier.put(items)
        keys = [key for key, _ in items if key in node.cpu_tier]
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
                node.cpu_tier.discard(mine)
            publisher.forget(mine)
        return removed

    async def _withdraw(self, keys: Sequence[ChunkKey]) -> tuple[int, list[ChunkKey]]:
        """Withdraw the entries of ``keys``: how many went, and those this node owned."""
        owners = await self.directory.lookup(keys, every=True)
        by_owner: dict[str, list[ChunkKey]] = {}
        for key, owner in zip(keys, owners, strict=True):
            self.owners.forget(key)
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
