"""The loop of :meth:`lmtier.LMTier.store`: skip what is cached, take slabs, copy each
chunk's KV into its slab, hand the slabs over; in batches.

It runs in the caller's thread and reaches storage only through the cache's
:class:`~lmtier.store.ChunkStore`, so that an embedded cache and a sidecar's client
share it:

* ``reserve(keys, skip, count)``: how many leading chunks are cached already, and
  :class:`~lmtier.store.Reserved` slabs for (up to ``count`` of) the rest, or none. Embedded: a
  lookup of the local tiers; a sidecar client: an AcquireSlabs round trip that
  answers both for the first batch, and one more for the rest whose answer comes
  while the first batch is copied. A reservation ``refused`` (a sidecar that does not
  answer) stores nothing.
* ``acquire_slabs(n)``: more slabs when the reserved ones run out (the hand-overs
  so far are settled first: their slabs may be what frees room).
* ``hand_over(encoded)``: give filled slabs to the cache; returns a function that
  says how many were stored, always called (on errors too). Embedded: the function
  does the hand-over, once the copies are done, so that background writes do not
  compete with them; a sidecar client: a Commit in flight while the next batch is
  copied, the function waits for its answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from lmtier.chunks.keys import ChunkKey
from lmtier.errors import InvalidKVError
from lmtier.kv_spec import KVSource, check_kv, narrow_kv
from lmtier.store import ChunkStore, Encoded, StoreLayout

__all__ = ["store_chunks", "store_pages"]


def store_chunks(
    store: ChunkStore,
    layout: StoreLayout,
    keys: Sequence[ChunkKey],
    kv: KVSource,
    skip: int | None,
) -> int:
    """Store the chunks of ``keys`` not cached yet from ``kv`` into ``store``; how many
    were stored (:meth:`lmtier.LMTier.store_keys`). ``skip`` is checked by the caller."""
    spec, size = layout.kv_spec, layout.chunk_size
    covered = check_kv(kv, spec)
    if covered < len(keys) * size:
        raise InvalidKVError(
            f"kv covers {covered} tokens; the {len(keys)} full chunks of these tokens "
            f"need {len(keys) * size}"
        )
    return _store_each(store, layout, keys, lambda i: narrow_kv(kv, spec, i * size, size), skip)[1]


def store_pages(
    store: ChunkStore,
    layout: StoreLayout,
    keys: Sequence[ChunkKey],
    pages: Sequence[torch.Tensor],
    skip: int | None,
) -> tuple[int, int]:
    """:meth:`lmtier.LMTier.store_pages`: each of ``pages`` checked to be one chunk's
    KV (InvalidKVError naming the first that is not), then stored as chunk ``i``. How
    many leading chunks were held already, and how many of the rest were stored."""
    if len(pages) != len(keys):
        raise InvalidKVError(f"got {len(pages)} pages for {len(keys)} keys")
    for at, page in enumerate(pages):
        if not isinstance(page, torch.Tensor):
            raise InvalidKVError(f"page {at} is a {type(page).__name__}, not a tensor")
        covered = check_kv(page, layout.kv_spec)
        if covered != layout.chunk_size:
            raise InvalidKVError(f"page {at} holds {covered} tokens, a chunk {layout.chunk_size}")
    return _store_each(store, layout, keys, pages.__getitem__, skip)


def _store_each(
    store: ChunkStore,
    layout: StoreLayout,
    keys: Sequence[ChunkKey],
    chunk_kv: Callable[[int], KVSource],
    skip: int | None,
) -> tuple[int, int]:
    """:func:`store_chunks` with chunk ``i``'s KV from ``chunk_kv(i)`` (one chunk's KV,
    already checked: :meth:`lmtier.LMTier.store_pages`): how many leading chunks were
    held already (``skip`` when given), and how many of the rest were stored."""
    present, reserved = store.reserve(keys, skip, max(0, len(keys) - (skip or 0)))
    if reserved.refused:
        return present, 0
    framer, step, ctime = layout.framer, store.store_batch, time.time()
    seal = store.seal_on_copy  # asked once a store, not once a batch
    waits: list[Callable[[], int]] = []
    stored = 0

    def settle() -> None:  # every hand-over so far, all of them even if one fails
        nonlocal stored
        pending = waits[:]
        waits.clear()
        failed: BaseException | None = None
        for wait in pending:
            try:
                stored += wait()
            except BaseException as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

    try:
        for first in range(present, len(keys), step):
            batch = range(first, min(first + step, len(keys)))
            handles = reserved.take(len(batch))
            if len(handles) < len(batch):
                settle()
                handles += store.acquire_slabs(len(batch) - len(handles))
            try:
                chunks = [
                    (handle, keys[index], chunk_kv(index))
                    for index, handle in zip(batch, handles, strict=False)
                ]
                # The batch's copies: one shared copy (each chunk hashed after its copy
                # where the store writes it down at once).
                sizes = framer.write_many(chunks, ctime, seal=seal)
                encoded: Encoded = [
                    (key, handle, length)
                    for (handle, key, _), length in zip(chunks, sizes, strict=True)
                ]
            except BaseException:
                for handle in handles:
                    handle.release()
                raise
            waits.append(store.hand_over(encoded))
            if len(handles) < len(batch):
                break  # the pool is exhausted by readers and pending writes: drop the rest
    finally:
        try:
            reserved.release()  # reserved for chunks not stored after all
        finally:
            settle()  # on errors too: every copied chunk's slab is handed over
    return present, stored
