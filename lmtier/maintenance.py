"""The cache-wide operations of :class:`~lmtier.api.LMTier`: pins, prefetch, purge,
eviction listeners, flush and stats.

They are what an operator or a warm-up job does to a cache (``lmtier warm``,
``lmtier purge``, ``lmtier stats``), apart from the data path that engines call per
request. :class:`Maintenance` is a base of ``LMTier``; a sidecar client
(:class:`~lmtier.remote.client.SidecarClient`) overrides the ones the sidecar must do
itself, and inherits the rest (prefetch is loads, which it already forwards).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmtier.chunks.keys import KEY_BYTES, ChunkKey, Namespace
from lmtier.errors import InvalidRequestError, brief

if TYPE_CHECKING:
    from lmtier.results import LoadResult
    from lmtier.runtime import Runtime
    from lmtier.storage.manager import EvictListener, StorageManager

__all__ = ["PREFETCH_BATCH", "Maintenance", "checked_keys"]

PREFETCH_BATCH = 32
"""Chunks :meth:`Maintenance.prefetch_keys` holds at once (64 MiB of 2 MiB chunks):
a prompt of any length is brought in without needing host memory for all of it."""


def checked_keys(keys: object) -> Sequence[ChunkKey]:
    """``keys`` if it is a sequence of 32-byte chunk keys; InvalidRequestError if not."""
    if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
        raise InvalidRequestError(f"keys must be a sequence of chunk keys, got {brief(keys)}")
    for key in keys:
        if type(key) is not bytes or len(key) != KEY_BYTES:
            raise InvalidRequestError(f"a chunk key is {KEY_BYTES} bytes, got {brief(key)}")
    return keys


class Maintenance(ABC):
    """Cache-wide operations, on top of what the cache's data path provides."""

    _runtime: Runtime
    _manager: StorageManager | None

    @abstractmethod
    def _require(self) -> StorageManager:
        """The StorageManager (CacheClosedError when there is none)."""

    @abstractmethod
    def namespace(self, cache_salt: str = "") -> Namespace:
        """This model's namespace for one tenant's ``cache_salt``."""

    @abstractmethod
    def load_keys(self, keys: Sequence[ChunkKey]) -> LoadResult:
        """Load the leading servable chunks of ``keys``."""

    # ---- pins and prefetch -------------------------------------------------------

    def pin_keys(self, keys: Sequence[ChunkKey]) -> dict[str, int]:
        """Keep the chunks of ``keys`` out of LRU eviction in the tiers that evict by LRU
        (host memory, disk), within each tier's ``max_pinned_fraction`` of capacity: a
        warmed system prompt stays cached whatever other traffic passes. Per tier name,
        how many of ``keys`` it has pinned now (-1: the tier failed). Chunks a tier does
        not hold are skipped, so call :meth:`flush` after storing. Disk pins survive
        restarts; host-memory pins last as long as this cache (or its sidecar)."""
        keys = checked_keys(keys)
        return self._runtime.run(self._require().pin(keys))

    def unpin_keys(self, keys: Sequence[ChunkKey] | None = None) -> dict[str, int]:
        """Make pinned chunks evictable again (``keys`` None: every pinned chunk of every
        namespace); per tier name, how many were pinned (-1: the tier failed)."""
        if keys is not None:
            keys = checked_keys(keys)
        return self._runtime.run(self._require().unpin(keys))

    def prefetch_keys(self, keys: Sequence[ChunkKey]) -> dict[str, int]:
        """Bring the leading cached chunks of ``keys`` into this node's fast tiers: each
        is read from the tier that holds it and promoted as a load promotes it (into
        host memory, and written to every tier above its source: a Redis or S3 hit lands
        on local disk), without being copied out. Reads ``PREFETCH_BATCH`` chunks at a
        time and stops at the first miss; waits for the writes (:meth:`flush`). Per
        source tier name, how many chunks came from it."""
        keys = checked_keys(keys)
        served: dict[str, int] = {}
        for start in range(0, len(keys), PREFETCH_BATCH):
            part = keys[start : start + PREFETCH_BATCH]
            with self.load_keys(part) as hit:
                count = len(hit.chunks)
                for chunk in hit.chunks:
                    served[chunk.tier] = served.get(chunk.tier, 0) + 1
            if count < len(part):
                break
        self.flush()
        return served

    # ---- the rest ----------------------------------------------------------------

    def add_evict_listener(self, callback: EvictListener) -> None:
        """Call ``callback(key)`` with the key of every chunk the CPU tier evicts from
        now on (the chunk may still be in a lower tier). Registration is thread-safe;
        the callback runs inside the eviction, under the cache's lock, in the thread
        that caused it (the runtime's loop, or one calling ``store`` or
        ``put_encoded``), so it must be quick, thread-safe, and must not call back
        into this cache. One that raises is logged and ignored."""
        self._require().add_evict_listener(callback)

    def remove_evict_listener(self, callback: EvictListener) -> None:
        """Stop calling ``callback`` (a no-op once the cache is closed)."""
        manager = self._manager
        if manager is not None:
            manager.remove_evict_listener(callback)

    def purge(self, cache_salt: str = "", *, dry_run: bool = False) -> dict[str, int]:
        """Delete every chunk of this model's namespace under ``cache_salt`` from every
        tier; chunks deleted by tier name (-1: the tier failed, -2: it cannot list).
        With ``dry_run``, delete nothing: count what would go."""
        manager, digest = self._require(), self.namespace(cache_salt).digest
        if dry_run:
            return self._runtime.run(manager.count_namespace(digest))
        return self._runtime.run(manager.purge(digest))

    def flush(self) -> None:
        """Wait until background writes queued so far have been attempted."""
        self._runtime.run(self._require().flush())

    def stats(self) -> dict[str, dict[str, object]]:
        """Per tier: counters (:class:`~lmtier.storage.stats.TierStats`), and what it
        holds where it can tell (``Tier.usage``: capacity, used, chunks, pins)."""
        return self._runtime.call(self._require().stats)
