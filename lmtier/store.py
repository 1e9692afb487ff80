"""The seam under the facade: :class:`ChunkStore`, where a cache's chunks live.

:class:`~lmtier.api.LMTier` hashes tokens, checks arguments and frames KV into
slabs; everything that touches stored chunks goes through the one store it holds,
as an ``httpx.Client`` sends through its transport. Two stores exist:

* :class:`~lmtier.local_store.LocalStore`: host memory and the configured tiers in
  this process (``LMTier.open``; also what ``lmtier serve`` serves);
* :class:`~lmtier.remote.client.SidecarStore`: the same calls over gRPC to a
  sidecar that owns them (``lmtier.connect``).

The facade checks every argument before it calls the store (keys are 32-byte chunk
keys of one namespace the facade made, counts are ints >= 0) and calls it only
between :meth:`ChunkStore.start` and :meth:`ChunkStore.close`; a store checks
nothing of that again. A store that cannot reach its chunks (a tier or a sidecar
down) answers with misses, never an error, except where a method says otherwise.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from lmtier.chunks.keys import ChunkKey, Namespace
from lmtier.kv_spec import ChunkFramer, KVSpec
from lmtier.storage.host_pool import SlabHandle

if TYPE_CHECKING:
    from lmtier.results import HostMemory
    from lmtier.storage.events import ChunkName
    from lmtier.storage.lookup import LoadedChunk, Lookup
    from lmtier.storage.manager import EvictListener


__all__ = ["ChunkStore", "Encoded", "Reserved", "StoreLayout"]


Encoded = list[tuple[ChunkKey, SlabHandle, int]]
"""Filled slabs: ``(key, lease, encoded length)``."""


class Reserved:
    """Slabs reserved for a store: those in hand, and those ``coming`` (functions that
    wait for the answer of a call in flight and return its slabs, none if it failed;
    called in order, in the store's thread). Every slab ends up taken or released:
    :meth:`release`, which the store calls once it has handed over its last chunk,
    waits for what is still coming, so no lease is left unanswered, and then calls
    ``done``. ``refused``: the cache takes nothing now (a sidecar that does not
    answer): the store stores nothing, and asks for no slab."""

    __slots__ = ("_coming", "_done", "_ready", "refused")

    def __init__(
        self,
        ready: Iterable[SlabHandle] = (),
        coming: Iterable[Callable[[], list[SlabHandle]]] = (),
        *,
        done: Callable[[], None] | None = None,
        refused: bool = False,
    ) -> None:
        self._ready = list(ready)
        self._coming = deque(coming)
        self._done = done
        self.refused = refused

    def take(self, count: int) -> list[SlabHandle]:
        """Up to ``count`` slabs (fewer when the reservation runs out)."""
        while len(self._ready) < count and self._coming:
            self._ready += self._coming.popleft()()
        taken, self._ready = self._ready[:count], self._ready[count:]
        return taken

    def release(self) -> None:
        """Give back every slab not taken, those still coming included; then tell the
        cache (``done``) that the store has handed over its last chunk."""
        try:
            while self._coming:
                self._ready += self._coming.popleft()()
        finally:
            ready, self._ready = self._ready, []
            for handle in ready:
                handle.release()
            done, self._done = self._done, None
            if done is not None:
                done()


@dataclass(frozen=True)
class StoreLayout:
    """What a store learns of its facade when it starts: the chunks' geometry and the
    namespaces their keys belong to (a key's first 16 bytes are its namespace's
    digest)."""

    kv_spec: KVSpec
    chunk_size: int
    framer: ChunkFramer
    """The facade's framer: its template's encoded size is every chunk's length."""
    base: Namespace
    """The model's namespace without a cache salt."""
    namespace_of: Callable[[bytes], Namespace]
    """The namespace the facade made with this digest (InvalidRequestError if none)."""


class ChunkStore(Protocol):
    """Where a facade's chunks live (module docstring). Every method may be called
    from any thread."""

    store_batch: int
    """Chunks :func:`lmtier.storing.store_chunks` frames per hand-over."""
    holds_writes: bool
    """Whether writes this store counted as stored may still be queued in this
    process (then the facade closes it at interpreter exit: :mod:`lmtier.exiting`)."""

    @property
    def seal_on_copy(self) -> bool:
        """Whether :func:`lmtier.storing.store_chunks` should frame chunks sealed,
        hashing each as it is copied (:meth:`lmtier.kv_spec.ChunkFramer.write_many`):
        chunks that go below host memory at once are hashed anyway, and from the cache
        that costs less than a second pass over memory later."""

    def start(self, layout: StoreLayout) -> None:
        """Open what the chunks need (host memory, tiers, a connection)."""

    def close(self, timeout_s: float | None) -> None:
        """Flush what is queued (within the config's ``close_flush_s``) and release
        everything; ``timeout_s`` bounds the whole close (None: no bound)."""

    def check(self, namespace: Namespace) -> None:
        """Raise why chunks of ``namespace`` cannot be served now (a sidecar that
        does not answer or refuses the token or namespace); nothing if they can."""

    def lookup(self, keys: Sequence[ChunkKey], *, local_only: bool) -> Lookup:
        """How many leading ``keys`` some tier holds (``local_only``: only the tiers
        that answer without I/O)."""

    def lookup_now(self, keys: Sequence[ChunkKey]) -> Lookup | None:
        """:meth:`lookup` if every tier to ask answers without I/O, else None."""

    def load(self, keys: Sequence[ChunkKey], lookup: Lookup | None) -> list[LoadedChunk]:
        """The leading servable chunks of ``keys``, each a lease the caller releases
        (``lookup``: one just made for these keys, to skip a second walk)."""

    def reserve(
        self, keys: Sequence[ChunkKey], skip: int | None, count: int
    ) -> tuple[int, Reserved]:
        """For a store of ``keys``: how many leading ones are cached already (``skip``
        when the caller knows), and slabs reserved for up to ``count`` of the rest."""

    def acquire_slabs(self, count: int, *, wait: bool = True) -> list[SlabHandle]:
        """Up to ``count`` free slabs to encode chunks into (fewer, counted as drops,
        when the pool is held; with ``wait``, after waiting for pending writes to free
        some while they keep landing, up to ``write_wait_s`` without one)."""

    def hand_over(self, encoded: Encoded) -> Callable[[], int]:
        """Give filled slabs to the store (it owns their leases from now on); returns
        a function that says how many were stored (it may wait for an answer, or do
        the hand-over itself: the caller always calls it, before it waits for more
        slabs and on errors too). A full write queue is waited for while writes keep
        landing (``write_wait_s``)."""

    def name_chunks(self, names: Mapping[ChunkKey, ChunkName]) -> None:
        """What the engine calls these chunks (its block hashes), for the events of the
        store's tiers (:meth:`lmtier.storage.events.TierEvents.name`)."""

    def host_memory(self) -> HostMemory:
        """What this process holds in host memory for the store."""

    def in_memory(self, key: ChunkKey) -> bool:
        """Whether ``key`` is in this process's CPU tier now."""

    def add_evict_listener(self, callback: EvictListener) -> None:
        """Call ``callback(key)`` for every chunk this process's CPU tier evicts."""

    def remove_evict_listener(self, callback: EvictListener) -> None:
        """Stop calling ``callback``."""

    def flush(self) -> None:
        """Until the background writes queued so far have been attempted."""

    def stats(self) -> dict[str, dict[str, object]]:
        """Per tier: counters and what it holds where it can tell."""

    def purge(self, namespace: Namespace, *, dry_run: bool) -> dict[str, int]:
        """Delete (``dry_run``: count) every chunk of ``namespace``, per tier."""

    def pin(self, keys: Sequence[ChunkKey]) -> dict[str, int]:
        """Keep these chunks out of LRU eviction; per tier, how many are pinned."""

    def unpin(self, keys: Sequence[ChunkKey] | None) -> dict[str, int]:
        """Make pinned chunks evictable again (None: every pinned chunk the store's
        caller may unpin); per tier, how many were pinned."""
