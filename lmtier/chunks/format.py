"""The one byte format of a KV chunk, shared unchanged by every tier.

Disk files, Redis values and S3 objects all hold exactly these bytes, so moving a
chunk between tiers is a copy, never a re-encode::

    offset 0                24              24 + header_len      payload_offset = align_up(., 64)
    +-----------------------+-----------------+--------------------+---------------------------+
    | prefix (24 bytes)     | msgpack header  | zero padding       | payload (nbytes, raw KV)  |
    +-----------------------+-----------------+--------------------+---------------------------+
    prefix = struct "<4sHHIIQ": magic b"LMTC", version, flags (0, or UNSEALED),
             header_len, reserved (0), xxh3_64(header)
    header = {"key", "ns", "dtype", "shape", "layout", "tokens", "nbytes", "ctime", "xxh", "mac"}

Why this shape:

* The payload starts on a 64-byte boundary (a cache line; any dtype's alignment), so
  a chunk decoded in a slab is a tensor view without a copy. Only 64: the header and
  its padding take ~256 bytes, where the 4096-byte alignment of format v2 took 4 KiB
  (11% of a 32 KiB chunk, so a tier held 11% fewer of them). O_DIRECT needs whole
  pages of memory and file, not an aligned payload: a tier using it reads the whole
  chunk into a page-aligned slab (the host pool aligns its slabs to 4096 then).
  Bytes after ``payload_offset + nbytes`` are ignored by :func:`decode`, because
  such tiers round their reads up to a page.
* The header carries its own checksum in the prefix: a flipped bit in the shape or
  dtype is caught as surely as one in the payload. The padding is not covered; it
  carries no information and decoding never reads it.
* :func:`decode` returns a memoryview into the caller's buffer: the only full pass
  over the payload is its xxh3_64 checksum (skippable with ``verify=False``).
* ``mac`` is 32 bytes: zeros, or an HMAC-SHA256 (:mod:`lmtier.chunks.integrity`) over the
  canonical header with a zeroed ``mac`` and the payload, when the writer holds the
  deployment's integrity key. Checksums catch accidents; only a MAC catches a chunk
  planted by someone who can write to a shared tier but does not hold the key.
* msgpack with size limits, never pickle: a chunk is data from a cache that other
  processes can write, and decoding it must not run code or exhaust memory.
* The ``UNSEALED`` flag marks a chunk framed in host memory whose ``xxh`` and ``mac``
  are still to be computed, off the storing thread (:mod:`lmtier.chunks.encoding`):
  only a decode that does not verify accepts one, so such bytes are never served
  from, or written to, any tier below host memory.

Writing chunks (whole encodings, header templates, sealing) is
:mod:`lmtier.chunks.encoding`.

This module does not import torch: storage backends use it and never touch tensors.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeGuard

import msgpack
import xxhash

from lmtier.errors import (
    BadMagic,
    ChecksumMismatch,
    HeaderTooLarge,
    InconsistentChunk,
    TruncatedChunk,
    UnsupportedVersion,
)

__all__ = [
    "DTYPE_ITEMSIZE",
    "FLAG_UNSEALED",
    "FORMAT_VERSION",
    "DIGEST_LEN",
    "LATENT_LAYOUTS",
    "LAYOUTS",
    "MAGIC",
    "MAX_HEADER_LEN",
    "PAGED_LAYOUTS",
    "PAGE_INTERIORS",
    "PAYLOAD_ALIGN",
    "PREFIX",
    "PREFIX_LEN",
    "MAC_LEN",
    "ChunkGeometry",
    "ChunkMeta",
    "DecodedChunk",
    "align_up",
    "decode",
    "decode_as",
    "decode_header",
    "layout_tokens",
    "verify_payload",
]

MAGIC = b"LMTC"
FORMAT_VERSION = 3
"""2: the header gained ``mac``; 3: the payload is 64-byte aligned, not 4096. Part of
every key's namespace, so chunks of another version are never looked up."""
MAC_LEN = 32
"""Bytes of the header's ``mac`` field (HMAC-SHA256); all zeros when unsigned."""
_NO_MAC = bytes(MAC_LEN)
PAYLOAD_ALIGN = 64
MAX_HEADER_LEN = 64 * 1024
DIGEST_LEN = 16
"""Length in bytes of one 128-bit digest: a chunk's chained hash (the header's ``key``)
or its namespace digest (``ns``). A :data:`~lmtier.chunks.keys.ChunkKey` is the two,
namespace first (:data:`~lmtier.chunks.keys.KEY_BYTES` is ``2 * DIGEST_LEN``)."""

PREFIX = struct.Struct("<4sHHIIQ")
"""magic, version, flags, header length, reserved, xxh3_64 of the header."""
PREFIX_LEN = PREFIX.size  # 24
FLAG_UNSEALED = 0x0001
"""Prefix flag: the header's ``xxh`` and ``mac`` are not computed yet (module docstring)."""

DTYPE_ITEMSIZE: Mapping[str, int] = MappingProxyType(
    {
        "float32": 4,
        "float16": 2,
        "bfloat16": 2,
        "int8": 1,
        "uint8": 1,
        "float8_e4m3fn": 1,
        "float8_e5m2": 1,
    }
)
"""Payload element types (torch dtype names without ``torch.``) and their byte sizes."""

LAYOUTS: Mapping[str, str] = MappingProxyType(
    {
        "LKTHD": "layer, k/v, token, head, head_dim (layer-major, for layer-by-layer loading)",
        "KLTHD": "k/v, layer, token, head, head_dim",
        "LTD": "layer, token, latent dim (MLA: one latent per token)",
        "KTLHD": "k/v, token, layer, head, head_dim (token-major: a page of a host pool "
        "that keeps each token's layers together, such as SGLang's page_first, is two "
        "runs of memory)",
        "TLD": "token, layer, latent dim (MLA, token-major)",
        "LBHSC": "layer, block, head, slot, K then V (C = 2 * head_dim): whole page blocks "
        "in the order of an engine page with heads before slots (vLLM HND), so a save or a "
        "load is a block copy",
        "LBSHC": "layer, block, slot, head, K then V (C = 2 * head_dim): whole page blocks "
        "in the order of an engine page with slots before heads (vLLM NHD)",
    }
)
"""Named KV layouts: each name spells its axes, one letter per dimension of ``shape``."""
PAGED_LAYOUTS = frozenset(("LBHSC", "LBSHC"))
"""The layouts that hold whole page blocks (B blocks of S token slots) instead of a token
axis: a chunk of them holds ``B * S`` tokens, and C (K then V) must be even."""
LATENT_LAYOUTS = frozenset(("LTD", "TLD"))
"""The layouts of one latent vector per token (MLA) instead of K and V."""
PAGE_INTERIORS: Mapping[str, str] = MappingProxyType(
    {
        "flash": "each slot's row of C holds its K then its V (vLLM's FlashAttention, Triton "
        "and FlexAttention backends; lmtier's own pages)",
        "cpu_attn": "vLLM's CPU attention backend: per block and head, a K region then a V "
        "region (its [S, 2*D] viewed as [2*S, D]), each arranged as the CPU kernel writes it",
    }
)
"""How an engine's attention backend arranges K and V inside a page block
(:attr:`KVSpec.page_interior`): the same page shape holds different bytes under each."""

# Limits handed to msgpack so a hostile header cannot make it allocate much: the
# longest legal string is a dtype name, the longest array a 5-axis shape.
_UNPACK_LIMITS: dict[str, int] = {
    "max_bin_len": 64,
    "max_str_len": 64,
    "max_array_len": 16,
    "max_map_len": 16,
    "max_ext_len": 0,
}
_HEADER_FIELDS = frozenset(
    ("key", "ns", "dtype", "shape", "layout", "tokens", "nbytes", "ctime", "xxh", "mac")
)


def align_up(n: int, align: int = PAYLOAD_ALIGN) -> int:
    """Round ``n`` up to a multiple of ``align`` (where the payload of a chunk starts)."""
    return -(-n // align) * align


def layout_tokens(shape: tuple[int, ...], layout: str) -> int:
    """How many tokens a payload of ``shape`` in ``layout`` holds: its token axis, or
    blocks x slots for a paged layout. ``shape`` must have one entry per axis letter."""
    if "T" in layout:
        return shape[layout.index("T")]
    return shape[layout.index("B")] * shape[layout.index("S")]


def _is_int(x: object) -> TypeGuard[int]:
    # bool is an int subclass, but True is not a dimension or a count.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_shape(x: object) -> TypeGuard[tuple[int, ...]]:
    return isinstance(x, tuple) and all(_is_int(d) for d in x)


def _check_meta(
    *,
    key: object,
    namespace: object,
    dtype: object,
    shape: object,
    layout: object,
    num_tokens: object,
    created: object,
) -> None:
    """Raise ValueError unless these fields describe a valid chunk.

    Typed ``object`` because decode hands in whatever msgpack produced; decode turns
    the ValueError into InconsistentChunk (bad bytes are a miss), while for a caller's
    own ChunkMeta it stays a ValueError (a bug at the call site).
    """
    for name, value in (("key", key), ("namespace", namespace)):
        if not isinstance(value, bytes) or len(value) != DIGEST_LEN:
            raise ValueError(f"{name} must be {DIGEST_LEN} bytes, got {value!r:.60}")
    if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE:
        raise ValueError(f"unknown dtype {dtype!r:.60}; known: {sorted(DTYPE_ITEMSIZE)}")
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r:.60}; known: {sorted(LAYOUTS)}")
    if not _is_shape(shape) or len(shape) != len(layout) or min(shape) < 1:
        raise ValueError(f"shape {shape!r:.60} is not {len(layout)} ints >= 1 for {layout}")
    tokens = layout_tokens(shape, layout)
    axes = "token axis" if "T" in layout else "blocks x slots"
    if not _is_int(num_tokens) or tokens != num_tokens:
        raise ValueError(f"{axes} of {shape} ({layout}) is not num_tokens={num_tokens!r:.40}")
    if "K" in layout and shape[layout.index("K")] != 2:
        raise ValueError(f"k/v axis of {shape} ({layout}) is not 2")
    if "C" in layout and shape[layout.index("C")] % 2:
        raise ValueError(f"K+V axis of {shape} ({layout}) is odd: it holds K then V, equal halves")
    if not isinstance(created, (int, float)) or isinstance(created, bool):
        raise ValueError(f"created must be a unix time, got {created!r:.60}")
    if not math.isfinite(created) or created < 0:
        raise ValueError(f"created must be a finite unix time >= 0, got {created!r}")


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """What a chunk holds: its identity, element type, shape and layout.

    Its identity is ``key``, the chained hash, and ``namespace``, the namespace
    digest (:data:`DIGEST_LEN` bytes each): its ChunkKey is ``namespace + key``.
    Validated on construction (ValueError), so every ChunkMeta describes a chunk
    that can be encoded. ``created`` of 0.0 means "stamp time.time() at encode";
    a decoded meta carries the stamp from the header.
    """

    key: bytes
    namespace: bytes
    dtype: str
    shape: tuple[int, ...]
    layout: str
    num_tokens: int
    created: float = 0.0

    def __post_init__(self) -> None:
        _check_meta(
            key=self.key,
            namespace=self.namespace,
            dtype=self.dtype,
            shape=self.shape,
            layout=self.layout,
            num_tokens=self.num_tokens,
            created=self.created,
        )

    @property
    def nbytes(self) -> int:
        """Payload size in bytes: the product of ``shape`` times the dtype's item size."""
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


@dataclass(frozen=True, slots=True)
class DecodedChunk:
    """A validated chunk. ``payload`` is a zero-copy view into the decoded buffer.

    The view pins the caller's buffer (a bytearray cannot be resized while it lives)
    and sees any later writes to it; copy it if the buffer is about to be reused.
    """

    meta: ChunkMeta
    payload: memoryview
    payload_offset: int
    checksum: int
    mac: bytes = _NO_MAC
    """The header's MAC (all zeros when the writer held no integrity key)."""
    sealed: bool = True
    """False for a chunk framed ``UNSEALED`` (``checksum`` and ``mac`` not computed yet:
    only a non-verifying decode accepts it)."""


@dataclass(frozen=True, slots=True)
class ChunkGeometry:
    """What every full chunk of one cache looks like: element type, layout, shape.

    The StorageManager compares each loaded chunk's header with it (a few field
    compares, no payload pass), so a chunk of another model's geometry is never served
    as a hit even if it sits under a matching key.
    """

    dtype: str
    layout: str
    shape: tuple[int, ...]

    def matches(self, meta: ChunkMeta) -> bool:
        """Whether ``meta`` describes a chunk of exactly this geometry."""
        return meta.dtype == self.dtype and meta.layout == self.layout and meta.shape == self.shape


def _no_duplicate_keys(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    # A repeated key would let two readers disagree on a field; refuse it.
    fields = dict(pairs)
    if len(fields) != len(pairs):
        raise ValueError("duplicate key in header map")
    return fields


def _parse_header(header: memoryview) -> tuple[ChunkMeta, int, bytes]:
    """Unpack and validate the msgpack header: (meta, payload checksum, MAC)."""
    try:
        fields = msgpack.unpackb(
            header,
            raw=False,
            strict_map_key=True,
            object_pairs_hook=_no_duplicate_keys,
            **_UNPACK_LIMITS,
        )
    except (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException) as exc:
        raise InconsistentChunk(f"header is not valid msgpack: {exc}") from exc
    if not isinstance(fields, dict) or fields.keys() != _HEADER_FIELDS:
        keys = sorted(map(str, fields)) if isinstance(fields, dict) else type(fields).__name__
        raise InconsistentChunk(f"header fields {keys} are not {sorted(_HEADER_FIELDS)}")
    shape = fields["shape"]
    try:
        meta = ChunkMeta(
            key=fields["key"],
            namespace=fields["ns"],
            dtype=fields["dtype"],
            shape=tuple(shape) if isinstance(shape, list) else shape,
            layout=fields["layout"],
            num_tokens=fields["tokens"],
            created=fields["ctime"],
        )
    except ValueError as exc:
        raise InconsistentChunk(str(exc)) from exc
    nbytes = fields["nbytes"]
    if not _is_int(nbytes) or nbytes != meta.nbytes:
        raise InconsistentChunk(
            f"nbytes {nbytes!r:.40} but {meta.dtype}{list(shape)} is {meta.nbytes}"
        )
    checksum = fields["xxh"]
    if not _is_int(checksum) or not 0 <= checksum < 1 << 64:
        raise InconsistentChunk(f"payload checksum {checksum!r:.40} is not a uint64")
    mac = fields["mac"]
    if not isinstance(mac, bytes) or len(mac) != MAC_LEN:
        raise InconsistentChunk(f"mac is not {MAC_LEN} bytes")
    return meta, checksum, mac


def _read_header(buf: Any) -> tuple[memoryview, ChunkMeta, int, int, bytes, bool]:
    """Validate prefix and header of ``buf``:
    (view, meta, payload_offset, checksum, mac, sealed)."""
    view = memoryview(buf).cast("B")
    if len(view) < PREFIX_LEN:
        if not MAGIC.startswith(bytes(view[: len(MAGIC)])):
            raise BadMagic(f"chunk does not start with {MAGIC!r}")
        raise TruncatedChunk(f"{len(view)} bytes, shorter than the {PREFIX_LEN}-byte prefix")
    magic, version, flags, header_len, reserved, header_xxh = PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise BadMagic(f"chunk starts with {magic!r}, not {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise UnsupportedVersion(f"format version {version}; this build reads {FORMAT_VERSION}")
    if flags & ~FLAG_UNSEALED:
        # A future version may define flags; a reader that ignored them could misread.
        raise UnsupportedVersion(f"unknown format flags {flags:#06x}")
    if header_len > MAX_HEADER_LEN:
        raise HeaderTooLarge(f"header length {header_len} exceeds {MAX_HEADER_LEN}")
    if reserved != 0:
        raise InconsistentChunk(f"reserved prefix field is {reserved}, not 0")
    header_end = PREFIX_LEN + header_len
    if len(view) < header_end:
        raise TruncatedChunk(f"{len(view)} bytes, the header ends at {header_end}")
    header = view[PREFIX_LEN:header_end]
    if xxhash.xxh3_64_intdigest(header) != header_xxh:
        raise ChecksumMismatch("header checksum mismatch")
    meta, checksum, mac = _parse_header(header)
    return view, meta, align_up(header_end), checksum, mac, not flags & FLAG_UNSEALED


def _unsealed(meta: ChunkMeta) -> InconsistentChunk:
    return InconsistentChunk(
        f"chunk {(meta.namespace + meta.key).hex()} is unsealed (no payload checksum yet): "
        "such bytes never leave the host memory of the process that framed them"
    )


def decode_header(buf: Any) -> tuple[ChunkMeta, int, int, int]:
    """Validate the prefix and header only: (meta, payload_offset, nbytes, checksum).

    ``buf`` needs the prefix and header, not the payload; tiers read this first, then
    the payload into its destination and check it with :func:`verify_payload`. An
    unsealed chunk has no checksum to check: InconsistentChunk.
    """
    _, meta, payload_offset, checksum, _mac, sealed = _read_header(buf)
    if not sealed:
        raise _unsealed(meta)
    return meta, payload_offset, meta.nbytes, checksum


def decode(buf: Any, *, verify: bool = True) -> DecodedChunk:
    """Validate a whole chunk and return it with a zero-copy view of its payload.

    ``buf`` is any C-contiguous buffer (bytes, bytearray, mmap, a pool slab). For any
    bytes in it, only :class:`~lmtier.errors.CorruptChunk` subclasses are raised
    (a ``buf`` that is not a buffer at all is a TypeError: a caller's bug).
    ``verify=False`` skips the payload checksum (the header checksum is always
    checked), for callers that verified the same bytes before or framed them
    themselves; only it accepts an ``UNSEALED`` chunk (:mod:`lmtier.chunks.encoding`).
    Bytes past the payload are ignored.
    """
    view, meta, payload_offset, checksum, mac, sealed = _read_header(buf)
    end = payload_offset + meta.nbytes
    if len(view) < end:
        raise TruncatedChunk(f"{len(view)} bytes, the payload ends at {end}")
    payload = view[payload_offset:end]
    if verify:
        if not sealed:
            raise _unsealed(meta)
        verify_payload(payload, checksum)
    return DecodedChunk(meta, payload, payload_offset, checksum, mac, sealed)


def decode_as(key: bytes, buf: Any, *, verify: bool = True) -> DecodedChunk:
    """:func:`decode` ``buf``, and check that it is the chunk ``key`` (its 32 bytes:
    namespace then chain): a valid chunk of another key is :class:`InconsistentChunk`."""
    chunk = decode(buf, verify=verify)
    meta = chunk.meta
    if meta.namespace != key[:DIGEST_LEN] or meta.key != key[DIGEST_LEN:]:
        raise InconsistentChunk(f"chunk holds key {(meta.namespace + meta.key).hex()}")
    return chunk


def verify_payload(payload: Any, checksum: int) -> None:
    """Raise ChecksumMismatch unless xxh3_64 of ``payload`` is ``checksum``."""
    actual = xxhash.xxh3_64_intdigest(payload)
    if actual != checksum:
        raise ChecksumMismatch(f"payload xxh3_64 is {actual:#018x}, header says {checksum:#018x}")
