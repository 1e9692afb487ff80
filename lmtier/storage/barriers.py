"""Purge barriers: which namespaces are being purged, and since when each last was.

A purge (:mod:`lmtier.storage.purging`) begins and ends a barrier; the background
writes (:mod:`lmtier.storage.writes`) and the loads (:mod:`lmtier.storage.reads`)
consult it so that a chunk a purge deleted does not come back (the purging module's
docstring says what it covers). It has a module of its own because the writes and
the purge both need it and the purge also drives the writes: with it here, the
imports run purging -> writes -> barriers, one way.
"""

from __future__ import annotations

from collections import Counter

from lmtier.chunks.keys import NAMESPACE_BYTES, ChunkKey

__all__ = ["PurgeBarriers"]


class PurgeBarriers:
    """Which namespaces are being purged, and since when each was last (module docstring).

    Changed only under the StorageManager's lock; read under it (stores, promotions,
    queueing) or on the loop's thread (writers), which is also where purges begin and
    end. A write or a load takes a *stamp*, :attr:`epoch` when it began (a plain int
    read); one purge begun since makes it :meth:`stale`. One int is kept per namespace
    ever purged.
    """

    __slots__ = ("_active", "_last", "epoch")

    def __init__(self) -> None:
        self.epoch = 0
        """Advances at every purge; what writes and loads take as their stamp."""
        self._last: dict[bytes, int] = {}
        """Namespace -> the epoch at which its latest purge began."""
        self._active: Counter[bytes] = Counter()
        """Namespaces being purged (two purges of one namespace may overlap)."""

    def begin(self, namespace: bytes) -> None:
        """A purge of ``namespace`` starts: what is stamped before now is stale."""
        self._last[namespace] = self.epoch
        self.epoch += 1
        self._active[namespace] += 1

    def end(self, namespace: bytes) -> None:
        """The purge :meth:`begin` announced is over."""
        self._active[namespace] -= 1
        if self._active[namespace] <= 0:
            del self._active[namespace]

    def purging(self, key: ChunkKey) -> bool:
        """Whether a purge of ``key``'s namespace is running (a store now is refused)."""
        return bool(self._active) and key[:NAMESPACE_BYTES] in self._active

    def stale(self, key: ChunkKey, stamp: int) -> bool:
        """Whether a write or promotion of ``key`` that began at ``stamp`` must not
        happen: a purge of its namespace began since, or is running."""
        if not self._last:
            return False
        namespace = key[:NAMESPACE_BYTES]
        return namespace in self._active or self._last.get(namespace, -1) >= stamp
