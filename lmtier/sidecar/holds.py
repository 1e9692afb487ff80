"""Slabs the sidecar holds for a streaming call (``LoadStream``, ``StoreStream``),
reclaimed as a lease is.

A shared-memory client's slabs are leases of its session: ended with the session and
reclaimed past ``lease_ttl_s``. A streaming call's slabs are held by the call itself,
in the sidecar, while the stream moves their bytes; a peer that stops reading (or
sending) mid-stream would hold them for as long as it keeps the stream open. So they
are reclaimed after ``lease_ttl_s`` too: a load stream then ends at the next chunk
(the rest is a miss to the client), a store stream drops the chunk it was receiving.
Reclaiming runs on the event loop, like the handlers: never in the middle of a copy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from lmtier.chunks.keys import ChunkKey
from lmtier.errors import InvalidRequestError
from lmtier.sidecar.pieces import Piece
from lmtier.storage.lookup import LoadedChunk
from lmtier.storage.memory import SlabHandle

__all__ = ["Incoming", "let_go", "reclaim_after"]


def let_go(handle: SlabHandle) -> None:
    """Release ``handle`` unless a reclaim (or its holder) already did."""
    if not handle.released:
        handle.release()


def _let_go_all(chunks: Sequence[LoadedChunk]) -> None:
    for loaded in chunks:
        let_go(loaded.handle)


def reclaim_after(ttl_s: float, chunks: Sequence[LoadedChunk]) -> asyncio.TimerHandle:
    """Release the slabs of ``chunks`` still held in ``ttl_s`` (cancel it once done)."""
    return asyncio.get_running_loop().call_later(ttl_s, _let_go_all, chunks)


class Incoming:
    """The chunk a ``StoreStream`` is receiving, filled piece by piece in order into
    ``handle`` (None: the pool had no slab, and the chunk is dropped). The slab is
    reclaimed ``ttl_s`` after the chunk began unless it is complete by then."""

    __slots__ = ("_reclaim", "filled", "handle", "key", "length")

    def __init__(self, key: ChunkKey, length: int, handle: SlabHandle | None, ttl_s: float) -> None:
        self.key, self.length, self.filled, self.handle = key, length, 0, handle
        self._reclaim = (
            None if handle is None else asyncio.get_running_loop().call_later(ttl_s, let_go, handle)
        )

    def add(self, piece: Piece) -> bool:
        """Write the next piece; whether the chunk is complete."""
        end = self.filled + len(piece.data)
        if piece.offset != self.filled or end > self.length:
            raise InvalidRequestError("chunk pieces must come in order, within its length")
        if self.handle is not None and self.handle.released:
            self.handle = None  # reclaimed: the chunk is dropped
        if self.handle is not None:
            self.handle.view[self.filled : end] = piece.data
        self.filled = end
        return end == self.length

    def take(self) -> SlabHandle | None:
        """The complete chunk's slab, the caller's from now on (None: dropped)."""
        self._stop()
        handle, self.handle = self.handle, None
        return handle

    def close(self) -> None:
        """Give the slab back (the stream failed or ended inside the chunk)."""
        self._stop()
        if self.handle is not None:
            let_go(self.handle)
            self.handle = None

    def _stop(self) -> None:
        if self._reclaim is not None:
            self._reclaim.cancel()
            self._reclaim = None
