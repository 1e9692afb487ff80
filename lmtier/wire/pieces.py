"""How a chunk travels on the streaming calls (``LoadStream``, ``StoreStream``): in
equal pieces, each a ``ChunkPiece`` message encoded and parsed here, so that its
bytes are copied once on each side.

* **Equal pieces.** A 2 MiB chunk is 2 MiB plus a few hundred bytes of header; cut at
  a fixed 1 MiB it would leave a tail of a few hundred bytes, and grpcio stalls ~2 ms
  on a small message after large ones (streaming ran at 0.25x a raw stream).
* **One copy.** Through the generated classes, a piece's data is copied out of the
  slab into a ``bytes``, then into the serialized message (and, received, out of the
  message into a ``bytes``, then into the slab). Encoded here, the slab's bytes are
  joined straight into the message; parsed here, the data is a view of the message,
  copied once into the slab, or read where it lies when a chunk came whole in one
  message (:class:`~lmtier.remote.streaming.ReceivedSlab`). The wire format is the
  same protobuf message: other clients use their generated code.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lmtier.chunks.keys import KEY_BYTES
from lmtier.errors import InvalidRequestError

__all__ = [
    "PIECE_BYTES",
    "Piece",
    "PieceBuffer",
    "bytes_tensor",
    "chunk_pieces",
    "decode_piece",
    "encode_piece",
    "piece_offsets",
]

PIECE_BYTES = 4 * 1024**2
"""Most chunk bytes a client sends per message (under the sidecar's default 8 MiB
``max_message_bytes``): a 2 MiB chunk travels whole."""

# ChunkPiece's field numbers (proto/lmtier/v1/sidecar.proto).
_SESSION, _KEY, _TOTAL, _OFFSET, _DATA, _TIER = 1, 2, 3, 4, 5, 6
_VARINT, _LEN = 0, 2


def piece_offsets(length: int, limit: int) -> tuple[range, int]:
    """The offsets of the pieces of a ``length``-byte chunk, and the piece size: as
    few pieces as ``limit`` allows, all equal but the last (at most a byte shorter
    per piece)."""
    count = max(1, -(-length // limit))
    step = max(1, -(-length // count))
    return range(0, length, step), step


def _varint(value: int, size: int = 0) -> bytes:
    """``value`` as a protobuf varint, padded to ``size`` bytes with continuation bytes
    (an overlong encoding: parsers read up to 10 bytes, and the same value)."""
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value or len(out) + 1 < size:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _field(number: int, data: bytes | memoryview) -> list[bytes | memoryview]:
    return [_varint(number << 3 | _LEN), _varint(len(data)), data]


def encode_piece(
    data: memoryview,
    offset: int,
    *,
    key: bytes = b"",
    total_length: int = 0,
    tier: str = "",
    session_id: bytes = b"",
) -> bytes:
    """A serialized ``ChunkPiece``, the bytes protobuf would write (fields in number
    order, defaults omitted); ``data`` is copied once, into the result."""
    parts: list[bytes | memoryview] = []
    if session_id:
        parts += _field(_SESSION, session_id)
    if key:
        parts += _field(_KEY, key)
    if total_length:
        parts += [_varint(_TOTAL << 3 | _VARINT), _varint(total_length)]
    if offset:
        parts += [_varint(_OFFSET << 3 | _VARINT), _varint(offset)]
    parts += _field(_DATA, data)
    if tier:
        parts += _field(_TIER, tier.encode())
    return b"".join(parts)


# A new bytes object of a given size, not yet filled, and its data's address: CPython's
# API for filling one in place before anyone else sees it (PieceBuffer does, and only
# then). Written through a ctypes array over it, which keeps the bytes alive.
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
_new_bytes.restype = ctypes.py_object
_bytes_data = ctypes.pythonapi.PyBytes_AsString
_bytes_data.argtypes = [ctypes.py_object]
_bytes_data.restype = ctypes.c_void_p
_DATA_ALIGN = 8  # the data starts 8-aligned in the message (bytes' own data is 16-aligned)


def bytes_tensor(data: bytes, start: int, length: int) -> torch.Tensor:
    """A writable 1-D uint8 tensor over ``data[start : start + length]`` in place (no
    copy; it keeps ``data`` alive). Only for a ``bytes`` no other code holds: one just
    made (:class:`PieceBuffer`) or a message grpc handed over (a streamed load's chunk
    is read where it arrived). Immutable ``bytes`` are written this way only before
    anyone else sees them, or by the one holder, never hashed."""
    if not 0 <= start <= start + length <= len(data):
        raise ValueError(f"bytes [{start}, {start + length}) are not within {len(data)}")
    if not length:
        return torch.empty(0, dtype=torch.uint8)
    array = (ctypes.c_char * length).from_address(_bytes_data(data) + start)
    array.owner = data  # type: ignore[attr-defined]  # tensor -> array -> bytes
    return torch.frombuffer(array, dtype=torch.uint8)


@functools.lru_cache(maxsize=64)
def _piece_frame(session_id: bytes, length: int) -> tuple[bytes, bytes]:
    """The bytes of a whole chunk's piece before its key and between its key and its
    data, the same for every chunk of a session and size (one store's, cached)."""
    head = b"".join([*_field(_SESSION, session_id), _varint(_KEY << 3 | _LEN), _varint(KEY_BYTES)])
    natural = len(_varint(length))
    pad = -(len(head) + KEY_BYTES + 2 + 2 * natural) % _DATA_ALIGN
    tail = b"".join(
        [
            _varint(_TOTAL << 3 | _VARINT),
            _varint(length, natural + (pad + 1) // 2),
            _varint(_DATA << 3 | _LEN),
            _varint(length, natural + pad // 2),
        ]
    )
    return head, tail


class PieceBuffer:
    """The one ``ChunkPiece`` of a whole ``length``-byte chunk, made before the chunk
    is written so that it is written straight into the message: a streaming store's
    copy of the KV is then its only one before grpc's (:func:`encode_piece` copies a
    chunk once more, out of its slab). ``view`` and ``tensor`` are the data field, to
    fill; :meth:`seal` writes the key and hands out the message. The session is in
    every such piece (the sidecar reads the first's); the two length varints are
    padded so the data starts 8-aligned."""

    __slots__ = ("_key_at", "_raw", "length", "message", "tensor", "view")

    def __init__(self, session_id: bytes, length: int) -> None:
        head, tail = _piece_frame(session_id, length)
        key_at, data_at = len(head), len(head) + KEY_BYTES + len(tail)
        self.length = length
        self.message: bytes = _new_bytes(None, data_at + length)
        whole = bytes_tensor(self.message, 0, len(self.message))
        self._raw: memoryview = whole.numpy().data
        self._raw[:key_at] = head
        self._raw[key_at + KEY_BYTES : data_at] = tail
        self._key_at = key_at
        self.tensor = whole[data_at:]
        self.view = self._raw[data_at:]

    def seal(self, key: bytes) -> bytes:
        """The message, with ``key`` written in; the buffer is not to be written after."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"a chunk key is {KEY_BYTES} bytes, got {len(key)}")
        self._raw[self._key_at : self._key_at + KEY_BYTES] = key
        return self.message


def chunk_pieces(
    key: bytes,
    view: memoryview,
    length: int,
    limit: int,
    *,
    tier: str = "",
    session_id: bytes = b"",
) -> Iterator[bytes]:
    """The serialized pieces of one encoded chunk (``view[:length]``), as the streaming
    calls send it: the first with its key, length, serving ``tier`` and (a store
    stream's first chunk) ``session_id``."""
    offsets, step = piece_offsets(length, limit)
    for offset in offsets:
        data = view[offset : min(offset + step, length)]
        if offset:
            yield encode_piece(data, offset)
        else:
            yield encode_piece(
                data, 0, key=key, total_length=length, tier=tier, session_id=session_id
            )


_EMPTY = memoryview(b"")
_FIXED = {1: 8, 5: 4}  # wire types of fixed size: skipped when a field is unknown


@dataclass(slots=True)
class Piece:
    """A parsed ``ChunkPiece``; ``data`` is a view of the received message."""

    session_id: bytes = b""
    key: bytes = b""
    total_length: int = 0
    offset: int = 0
    data: memoryview = _EMPTY
    tier: str = ""
    data_at: int = 0
    """Where ``data`` starts in the message."""


def _read_varint(raw: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(raw) or shift > 63:
            raise InvalidRequestError("a malformed chunk piece: a truncated or overlong varint")
        byte = raw[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def decode_piece(raw: bytes | memoryview) -> Piece:
    """Parse a serialized ``ChunkPiece``; InvalidRequestError (a ValueError) for a
    malformed one. Unknown fields are skipped, as protobuf does."""
    view = memoryview(raw)
    numbers: dict[int, int] = {}
    spans: dict[int, memoryview] = {}
    data_at = at = 0
    while at < len(view):
        tag, at = _read_varint(view, at)
        number, kind = tag >> 3, tag & 7
        if kind == _VARINT:
            numbers[number], at = _read_varint(view, at)
        elif kind == _LEN:
            size, at = _read_varint(view, at)
            if number == _DATA:
                data_at = at
            spans[number], at = view[at : at + size], at + size
        elif kind in _FIXED:
            at += _FIXED[kind]
        else:
            raise InvalidRequestError(f"a malformed chunk piece: wire type {kind} is not valid")
    if at != len(view):
        raise InvalidRequestError("a malformed chunk piece: a field runs past its end")
    try:
        tier = str(spans.get(_TIER, _EMPTY), "utf-8")
    except UnicodeDecodeError:
        raise InvalidRequestError("a malformed chunk piece: its tier is not UTF-8") from None
    return Piece(
        session_id=bytes(spans.get(_SESSION, _EMPTY)),
        key=bytes(spans.get(_KEY, _EMPTY)),
        total_length=numbers.get(_TOTAL, 0),
        offset=numbers.get(_OFFSET, 0),
        data=spans.get(_DATA, _EMPTY),
        tier=tier,
        data_at=data_at,
    )
