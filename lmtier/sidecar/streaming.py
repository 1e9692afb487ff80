"""A streaming client's side of ``LoadStream`` and ``StoreStream``: chunk bytes into
and out of slabs of its private pool, as :mod:`.pieces` cuts them."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import grpc

from lmtier.chunks.keys import ChunkKey
from lmtier.sidecar.connection import Connection
from lmtier.sidecar.pieces import PIECE_BYTES, decode_piece, encode_piece, piece_offsets
from lmtier.storage.memory import HostPool, SlabHandle
from lmtier.v1 import sidecar_pb2 as pb

__all__ = ["receive_chunks", "send_chunks"]

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


def send_chunks(
    session_id: bytes, items: Sequence[tuple[ChunkKey, SlabHandle, int]]
) -> Iterator[bytes]:
    """The pieces of ``StoreStream`` for encoded chunks in slabs: the session in the
    first, each chunk's key and length in its first."""
    first = True
    for key, handle, length in items:
        view = handle.view
        offsets, step = piece_offsets(length, PIECE_BYTES)
        for offset in offsets:
            data = view[offset : min(offset + step, length)]
            if offset:
                yield encode_piece(data, offset)
                continue
            session = session_id if first else b""
            yield encode_piece(data, 0, key=key, total_length=length, session_id=session)
            first = False
