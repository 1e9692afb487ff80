""":class:`LocalStore`: chunks in this process, host memory and the configured tiers
under one :class:`~lmtier.storage.manager.StorageManager`.

It is the one sequence that opens a node's storage: the host pool and its CPU tier
(``cpu.capacity_bytes`` plus ``cpu.staging_bytes``, in whole slabs, allocated once),
the tiers below it, the manager and its background writers. Two users:

* the embedded facade (``LMTier.open``): :meth:`LocalStore.start` opens it on a
  :class:`~lmtier.runtime.Runtime` of its own (one event loop thread), and the
  :class:`~lmtier.store.ChunkStore` methods run each call there, or in the
  caller's thread where no I/O is needed (in-memory indexes, a store's hand-over);
* ``lmtier serve``: ``await store.open(...)`` on the server's own loop (its pool in
  shared memory, a check of many namespaces); its handlers then call the manager's
  coroutines on that loop (:attr:`manager`), and never the synchronous methods.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import torch

from lmtier.chunks.integrity import ChunkMac, load_key
from lmtier.chunks.keys import ChunkKey, Namespace
from lmtier.config import LMTierConfig
from lmtier.errors import CacheClosedError
from lmtier.results import HostMemory
from lmtier.runtime import Runtime
from lmtier.storage.check import ChunkCheck
from lmtier.storage.cpu_tier import CPUTier, open_cpu_tier
from lmtier.storage.events import ChunkName, NodeFeed
from lmtier.storage.host_pool import HostPool, SlabHandle
from lmtier.storage.lookup import LoadedChunk, Lookup
from lmtier.storage.manager import EvictListener, StorageManager
from lmtier.storage.node import LocalNode, SharesNode
from lmtier.storage.plugins import Service, open_services, open_tiers
from lmtier.storage.sealing import Sealer
from lmtier.storage.stats import TierStats
from lmtier.store import Encoded, Reserved, StoreLayout

if TYPE_CHECKING:
    from lmtier.events.publisher import EventPublisher

__all__ = ["HostView", "LocalStore", "node_feed"]

logger = logging.getLogger(__name__)
CheckT = TypeVar("CheckT", bound=ChunkCheck)

STORE_BATCH = 64
"""Most chunks a store copies as one shared copy (:func:`lmtier.copies.copy_many`)
and hands over at once (one pass under the manager's lock); a quarter of the host
pool's slabs when that is fewer, so that a store larger than the pool still takes
slabs that earlier batches gave back. Larger batches cost fewer hand-offs between
the threads that copy: 64 pages of 2 MiB stored in 16 ms, against 19 ms in batches
of 8."""


class HostView(NamedTuple):
    """What serving this node's CPU tier to other nodes needs (the peer listener):
    the tier, the manager's lock its index is kept under, and the sealer that
    finishes a chunk's checksum before it may leave the node."""

    cpu_tier: CPUTier
    lock: threading.RLock
    sealer: Sealer


class LocalStore:
    """Chunks in this process (module docstring)."""

    store_batch = STORE_BATCH
    holds_writes = True

    def __init__(self, config: LMTierConfig) -> None:
        self.config = config
        self._runtime: Runtime | None = None
        self._manager: StorageManager | None = None
        self._publisher: EventPublisher | None = None
        self._services: list[Service] = []

    # ---- opening -------------------------------------------------------------------

    def start(self, layout: StoreLayout) -> None:
        """Open on a runtime of this store's own, for the facade's calls."""
        slab_bytes = layout.kv_spec.encoded_chunk_bytes(layout.chunk_size)
        geometry = layout.kv_spec.geometry(layout.chunk_size)
        runtime = Runtime().start()
        try:
            runtime.run(self.open(slab_bytes, lambda mac: ChunkCheck(geometry, mac)))
        except BaseException:
            runtime.stop()
            raise
        self._runtime = runtime
        slabs = self._run()[0].cpu_tier.pool.num_slabs
        self.store_batch = max(1, min(STORE_BATCH, slabs // 4))

    async def open(
        self,
        slab_bytes: int,
        check: Callable[[ChunkMac | None], CheckT],
        region: Callable[[int], torch.Tensor] | None = None,
    ) -> CheckT:
        """Open the pool, the tiers and the manager on the running loop: ``check``
        makes the chunk check from the configured integrity key (returned: a sidecar
        registers its sessions' namespaces with it); ``region`` allocates the pool's
        memory (:func:`~lmtier.storage.host_pool.open_host_pool`)."""
        config = self.config
        chunk_check = check(load_key(config.integrity.key, config.integrity.key_file))
        cpu, disk = config.cpu, config.disk
        cpu_tier = open_cpu_tier(
            slab_bytes,
            cached_bytes=cpu.capacity_bytes if cpu.enabled else 0,
            staging_bytes=cpu.staging_bytes,
            max_pinned_fraction=cpu.max_pinned_fraction,
            direct_io=disk.enabled and disk.o_direct,
            region=region,
        )
        try:
            tiers = await open_tiers(config)
            manager = StorageManager(
                cpu_tier, tiers, check=chunk_check, write_wait_s=config.write_wait_s
            )
            await manager.start()
        except BaseException:
            cpu_tier.pool.close()
            raise
        self._manager = manager
        try:
            if config.events.enabled:
                self._publisher = self._publish_events(manager)
            self._services = await open_services(config, node_feed(manager))
        except BaseException:
            if self._publisher is not None:
                self._publisher.stop()
                self._publisher = None
            await manager.close(0)
            self._manager = None
            cpu_tier.pool.close()
            raise
        return chunk_check

    def _publish_events(self, manager: StorageManager) -> EventPublisher:
        """The KV-event publisher of this store's tiers (:mod:`lmtier.events`)."""
        # pyzmq is the `events` extra: imported only where events are published.
        from lmtier.events.publisher import EventPublisher  # noqa: PLC0415

        cpu_tier, lock = manager.cpu_tier, manager.lock

        def snapshot() -> list[ChunkKey]:
            with lock:
                return cpu_tier.keys()

        return EventPublisher(
            self.config.events,
            manager.events,
            block_size=self.config.chunk_size,
            snapshot=snapshot,
            memory_tier=cpu_tier.name,
        ).start()

    @property
    def event_publisher(self) -> EventPublisher | None:
        """The KV-event publisher, when ``events.enabled``."""
        return self._publisher

    @property
    def manager(self) -> StorageManager:
        """The manager, for code on the loop it was opened on (the sidecar's handlers)."""
        manager = self._manager
        if manager is None:
            raise CacheClosedError("this store is not open")
        return manager

    @property
    def pool(self) -> HostPool:
        """The host pool every slab of this store is in."""
        return self.manager.cpu_tier.pool

    def host_view(self) -> HostView:
        """The CPU tier as the peer listener serves it (:class:`HostView`)."""
        manager = self.manager
        return HostView(manager.cpu_tier, manager.lock, manager.writes.sealer)

    async def attach_node(self, node: LocalNode) -> None:
        """Tell the tiers that publish this node (:class:`~lmtier.storage.node.SharesNode`:
        the peer tier) the address it serves its CPU tier on."""
        for tier in self.manager.tiers:
            if isinstance(tier, SharesNode):
                await tier.attach_node(node)

    def tier_stats(self) -> dict[str, TierStats]:
        """Each tier's counters, host memory's first (a snapshot any thread may take)."""
        manager = self.manager
        return {tier.name: tier.stats for tier in (manager.cpu_tier, *manager.tiers)}

    def queue_depths(self) -> dict[str, int]:
        """Per tier below host memory: writes queued for it now (where it can tell)."""
        manager, out = self.manager, {}
        for tier in manager.tiers:
            depth = manager.writes.depth(tier)
            if depth is None:  # a tier without writes may still have work waiting (peer)
                depth = tier.usage().get("pending")
            if depth is not None:
                out[tier.name] = int(depth)
        return out

    # ---- closing -------------------------------------------------------------------

    async def shut(self, flush_s: float | None) -> None:
        """Flush queued writes (up to ``flush_s``; None: the config's
        ``close_flush_s``) and close the tiers, on the loop the store was opened on;
        the pool stays mapped until :meth:`release`."""
        manager = self._manager
        services, self._services = self._services, []
        for service in services:  # first: the node leaves the fleet before it stops serving
            try:
                await service.close()
            except Exception:
                logger.exception("closing %r failed", service)
        try:
            if manager is not None:
                await manager.close(self.config.close_flush_s if flush_s is None else flush_s)
        finally:
            publisher, self._publisher = self._publisher, None
            if publisher is not None:  # after the close: what it wrote is published too
                publisher.stop()

    def release(self) -> None:
        """Free the host pool (after :meth:`shut`); the store cannot be used again."""
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.cpu_tier.pool.close()

    def close(self, timeout_s: float | None) -> None:
        runtime = self._runtime
        if runtime is None:
            return
        timed_out = False
        try:
            runtime.run(self.shut(None), timeout_s)
        except TimeoutError:
            if timeout_s is None:
                raise
            # At exit: the loop's thread is a daemon, it ends with the process.
            timed_out = True
            logger.warning("exit: closing the cache took over %g s; not waiting more", timeout_s)
        finally:
            if not timed_out:
                runtime.stop()
                self._runtime = None
                self.release()

    # ---- the ChunkStore calls ------------------------------------------------------

    def _run(self) -> tuple[StorageManager, Runtime]:
        manager, runtime = self._manager, self._runtime
        if manager is None or runtime is None:
            raise CacheClosedError("this store is not open")
        return manager, runtime

    def check(self, namespace: Namespace) -> None:
        """Nothing to check: this process holds the chunks itself."""

    def lookup(self, keys: Sequence[ChunkKey], *, local_only: bool) -> Lookup:
        manager, runtime = self._run()
        if local_only:
            return manager.lookup_local(keys)
        # In-memory indexes answer in this thread; only tiers that need I/O cost a
        # hop to the runtime's loop (~60 us here: more than the lookup itself).
        found = manager.lookup_now(keys)
        return found if found is not None else runtime.run(manager.lookup(keys))

    def name_chunks(self, names: Mapping[ChunkKey, ChunkName]) -> None:
        manager = self._manager
        if manager is not None:
            manager.events.name(names)

    def lookup_now(self, keys: Sequence[ChunkKey]) -> Lookup | None:
        return self._run()[0].lookup_now(keys)

    def load(self, keys: Sequence[ChunkKey], lookup: Lookup | None) -> list[LoadedChunk]:
        manager, runtime = self._run()
        # Host-memory hits in this thread; a hop to the loop only for a lower tier.
        chunks = manager.reads.get_now(keys, lookup)
        return chunks if chunks is not None else runtime.run(manager.get(keys, lookup))

    def reserve(
        self, keys: Sequence[ChunkKey], skip: int | None, count: int
    ) -> tuple[int, Reserved]:
        """What the local tiers hold (``skip`` when given), and the free slabs for up
        to ``count`` of the rest, taken now without waiting (evicting idle chunks); a
        store takes more (:meth:`acquire_slabs`) only once these run out."""
        manager = self._run()[0]
        present = skip if skip is not None else manager.lookup_local(keys).num_chunks
        wanted = min(count, len(keys) - present)
        return present, Reserved(manager.acquire_slabs(wanted) if wanted > 0 else ())

    def acquire_slabs(self, count: int, *, wait: bool = True) -> list[SlabHandle]:
        """Free slabs, in address order (the chunks a store writes into them load as one
        run: ``LoadResult.kv`` copies evenly spaced slabs in one call); with ``wait``,
        a pool held by pending writes is waited for while writes keep landing
        (``write_wait_s``: :mod:`lmtier.storage.room`)."""
        return self._run()[0].acquire_slabs(count, True, wait=wait) if count > 0 else []

    @property
    def seal_on_copy(self) -> bool:
        """True when some tier takes a stored chunk at once (write-through) and its seal
        is the checksum alone: with an integrity key, the MAC (~20x the copy) stays
        off the storing thread (:mod:`lmtier.storage.sealing`). False while closed."""
        manager = self._manager
        if manager is None or manager.check.mac is not None:
            return False
        return any(tier.properties.write_policy == "write_through" for tier in manager.tiers)

    def hand_over(self, encoded: Encoded) -> Callable[[], int]:
        """Deferred to the function returned, which :func:`lmtier.storing.store_chunks`
        calls once its copies are done (or before it waits for slabs): the CPU tier
        adopts the slabs then, and lower tiers write them in the background. Writes
        begun while the caller still copies would take the CPUs and the memory
        bandwidth its copies need (a 256 MiB store beside the disk tier's writes took
        0.1 s, 0.03 s alone). A full write queue is waited for while writes keep
        landing (``write_wait_s``)."""
        manager = self._run()[0]
        return lambda: manager.put_many(encoded, wait=True) if encoded else 0

    def host_memory(self) -> HostMemory:
        manager = self._run()[0]
        pool = manager.cpu_tier.pool
        return HostMemory(
            total_bytes=pool.nbytes,
            slab_bytes=pool.slab_bytes,
            slabs=pool.num_slabs,
            slabs_in_use=pool.num_in_use,
            cached_chunks=len(manager.cpu_tier),
            cache_capacity_chunks=manager.cpu_tier.max_chunks,
        )

    def in_memory(self, key: ChunkKey) -> bool:
        return key in self._run()[0].cpu_tier

    def add_evict_listener(self, callback: EvictListener) -> None:
        self._run()[0].add_evict_listener(callback)

    def remove_evict_listener(self, callback: EvictListener) -> None:
        manager = self._manager
        if manager is not None:
            manager.remove_evict_listener(callback)

    def flush(self) -> None:
        manager, runtime = self._run()
        runtime.run(manager.flush())

    def stats(self) -> dict[str, dict[str, object]]:
        manager, runtime = self._run()
        return runtime.call(manager.stats)

    def purge(self, namespace: Namespace, *, dry_run: bool) -> dict[str, int]:
        manager, runtime = self._run()
        if dry_run:
            return runtime.run(manager.count_namespace(namespace.digest))
        return runtime.run(manager.purge(namespace.digest))

    def pin(self, keys: Sequence[ChunkKey]) -> dict[str, int]:
        manager, runtime = self._run()
        return runtime.run(manager.pin(keys))

    def unpin(self, keys: Sequence[ChunkKey] | None) -> dict[str, int]:
        manager, runtime = self._run()
        return runtime.run(manager.unpin(keys))


def node_feed(manager: StorageManager) -> NodeFeed:
    """The events of ``manager``'s tiers and what they hold now (:class:`NodeFeed`)."""

    def held() -> dict[str, list[ChunkKey]]:
        with manager.lock:
            tiers = (manager.cpu_tier, *manager.tiers)
            listed = {tier.name: tier.keys_now() for tier in tiers}
        return {name: keys for name, keys in listed.items() if keys is not None}

    tiers = {manager.cpu_tier.name: False}
    for tier in manager.tiers:
        if tier.properties.write_policy != "none":
            tiers[tier.name] = tier.properties.shared
    return NodeFeed(manager.events, held, tiers)
