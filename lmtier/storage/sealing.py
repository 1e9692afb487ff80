"""Sealing chunks stored unsealed, before any tier below host memory gets their bytes.

``LMTier.store`` frames each chunk in its slab without a payload checksum or MAC
(:mod:`lmtier.chunks.encoding`): the caller pays one copy of its KV, not a copy plus a
hash pass (plus a MAC pass, ~20x the copy, with an integrity key). Host memory serves
such chunks as they are. (Where a write-through tier takes every chunk at once and
there is no integrity key, the store hashes each chunk right after copying it, from
the cache, and frames it sealed: :meth:`lmtier.kv_spec.ChunkFramer.write_many`. This
sealer then skips it.) Their bytes leave host memory only through the background
writes (:mod:`lmtier.storage.writes`), which hand every batch to :meth:`Sealer.seal`
first: the hash and MAC run in a worker thread, then the sealed header is written over
the unsealed one on the event loop's thread.

Why that split is safe: the only readers of a slab's header are on the loop thread
(serving a host-memory hit decodes the header there), so they never see it half
rewritten; the worker thread reads only the payload, which never changes; the header
has the same length sealed or not (fixed-width packing); and the write lease each
queued write holds keeps the slab from being reused meanwhile. Two tiers' writers
asking for the same slab at once share one sealing (one hash), keyed by slab.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from lmtier.chunks.encoding import MacSigner, seal_header
from lmtier.chunks.format import FLAG_UNSEALED, PREFIX, PREFIX_LEN
from lmtier.errors import CorruptChunk
from lmtier.storage.blocking import finish, run_blocking
from lmtier.storage.host_pool import SlabHandle

__all__ = ["Sealer", "is_sealed"]

logger = logging.getLogger(__name__)


def is_sealed(chunk: memoryview) -> bool:
    """Whether the chunk in ``chunk`` carries its checksum (a look at its prefix flags
    only; bytes too short to hold a prefix count as sealed: decoding will refuse them)."""
    if len(chunk) < PREFIX_LEN:
        return True
    return not PREFIX.unpack_from(chunk)[2] & FLAG_UNSEALED


class Sealer:
    """Seals the chunks of write batches (module docstring). Loop-only, except the
    hashing, which runs in its own thread."""

    def __init__(self, sign: MacSigner | None = None) -> None:
        self.sign = sign
        self.sealed = 0
        """Chunks this sealer has sealed."""
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[int, tuple[asyncio.Future[list[bool]], int]] = {}

    async def seal(self, chunks: Sequence[tuple[SlabHandle, int]]) -> list[bool]:
        """Make sure each ``(slab lease, encoded length)`` holds a sealed chunk; per chunk,
        whether it does now (False: the bytes are not a chunk at all, which is a bug
        somewhere: logged, and its write must be dropped)."""
        ok = [True] * len(chunks)
        mine: list[int] = []
        theirs: dict[int, tuple[asyncio.Future[list[bool]], int]] = {}
        for at, (handle, size) in enumerate(chunks):
            if is_sealed(handle.view[:size]):
                continue
            pending = self._pending.get(handle.index)
            if pending is not None:
                theirs[at] = pending
            else:
                mine.append(at)
        if mine:
            views = [chunks[at][0].view[: chunks[at][1]] for at in mine]
            job = asyncio.ensure_future(self._seal_views(views))
            for position, at in enumerate(mine):
                self._pending[chunks[at][0].index] = (job, position)
            try:
                done = await finish(job)
            finally:
                for at in mine:
                    self._pending.pop(chunks[at][0].index, None)
            for position, at in enumerate(mine):
                ok[at] = done[position]
        for at, (shared, position) in theirs.items():
            ok[at] = (await finish(shared))[position]
        return ok

    async def _seal_views(self, views: list[memoryview]) -> list[bool]:
        """Hash in the thread, then write each sealed header here, on the loop."""
        heads = await run_blocking(self._threads(), [(seal_header, (v, self.sign)) for v in views])
        return [self._apply(view, head) for view, head in zip(views, heads, strict=True)]

    def _apply(self, view: memoryview, head: object) -> bool:
        if isinstance(head, bytes):
            view[: len(head)] = head
            self.sealed += 1
            return True
        if head is None:
            return True  # sealed meanwhile
        reason = head if isinstance(head, CorruptChunk) else repr(head)
        logger.error("a chunk to write down could not be sealed (%s); its write is dropped", reason)
        return False

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lmtier-seal")
        return self._pool

    def close(self) -> None:
        """Stop the hashing thread (after the writers have stopped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
