"""The loop of :meth:`lmtier.LMTier.store`: skip what is cached, take slabs, copy each
chunk's KV into its slab, hand the slabs over; in batches.

It runs in the caller's thread and reaches storage only through the cache's hooks,
so that an embedded cache and a sidecar's client share it:

* ``_reserve(keys, skip, count)``: how many leading chunks are cached already, and
  :class:`Reserved` slabs for (up to ``count`` of) the rest, or none. Embedded: a
  lookup of the local tiers; a sidecar client: an AcquireSlabs round trip that
  answers both for the first batch, and one more for the rest whose answer comes
  while the first batch is copied.
* ``acquire_slabs(n)``: more slabs when the reserved ones run out.
* ``_hand_over(encoded)``: give filled slabs to the cache; returns a function that
  says how many were stored. Embedded: done at once; a sidecar client: a Commit in
  flight while the next batch is copied.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from lmtier.chunks.keys import ChunkKey
from lmtier.errors import InvalidKVError
from lmtier.kv_spec import ChunkFramer, KVSource, KVSpec, check_kv, narrow_kv
from lmtier.storage.memory import SlabHandle

__all__ = ["Encoded", "Reserved", "StoreHooks", "store_chunks"]

Encoded = list[tuple[ChunkKey, SlabHandle, int]]
"""Filled slabs: ``(key, lease, encoded length)``."""


class Reserved:
    """Slabs reserved for a store: those in hand, and those ``coming`` (functions that
    wait for the answer of a call in flight and return its slabs, none if it failed;
    called in order, in the store's thread). Every slab ends up taken or released:
    :meth:`release`, which the store calls once it has handed over its last chunk,
    waits for what is still coming, so no lease is left unanswered, and then calls
    ``done``."""

    __slots__ = ("_coming", "_done", "_ready")

    def __init__(
        self,
        ready: Iterable[SlabHandle] = (),
        coming: Iterable[Callable[[], list[SlabHandle]]] = (),
        *,
        done: Callable[[], None] | None = None,
    ) -> None:
        self._ready = list(ready)
        self._coming = deque(coming)
        self._done = done

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


class StoreHooks(Protocol):
    """What :func:`store_chunks` needs of a cache (see the module docstring)."""

    kv_spec: KVSpec
    chunk_size: int
    store_batch: int
    _framer: ChunkFramer

    def _reserve(
        self, keys: Sequence[ChunkKey], skip: int | None, count: int
    ) -> tuple[int, Reserved]: ...

    def acquire_slabs(self, count: int) -> list[SlabHandle]: ...

    def _hand_over(self, encoded: Encoded) -> Callable[[], int]: ...


def store_chunks(
    cache: StoreHooks, keys: Sequence[ChunkKey], kv: KVSource, skip: int | None
) -> int:
    """Store the chunks of ``keys`` not cached yet from ``kv``; how many were stored
    (:meth:`lmtier.LMTier.store_keys`). ``skip`` is checked by the caller."""
    covered = check_kv(kv, cache.kv_spec)
    if covered < len(keys) * cache.chunk_size:
        raise InvalidKVError(
            f"kv covers {covered} tokens; the {len(keys)} full chunks of these tokens "
            f"need {len(keys) * cache.chunk_size}"
        )
    present, reserved = cache._reserve(keys, skip, max(0, len(keys) - (skip or 0)))
    framer, size, step, ctime = cache._framer, cache.chunk_size, cache.store_batch, time.time()
    waits: list[Callable[[], int]] = []
    try:
        for first in range(present, len(keys), step):
            batch = range(first, min(first + step, len(keys)))
            handles = reserved.take(len(batch))
            if len(handles) < len(batch):
                handles += cache.acquire_slabs(len(batch) - len(handles))
            encoded: Encoded = []
            try:
                for index, handle in zip(batch, handles, strict=False):
                    part = narrow_kv(kv, cache.kv_spec, index * size, size)
                    encoded.append(
                        (keys[index], handle, framer.write(handle, keys[index], part, ctime))
                    )
            except BaseException:
                for handle in handles:
                    handle.release()
                raise
            waits.append(cache._hand_over(encoded))
            if len(handles) < len(batch):
                break  # the pool is exhausted by readers and pending writes: drop the rest
    finally:
        reserved.release()  # reserved for chunks not stored after all
    return sum(wait() for wait in waits)
