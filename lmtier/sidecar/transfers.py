"""The work of the streaming calls, ``LoadStream`` and ``StoreStream``: chunk bytes out
of and into the sidecar's pool, in :mod:`.pieces`, through a
:class:`~lmtier.sidecar.holds.StreamHold` (the caller's share of the slabs, and the
reclaim of a stream that stalls). :mod:`.service` checks the caller and the session.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from lmtier.chunks.keys import ChunkKey
from lmtier.errors import InvalidRequestError
from lmtier.sidecar.holds import Incoming, StreamHold
from lmtier.sidecar.sessions import Session
from lmtier.storage.host_pool import SlabHandle
from lmtier.storage.lookup import Lookup, TierSpan
from lmtier.storage.manager import StorageManager
from lmtier.wire.pieces import Piece, chunk_pieces, decode_piece

__all__ = ["ChunkChecker", "clipped", "receive_chunks", "send_chunks"]

ChunkChecker = Callable[[Session, ChunkKey, SlabHandle, int, int], None]
"""Checks a received chunk (session, key, slab, length, index); raises if it is not
one the session may store."""


async def send_chunks(
    manager: StorageManager,
    hold: StreamHold,
    keys: list[ChunkKey],
    lookup: Lookup | None,
    piece_bytes: int,
) -> AsyncIterator[bytes]:
    """``LoadStream``'s messages: the cached prefix of ``keys`` loaded in batches of at
    most what the caller's share leaves room for (none at all: CapacityError), each
    chunk's slab let go once its messages are made (they hold copies). A slab the hold
    reclaimed (the reader stopped reading) ends the stream there: the rest is a miss."""
    start = 0
    while start < len(keys):
        counted = hold.reserve(len(keys) - start, required=start == 0)
        if not counted:
            return  # the caller's other calls hold its share: the rest is a miss
        batch = await manager.get(
            keys[start : start + counted], clipped(lookup, start, start + counted)
        )
        for loaded in batch:
            hold.hold(loaded.handle)
        hold.unreserve()
        hold.moved()  # the tiers took that time, not the reader
        for loaded in batch:
            if not hold.holds(loaded.handle):
                return
            decoded = loaded.chunk
            length = decoded.payload_offset + len(decoded.payload)
            view = loaded.handle.view
            pieces = list(chunk_pieces(loaded.key, view, length, piece_bytes, tier=loaded.tier))
            hold.let_go(loaded.handle)
            for piece in pieces:
                yield piece
                hold.moved()
        if len(batch) < counted:
            return  # a miss ends the prefix
        start += counted


async def receive_chunks(
    manager: StorageManager,
    hold: StreamHold,
    messages: AsyncIterator[bytes],
    *,
    slab_bytes: int,
    session_of: Callable[[bytes], Session],
    check: ChunkChecker,
) -> tuple[int, int]:
    """``StoreStream``'s work: each chunk's pieces into a slab, then to the cache;
    (stored, dropped). ``session_of`` finds the session the first piece names. A chunk
    with no slab (none free, or the caller's share full) or whose slab was reclaimed
    mid-chunk (the stream stalled) is dropped."""
    session: Session | None = None
    stored = dropped = 0
    current: Incoming | None = None
    try:
        async for raw in messages:
            hold.moved()
            piece = decode_piece(raw)
            if session is None:
                session = session_of(piece.session_id)
            if current is None:  # a new chunk starts
                current = _incoming(manager, hold, piece, slab_bytes)
            if not current.add(piece):
                continue
            key, length, handle = current.key, current.length, current.take()
            current = None
            if handle is None:
                dropped += 1
                continue
            try:
                check(session, key, handle, length, stored + dropped)
            except BaseException:
                handle.release()
                raise
            try:
                await manager.room_for_store()  # back-pressure, never blocking the loop
            except BaseException:
                handle.release()
                raise
            done = manager.put(key, handle, length)
            stored += done
            dropped += 1 - done
        if current is not None:
            raise InvalidRequestError("the stream ended inside a chunk")
    finally:
        if current is not None:
            current.close()
    return stored, dropped


def _incoming(manager: StorageManager, hold: StreamHold, piece: Piece, slab_bytes: int) -> Incoming:
    """The chunk a store stream's piece starts, with a slab if one is free and the
    caller's share has room (else the chunk is dropped: a caller's own stalled streams
    cost its stores, never another's)."""
    if piece.offset != 0 or not piece.key:
        raise InvalidRequestError("a chunk's first piece has its key, offset 0")
    if not 0 < piece.total_length <= slab_bytes:
        raise InvalidRequestError(f"a chunk of {piece.total_length} bytes does not fit a slab")
    handle = None
    if hold.reserve(1):
        got = manager.acquire_slabs(1, True)
        if got:
            handle = got[0]
            hold.hold(handle)
        hold.unreserve()
    return Incoming(ChunkKey(piece.key), piece.total_length, handle, hold)


def clipped(found: Lookup | None, start: int, stop: int) -> Lookup | None:
    """The part of a lookup of keys ``[0, n)`` that covers ``[start, stop)``, counted
    from ``start`` (what :meth:`StorageManager.get` takes for that slice of keys)."""
    if found is None:
        return None
    stop = min(stop, found.num_chunks)
    spans = tuple(
        TierSpan(span.tier, max(span.start, start) - start, min(span.stop, stop) - start)
        for span in found.spans
        if span.start < stop and span.stop > start
    )
    return Lookup(max(0, stop - start), spans)
