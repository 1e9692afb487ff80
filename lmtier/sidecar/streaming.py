"""A streaming client's side of ``LoadStream`` and ``StoreStream``: chunk bytes into
and out of slabs of its private pool, as :mod:`.pieces` cuts them."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from lmtier.chunks.keys import ChunkKey
from lmtier.errors import HandleError
from lmtier.sidecar.connection import Connection
from lmtier.sidecar.pieces import PIECE_BYTES, chunk_pieces, decode_piece
from lmtier.storage.memory import HostPool, SlabHandle
from lmtier.v1 import sidecar_pb2 as pb

__all__ = ["StoreSending", "StoreStreams", "receive_chunks"]

logger = logging.getLogger(__name__)


def receive_chunks(
    connection: Connection, request: pb.LoadRequest, pool: HostPool, most: int
) -> tuple[list[SlabHandle], list[tuple[int, str]]]:
    """Run ``LoadStream``: each whole chunk in a slab of ``pool`` (at most ``most``),
    with its length and tier. A chunk cut short (a failed stream, a full pool, a
    malformed piece) ends the result there: what follows is a miss."""
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


class StoreSending:
    """One ``StoreStream`` call in flight, started on construction: the pieces of its
    chunks (filled slabs of the private pool) are serialized in grpcio's request
    thread while the caller copies the next batch. It owns the slabs: each is released
    once its chunk is serialized (its bytes are in the messages then), and whatever is
    left when the call ends (failed, cancelled, the pool closed) by :meth:`abandon`."""

    def __init__(
        self,
        connection: Connection,
        session_id: bytes,
        items: Sequence[tuple[ChunkKey, SlabHandle, int]],
    ) -> None:
        self._connection = connection
        self._session_id = session_id
        self._items = list(items)
        self._lock = threading.Lock()
        self._abandoned = False
        self._future: Any = connection.store_stream.future(
            self._pieces(), timeout=connection.timeout_s, metadata=connection.metadata
        )
        self._future.add_done_callback(lambda _: self.abandon())

    def _pieces(self) -> Iterator[bytes]:
        """The request messages; each chunk is serialized under the lock, so
        :meth:`abandon` never releases a slab mid-copy."""
        session = self._session_id
        for key, handle, length in self._items:
            with self._lock:
                if self._abandoned:
                    return
                try:
                    view = handle.view
                except HandleError:  # the client closed its pool: the call is over
                    return
                pieces = list(chunk_pieces(key, view, length, PIECE_BYTES, session_id=session))
                handle.release()
            session = b""
            yield from pieces

    @property
    def ended(self) -> bool:
        """Whether the call has ended and given every slab back."""
        return self._abandoned

    def abandon(self) -> None:
        """Release every slab not sent yet; the request iterator stops."""
        with self._lock:
            self._abandoned = True
            for _, handle, _ in self._items:
                if not handle.released:
                    handle.release()

    def stored(self) -> int:
        """Wait for the answer: how many chunks the sidecar stored (0 if the call failed)."""
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
    """A client's ``StoreStream`` calls: one in flight at a time (each waits for the
    one before: concurrent calls ran slower than one after another), each releasing
    its slabs of the private pool as it sends them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[StoreSending] = []

    def start(
        self,
        connection: Connection,
        session_id: bytes,
        items: Sequence[tuple[ChunkKey, SlabHandle, int]],
    ) -> Callable[[], int]:
        """Start a call that stores ``items`` (it owns their slabs from now on); a
        function that waits for it and says how many chunks were stored."""
        self.wait_all()
        sending = StoreSending(connection, session_id, items)
        with self._lock:
            self._calls = [*self._live(), sending]
        return sending.stored

    def acquire(self, pool: HostPool, count: int) -> list[SlabHandle]:
        """Up to ``count`` slabs of ``pool``; while it is empty and a call is in flight,
        wait for the oldest to end and give its slabs back."""
        handles: list[SlabHandle] = []
        while len(handles) < count:
            handle = pool.acquire()
            if handle is not None:
                handles.append(handle)
                continue
            with self._lock:
                self._calls = self._live()
                oldest = self._calls[0] if self._calls else None
            if oldest is None:
                break  # held by loads the caller has not released: the rest is dropped
            oldest.wait_done()
        return handles

    def wait_all(self) -> None:
        """Wait until every call has ended and given its slabs back."""
        with self._lock:
            calls = self._live()
        for call in calls:
            call.wait_done()

    def _live(self) -> list[StoreSending]:
        return [call for call in self._calls if not call.ended]
