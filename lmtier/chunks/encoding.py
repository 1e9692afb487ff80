"""Writing chunks in the byte format of :mod:`lmtier.chunks.format`.

Three ways to produce a chunk:

* :func:`encode` / :func:`encode_into` / :func:`header_bytes`: from a payload, sealed
  at once (checksum, and a MAC with ``sign``). For tools, tests and tiers.
* :class:`HeaderTemplate`: the header of every chunk of one geometry packed once, with
  its variable fields (key, namespace, time stamp, checksum, MAC) at known offsets, so
  that framing a payload already copied into a slab costs ~2 us, not a msgpack pass
  and a validated :class:`~lmtier.chunks.format.ChunkMeta` per chunk.
* **Unsealed framing** (``HeaderTemplate.frame_into(..., sealed=False)``): the header
  goes in front of the payload now, with the ``UNSEALED`` flag and no checksum or MAC;
  :func:`seal_header` computes both later, off the caller's thread, before the chunk
  leaves host memory. A store into host memory then costs one copy of the KV, not a
  copy and a hash pass (and a MAC pass, ~20x the copy, with an integrity key): nothing
  reads a payload checksum in host memory (the CPU tier serves its own slabs without
  one), and every tier below it receives sealed bytes only
  (:mod:`lmtier.storage.sealing`). A decoder that verifies refuses unsealed bytes.

Header packing is fixed-width by construction (see :func:`_header_parts`): its length
depends on the geometry only, never on the checksum, time stamp or MAC values, which
is what lets a template exist and a MAC be filled in after packing.
"""

from __future__ import annotations

import functools
import math
import struct
import time
from collections.abc import Callable
from typing import Any, TypeAlias

import msgpack
import xxhash

from lmtier.chunks.format import (
    DIGEST_LEN,
    FLAG_UNSEALED,
    FORMAT_VERSION,
    MAC_LEN,
    MAGIC,
    MAX_HEADER_LEN,
    PREFIX,
    PREFIX_LEN,
    ChunkMeta,
    align_up,
    decode,
    layout_tokens,
)
from lmtier.chunks.keys import KEY_BYTES

__all__ = [
    "HeaderTemplate",
    "MacSigner",
    "encode",
    "encode_into",
    "encoded_size",
    "header_bytes",
    "seal_header",
    "signed_header",
]

MacSigner: TypeAlias = Callable[[bytes, memoryview], bytes]
"""Computes a chunk's MAC from its canonical header (``mac`` zeroed) and its payload."""

_NO_MAC = bytes(MAC_LEN)
_UINT64 = b"\xcf"  # msgpack uint64 marker: the checksum always takes 9 bytes
_F64 = struct.Struct(">d")  # msgpack float64 payload
_U64 = struct.Struct(">Q")  # msgpack uint64 payload
_FIELD_COUNT = 10


def _header_parts(
    meta: ChunkMeta, checksum: int, ctime: float, mac: bytes
) -> list[tuple[str, bytes, int]]:
    """The msgpack header as ``(field, packed name and value, value length)`` parts, in
    map order. Fixed-width where values vary: key and namespace as 16-byte bins, the
    checksum as a 9-byte uint64 (msgpack would pick the narrowest int), ctime as a
    float64, mac as a 32-byte bin. The raw value of each is the last ``value length``
    bytes of its part."""
    packer = msgpack.Packer(use_bin_type=True)
    parts: list[tuple[str, bytes, int]] = [("", packer.pack_map_header(_FIELD_COUNT), 0)]
    for name, value, width in (
        ("key", meta.key, DIGEST_LEN),
        ("ns", meta.namespace, DIGEST_LEN),
        ("dtype", meta.dtype, 0),
        ("shape", list(meta.shape), 0),
        ("layout", meta.layout, 0),
        ("tokens", meta.num_tokens, 0),
        ("nbytes", meta.nbytes, 0),
        ("ctime", float(ctime), _F64.size),
    ):
        parts.append((name, packer.pack(name) + packer.pack(value), width))
    parts.append(("xxh", packer.pack("xxh") + _UINT64 + _U64.pack(checksum), _U64.size))
    parts.append(("mac", packer.pack("mac") + packer.pack(mac), MAC_LEN))
    return parts


def _pack_header(meta: ChunkMeta, checksum: int, ctime: float, mac: bytes = _NO_MAC) -> bytes:
    return b"".join(part for _, part, _ in _header_parts(meta, checksum, ctime, mac))


def signed_header(meta: ChunkMeta, checksum: int) -> bytes:
    """The canonical header a chunk's MAC covers (with ``mac`` zeroed), before its payload.

    ``meta.created`` must be the chunk's stamp (as decoded, or as given to encode).
    Rebuilt from the fields rather than taken from the bytes, so a verifier never
    depends on how a writer laid out its map.
    """
    return _pack_header(meta, checksum, meta.created)


def _frame(header: bytes, flags: int = 0) -> bytes:
    """Prefix + header + zero padding: everything before the payload."""
    if len(header) > MAX_HEADER_LEN:
        raise ValueError(f"header of {len(header)} bytes exceeds {MAX_HEADER_LEN}")
    prefix = PREFIX.pack(
        MAGIC, FORMAT_VERSION, flags, len(header), 0, xxhash.xxh3_64_intdigest(header)
    )
    padding = bytes(align_up(PREFIX_LEN + len(header)) - PREFIX_LEN - len(header))
    return prefix + header + padding


def _byte_view(meta: ChunkMeta, payload: Any) -> memoryview:
    """A flat byte view of ``payload`` (any C-contiguous buffer) of exactly meta.nbytes."""
    view = memoryview(payload)
    if not view.c_contiguous:
        raise ValueError("payload must be a C-contiguous buffer")
    view = view.cast("B")
    if view.nbytes != meta.nbytes:
        raise ValueError(
            f"payload has {view.nbytes} bytes but {meta.dtype}{list(meta.shape)} "
            f"needs {meta.nbytes}"
        )
    return view


def payload_checksum(payload: Any) -> int:
    """The checksum a sealed header carries for ``payload`` (a C-contiguous buffer of
    the payload's bytes): xxh3-64. It holds the GIL while it hashes."""
    return int(xxhash.xxh3_64_intdigest(payload))


def _seal_values(
    meta: ChunkMeta, payload: memoryview, ctime: float, sign: MacSigner | None
) -> tuple[int, bytes]:
    """The payload checksum and the MAC (zeros without ``sign``) of a chunk."""
    checksum = payload_checksum(payload)
    if sign is None:
        return checksum, _NO_MAC
    mac = sign(_pack_header(meta, checksum, ctime), payload)
    if len(mac) != MAC_LEN:
        raise ValueError(f"a MAC must be {MAC_LEN} bytes, got {len(mac)}")
    return checksum, mac


def header_bytes(meta: ChunkMeta, payload: Any, sign: MacSigner | None = None) -> bytes:
    """The bytes that precede ``payload`` in its encoding (length == payload offset).

    Hashes the payload, and MACs header and payload with ``sign`` when given (see
    :mod:`lmtier.chunks.integrity`). Tiers write the result and the payload as two buffers
    (writev, a non-copying Redis SET) so the payload is never copied to encode it.
    """
    view = _byte_view(meta, payload)
    ctime = meta.created if meta.created != 0.0 else time.time()
    checksum, mac = _seal_values(meta, view, ctime, sign)
    return _frame(_pack_header(meta, checksum, ctime, mac))


def encoded_size(meta: ChunkMeta) -> int:
    """Exact length of the encoding of a chunk with this meta (payload offset + nbytes)."""
    return _payload_offset(meta.dtype, meta.shape, meta.layout) + meta.nbytes


@functools.lru_cache(maxsize=256)
def _payload_offset(dtype: str, shape: tuple[int, ...], layout: str) -> int:
    tokens = layout_tokens(shape, layout)
    meta = ChunkMeta(bytes(DIGEST_LEN), bytes(DIGEST_LEN), dtype, shape, layout, tokens)
    return align_up(PREFIX_LEN + len(_pack_header(meta, 0, 0.0)))


def encode(meta: ChunkMeta, payload: Any, sign: MacSigner | None = None) -> bytes:
    """Encode ``payload`` (any C-contiguous buffer of meta.nbytes bytes) as one chunk.

    One copy of the payload, into the returned bytes. Prefer :func:`header_bytes` or
    :func:`encode_into` where the destination allows it.
    """
    view = _byte_view(meta, payload)
    return b"".join((header_bytes(meta, view, sign), view))


def encode_into(meta: ChunkMeta, payload: Any, out: Any, sign: MacSigner | None = None) -> int:
    """Encode straight into the writable buffer ``out`` (e.g. a pool slab).

    Copies the payload exactly once. Returns the number of bytes written; bytes of
    ``out`` beyond that are left untouched. ValueError if ``out`` is too small.
    """
    view = _byte_view(meta, payload)
    dest = memoryview(out)
    if dest.readonly or not dest.c_contiguous:
        raise ValueError("out must be a writable C-contiguous buffer")
    dest = dest.cast("B")
    head = header_bytes(meta, view, sign)
    total = len(head) + meta.nbytes
    if dest.nbytes < total:
        raise ValueError(f"out has {dest.nbytes} bytes, the chunk needs {total}")
    dest[: len(head)] = head
    dest[len(head) : total] = view
    return total


class HeaderTemplate:
    """Everything before the payload of every chunk shaped like ``meta``, packed once.

    :meth:`frame_into` fills in one chunk's key, time stamp, checksum and MAC at their
    offsets and the header checksum in the prefix: the bytes equal
    :func:`header_bytes`'s for the same values (a test holds it to that).
    """

    __slots__ = ("_blank", "_offsets", "encoded_size", "header_len", "nbytes", "payload_offset")

    def __init__(self, meta: ChunkMeta) -> None:
        parts = _header_parts(meta, 0, 0.0, _NO_MAC)
        offsets: dict[str, int] = {}
        at = PREFIX_LEN
        for name, part, width in parts:
            at += len(part)
            if width:
                offsets[name] = at - width
        self._offsets = offsets
        self.header_len = at - PREFIX_LEN
        self.payload_offset = align_up(at)
        self.nbytes = meta.nbytes
        self.encoded_size = self.payload_offset + meta.nbytes
        self._blank = bytes(PREFIX_LEN) + b"".join(p for _, p, _ in parts)
        self._blank += bytes(self.payload_offset - len(self._blank))

    def frame_into(
        self,
        out: memoryview,
        key: bytes,
        *,
        ctime: float,
        checksum: int = 0,
        mac: bytes = _NO_MAC,
        sealed: bool = True,
    ) -> int:
        """Write the header of chunk ``key`` (32 bytes: namespace, then chain) in front of
        a payload already at ``payload_offset`` of ``out``; returns the encoded length.

        ``sealed=False`` marks it ``UNSEALED`` (checksum and MAC to come:
        :func:`seal_header`); the values given for them are then ignored.
        """
        if len(key) != KEY_BYTES or len(mac) != MAC_LEN:
            raise ValueError(f"a key is {KEY_BYTES} bytes and a MAC {MAC_LEN}")
        out[: self.payload_offset] = self._render(key, ctime, checksum, mac, sealed)
        return self.encoded_size

    def frames(self, data: memoryview, key: bytes) -> bool:
        """Whether ``data`` starts with exactly the unsealed header this template writes
        for chunk ``key`` (at the time stamp ``data`` holds): a chunk framed by
        :meth:`frame_into` is checked with one compare instead of a decode. False for
        anything else (sealed, another geometry, damaged): decode it then."""
        if len(key) != KEY_BYTES or len(data) < self.encoded_size:
            return False
        (ctime,) = _F64.unpack_from(data, self._offsets["ctime"])
        if not (math.isfinite(ctime) and ctime >= 0):
            return False  # what a decode refuses, this never accepts
        expected = self._render(key, ctime, 0, _NO_MAC, sealed=False)
        return bool(data[: self.payload_offset] == expected)

    def _render(self, key: bytes, ctime: float, checksum: int, mac: bytes, sealed: bool) -> bytes:
        buf = bytearray(self._blank)
        at = self._offsets
        buf[at["key"] : at["key"] + DIGEST_LEN] = key[DIGEST_LEN:]
        buf[at["ns"] : at["ns"] + DIGEST_LEN] = key[:DIGEST_LEN]
        _F64.pack_into(buf, at["ctime"], ctime)
        if sealed:
            _U64.pack_into(buf, at["xxh"], checksum)
            buf[at["mac"] : at["mac"] + MAC_LEN] = mac
        header = memoryview(buf)[PREFIX_LEN : PREFIX_LEN + self.header_len]
        PREFIX.pack_into(
            buf,
            0,
            MAGIC,
            FORMAT_VERSION,
            0 if sealed else FLAG_UNSEALED,
            self.header_len,
            0,
            xxhash.xxh3_64_intdigest(header),
        )
        return bytes(buf)


def seal_header(chunk: memoryview, sign: MacSigner | None = None) -> bytes | None:
    """The sealed header of the unsealed chunk in ``chunk`` (checksum, and MAC with
    ``sign``, computed now: a pass over the payload, so call it off the event loop), to
    be written over ``chunk[:len(result)]``; None if the chunk is sealed already.

    Raises :class:`~lmtier.errors.CorruptChunk` if ``chunk`` is not a valid chunk.
    """
    decoded = decode(chunk, verify=False)
    if decoded.sealed:
        return None
    meta = decoded.meta
    checksum, mac = _seal_values(meta, decoded.payload, meta.created, sign)
    head = _frame(_pack_header(meta, checksum, meta.created, mac))
    if len(head) != decoded.payload_offset:  # fixed-width packing makes this impossible
        raise AssertionError("a sealed header must take the unsealed one's place")
    return head
