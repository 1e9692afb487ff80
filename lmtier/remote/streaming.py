"""A streaming client's side of ``LoadStream`` and ``StoreStream``: chunk bytes into
and out of slabs of its private pool, as :mod:`.pieces` cuts them."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import torch

from lmtier.chunks.keys import ChunkKey
from lmtier.errors import HandleError
from lmtier.remote.connection import Connection
from lmtier.storage.host_pool import HostPool, SlabHandle, SoleLease
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.wire.pieces import (
    PIECE_BYTES,
    PieceBuffer,
    bytes_tensor,
    chunk_pieces,
    decode_piece,
)

__all__ = [
    "MessageSlab",
    "ReceivedSlab",
    "StoreSending",
    "StoreStreams",
    "in_messages",
    "receive_chunks",
]

logger = logging.getLogger(__name__)


def receive_chunks(
    connection: Connection, request: pb.LoadRequest, pool: HostPool, most: int
) -> tuple[list[SlabHandle], list[tuple[int, str]]]:
    """Run ``LoadStream``: each whole chunk in a slab of ``pool`` (at most ``most``),
    with its length and tier. A chunk cut short (a failed stream, a full pool, a
    malformed piece) ends the result there: what follows is a miss. A chunk that
    arrives whole in one message is read where it lies (:class:`ReceivedSlab`)
    unless the pool is pinned: copies to a GPU are DMA only out of pinned memory,
    so there the one copy into a slab is what makes them fast."""
    in_place = not pool.pinned
    handles: list[SlabHandle] = []
    meta: list[tuple[int, str]] = []
    filled: list[int] = []
    stream = connection.load_stream(
        request, timeout=connection.timeout_s, metadata=connection.metadata
    )
    try:
        for raw in stream:
            piece = decode_piece(raw)
            if piece.offset == 0:
                if len(handles) == most or not 0 < piece.total_length <= pool.slab_bytes:
                    break
                handle = pool.acquire()
                if handle is None:
                    break  # the private pool is full: the rest is a miss
                handles.append(handle)
                meta.append((piece.total_length, piece.tier))
                filled.append(0)
            end = piece.offset + len(piece.data)
            if not handles or piece.offset != filled[-1] or end > meta[-1][0]:
                break
            if (
                in_place
                and piece.offset == 0
                and end == piece.total_length
                and isinstance(raw, bytes)
            ):
                handles[-1] = ReceivedSlab(pool, handles[-1], raw, piece.data_at, end)
            else:
                handles[-1].view[piece.offset : end] = piece.data
            filled[-1] = end
    except grpc.RpcError as exc:
        connection.failed(exc)
    except ValueError as exc:
        logger.warning("sidecar %s: %s", connection.target, exc)
    finally:
        stream.cancel()
    whole = next((i for i, f in enumerate(filled) if f != meta[i][0]), len(handles))
    for partial in handles[whole:]:
        partial.release()
    return handles[:whole], meta[:whole]


class _StandIn(SoleLease):
    """A lease whose chunk bytes live outside the pool (a message), holding a slab of
    the pool unused meanwhile: the pool still bounds what its users hold. Ending it
    lets the bytes go (:meth:`_let_go`) and gives the slab back."""

    __slots__ = ("_budget",)

    def __init__(self, pool: HostPool, budget: SlabHandle) -> None:
        super().__init__(pool, budget.index)
        self._budget = budget

    def _let_go(self) -> None:
        """Drop the references to the bytes (once, when the lease ends)."""

    def _end(self) -> None:
        self._let_go()
        self._budget.release()


class MessageSlab(_StandIn):
    """A slab of the private pool whose chunk is written into its outgoing message
    instead (a :class:`~lmtier.wire.pieces.PieceBuffer`, made when the chunk is
    written): ``view`` and ``tensor`` are the message's data field. The slab stays
    held until the message is sent, so the pool bounds what a store holds."""

    __slots__ = ("_buffer", "_length", "_session_id")

    def __init__(self, pool: HostPool, budget: SlabHandle, session_id: bytes, length: int) -> None:
        super().__init__(pool, budget)
        self._session_id, self._length = session_id, length
        self._buffer: PieceBuffer | None = None

    @property
    def view(self) -> memoryview:
        return self._written("view").view

    @property
    def tensor(self) -> torch.Tensor:
        return self._written("tensor").tensor

    def _written(self, what: str) -> PieceBuffer:
        self._check_usable(what)
        if self._buffer is None:
            self._buffer = PieceBuffer(self._session_id, self._length)
        return self._buffer

    def message(self, key: ChunkKey, length: int, session_id: bytes) -> bytes | None:
        """The chunk's one message, if it was written whole, for the call's session
        (``length`` and ``session_id`` are those it was made for); None: send it from
        :attr:`view` instead."""
        self._check_usable("message")
        buffer = self._buffer
        if buffer is None or length != buffer.length or session_id != self._session_id:
            return None
        return buffer.seal(key)

    def _let_go(self) -> None:
        self._buffer = None


class ReceivedSlab(_StandIn):
    """A chunk that arrived whole in one ``LoadStream`` message, read where it lies
    (the message's data field) instead of copied into a slab: a streamed load then
    copies the KV once, as a raw stream's reader does. The slab it would have filled
    stays held until the lease ends, so the private pool still bounds what loads
    hold; ending it lets the message go."""

    __slots__ = ("_tensor", "_view")

    def __init__(
        self, pool: HostPool, budget: SlabHandle, message: bytes, start: int, length: int
    ) -> None:
        super().__init__(pool, budget)
        self._tensor = bytes_tensor(message, start, length)
        self._view: memoryview = self._tensor.numpy().data

    @property
    def view(self) -> memoryview:
        self._check_usable("view")
        return self._view

    @property
    def tensor(self) -> torch.Tensor:
        self._check_usable("tensor")
        return self._tensor

    def _let_go(self) -> None:
        self._tensor, self._view = _NO_BYTES, _NO_VIEW


_NO_BYTES = torch.empty(0, dtype=torch.uint8)
_NO_VIEW: memoryview = _NO_BYTES.numpy().data


def in_messages(
    pool: HostPool, slabs: list[SlabHandle], session_id: bytes, length: int
) -> list[SlabHandle]:
    """``slabs`` of ``pool`` as :class:`MessageSlab` leases for chunks of ``length``
    bytes (when one fits a message; else as they are)."""
    if length > PIECE_BYTES:
        return slabs
    return [MessageSlab(pool, slab, session_id, length) for slab in slabs]


class StoreSending:
    """One ``StoreStream`` call, started on construction and fed as the caller fills
    slabs (:meth:`add`) until :meth:`finish`: the pieces of each chunk are serialized
    in grpcio's request thread while the caller copies the next ones, so a whole
    store is one call (each call pays HTTP/2's flow-control ramp again). It owns the
    slabs it is given: each is released once its chunk is serialized (its bytes are in
    the messages then), and whatever is left when the call ends (failed, cancelled,
    the pool closed) by :meth:`abandon`."""

    def __init__(self, connection: Connection, session_id: bytes) -> None:
        self.session_id = session_id
        self.chunks = 0
        """Chunks given to this call so far."""
        self._connection = connection
        self._items: deque[tuple[ChunkKey, SlabHandle, int]] = deque()
        self._changed = threading.Condition()
        self._finished = False  # no more chunks will be added
        self._abandoned = False
        self._future: Any = connection.store_stream.future(
            self._pieces(), timeout=connection.timeout_s, metadata=connection.metadata
        )
        self._future.add_done_callback(lambda _: self.abandon())

    def add(self, items: Sequence[tuple[ChunkKey, SlabHandle, int]]) -> None:
        """Send these filled slabs' chunks too (the call owns the slabs from now on:
        released at once, unsent, if it has ended or was finished)."""
        with self._changed:
            self.chunks += len(items)
            if self._abandoned or self._finished:  # ended, or closed by the client
                for _, handle, _ in items:
                    handle.release()
                return
            self._items.extend(items)
            self._changed.notify_all()

    def finish(self) -> None:
        """No more chunks: the call ends once those added are sent."""
        with self._changed:
            self._finished = True
            self._changed.notify_all()

    def _pieces(self) -> Iterator[bytes]:
        """The request messages; each chunk is serialized under the lock, so
        :meth:`abandon` never releases a slab mid-copy."""
        session = self.session_id
        while True:
            with self._changed:
                while not (self._items or self._finished or self._abandoned):
                    self._changed.wait()
                if self._abandoned or not self._items:
                    return
                key, handle, length = self._items[0]
                try:
                    whole = (
                        handle.message(key, length, self.session_id)
                        if isinstance(handle, MessageSlab)
                        else None
                    )
                    pieces = (
                        [whole]
                        if whole is not None
                        else list(
                            chunk_pieces(key, handle.view, length, PIECE_BYTES, session_id=session)
                        )
                    )
                except HandleError:  # the client closed its pool: the call is over
                    return
                self._items.popleft()
                handle.release()
                self._changed.notify_all()  # a slab is free
            session = b""
            yield from pieces

    @property
    def ended(self) -> bool:
        """Whether the call has ended and given every slab back."""
        return self._abandoned

    @property
    def finished(self) -> bool:
        """Whether it takes no more chunks (it ends once those it holds are sent)."""
        return self._finished

    @property
    def sending(self) -> bool:
        """Whether slabs it holds are still to be serialized (they come back as they are)."""
        with self._changed:  # a chunk is dequeued and its slab released in one step
            return bool(self._items) and not self._abandoned

    def wait_freed(self) -> None:
        """Wait until it releases a slab it holds, or ends."""
        with self._changed:
            queued = len(self._items)
            while queued and len(self._items) == queued and not self._abandoned:
                self._changed.wait()

    def abandon(self) -> None:
        """Release every slab not sent yet; the request iterator stops."""
        with self._changed:
            self._abandoned = True
            items, self._items = self._items, deque()
            for _, handle, _ in items:
                if not handle.released:
                    handle.release()
            self._changed.notify_all()

    def stored(self) -> int:
        """Wait for the answer: how many chunks the sidecar stored (0 if the call failed)."""
        self.finish()
        try:
            return self._connection.stored(self._future)
        finally:
            self.abandon()

    def wait_done(self) -> None:
        """Wait until the call has ended and its slabs are back (its outcome is
        :meth:`stored`'s to report)."""
        with contextlib.suppress(grpc.FutureCancelledError):
            self._future.exception()
        self.abandon()


class StoreStreams:
    """A client's ``StoreStream`` calls. A thread's :meth:`lmtier.LMTier.store` feeds
    one call from :meth:`begin` to :meth:`end` (a new one past ``max_chunks``, the
    private pool's size, so that a call's deadline covers at most a pool's worth of
    bytes); any other hand-over is a call of its own. A call waits for the calls
    already finished before it starts (calls side by side ran slower than one after
    another)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[StoreSending] = []
        self._store = threading.local()  # this thread's store: the call it feeds

    def begin(self) -> None:
        """This thread starts a store: its hand-overs feed one call until :meth:`end`."""
        self._store.active, self._store.call = True, None

    @property
    def storing(self) -> bool:
        """Whether this thread is inside a store (between :meth:`begin` and :meth:`end`)."""
        return bool(getattr(self._store, "active", False))

    def end(self) -> None:
        """This thread's store has handed over its last chunk."""
        call: StoreSending | None = getattr(self._store, "call", None)
        self._store.active, self._store.call = False, None
        if call is not None:
            call.finish()

    def send(
        self,
        connection: Connection,
        session_id: bytes,
        items: Sequence[tuple[ChunkKey, SlabHandle, int]],
        *,
        max_chunks: int,
    ) -> Callable[[], int]:
        """Send ``items`` (their slabs are the calls' from now on), in a call of at most
        ``max_chunks`` chunks unless ``items`` alone are more; a function that says
        how many were stored (within a store, the call's first hand-over answers for
        the call, the others 0)."""
        if not getattr(self._store, "active", False):
            call = self.start(connection, session_id)
            call.add(items)
            call.finish()
            return call.stored
        call = self._store.call
        fresh = (
            call is None
            or call.ended
            or call.session_id != session_id
            or call.chunks + len(items) > max_chunks
        )
        if fresh:
            if call is not None:
                call.finish()
            call = self._store.call = self.start(connection, session_id)
        call.add(items)
        return call.stored if fresh else _nothing

    def start(self, connection: Connection, session_id: bytes) -> StoreSending:
        """A new call (after those already finished have ended)."""
        with self._lock:
            before = self._live()
        for call in before:
            if call.finished:  # never one still fed: its store may need slabs we hold
                call.wait_done()
        sending = StoreSending(connection, session_id)
        with self._lock:
            self._calls = [*self._live(), sending]
        return sending

    def acquire(self, pool: HostPool, count: int) -> list[SlabHandle]:
        """Up to ``count`` slabs of ``pool``; while it is empty and a call still holds
        slabs to send, wait for it to give one back."""
        handles: list[SlabHandle] = []
        while len(handles) < count:
            handle = pool.acquire()
            if handle is not None:
                handles.append(handle)
                continue
            with self._lock:
                self._calls = self._live()
                holding = next((call for call in self._calls if call.sending), None)
            if holding is None:  # none since the first try; but one may have come back
                handle = pool.acquire()
                if handle is None:
                    break  # held by loads the caller has not released: the rest is dropped
                handles.append(handle)
                continue
            holding.wait_freed()
        return handles

    def wait_all(self) -> None:
        """Wait until every call has ended and given its slabs back."""
        with self._lock:
            calls = self._live()
        for call in calls:
            call.finish()
            call.wait_done()

    def _live(self) -> list[StoreSending]:
        return [call for call in self._calls if not call.ended]


def _nothing() -> int:
    return 0
