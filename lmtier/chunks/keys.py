"""Chunk keys: deterministic, chained hashes of fixed-size token chunks.

A chunk's key fingerprints the whole prefix up to and including that chunk, so a
lookup walks chunk by chunk and stops at the first miss, and a key found in any
tier on any machine stands for exactly one prefix under one namespace::

    ns   = xxh3_128(msgpack([tag, version, model_id, revision, kv_dtype, kv_layout,
                              num_layers, num_kv_heads, head_dim, chunk_size,
                              tp_size, tp_rank, format_version, cache_salt
                              (, kv_block_size: only when nonzero)
                              (, kv_page_interior: only when set)]))
    k[0] = xxh3_128(ns     || w || tokens[0:C]       || extra[0])
    k[i] = xxh3_128(k[i-1] || w || tokens[iC:(i+1)C] || extra[i])

``w`` is one byte, 4 or 8: the width of the little-endian token encoding *of that
chunk* (8 only when one of its ids needs it), so a chunk's key never depends on
tokens after it. ``extra[i]`` (LoRA adapter, multimodal items overlapping the chunk)
is a msgpack array, omitted when empty; the token part has a fixed length for a
given width, so the concatenation is unambiguous. Hashes keep all 128 bits.

A :data:`ChunkKey` is 32 bytes: the namespace digest, then ``k[i]``. The chain alone
identifies a chunk; the namespace half lets tiers group chunks by namespace (a
directory, a Redis key or S3 prefix per model revision and tenant), so one model's or
one tenant's cache can be listed, expired or deleted without touching the rest.

Everything that makes KV differ for equal tokens is in the namespace digest, so a
new model revision, dtype, layout, KV geometry (layers, KV heads, head size; the page
block size and the attention backend's page interior of a paged layout), TP rank or
tenant (``cache_salt``) matches no old key: invalidation and isolation are one
mechanism. Python's ``hash()`` is never used (it is salted per process).

A second, vLLM-compatible algorithm lives in :mod:`lmtier.chunks.vllm_hash`; both satisfy
the :class:`ChunkHasher` protocol and are chosen with
:func:`lmtier.chunks.hashers.make_hasher`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NewType, Protocol

import msgpack
import numpy as np
import xxhash

from lmtier.chunks.format import DIGEST_LEN, FORMAT_VERSION
from lmtier.chunks.tokens import INT32_LIMIT, TokenArray, TokenInput, as_token_array
from lmtier.errors import ConfigError, InvalidRequestError, brief

__all__ = [
    "BLOCK_SIZE",
    "HASH_ALGORITHMS",
    "KEY_BYTES",
    "NAMESPACE_BYTES",
    "ChunkHasher",
    "ChunkKey",
    "ExtraKeys",
    "HashAlgorithm",
    "MultimodalSpan",
    "Namespace",
    "Xxh3ChunkHasher",
    "check_namespace",
    "split_key",
]

ChunkKey = NewType("ChunkKey", bytes)
"""The 32-byte key of one chunk: namespace digest (16) + chained hash (16); ``.hex()``
is its printable form."""

KEY_BYTES = 2 * DIGEST_LEN
"""Length in bytes of a :data:`ChunkKey` (32): the namespace digest, then the chained hash."""
NAMESPACE_BYTES = DIGEST_LEN
"""Length in bytes of a namespace digest (16), the first half of every :data:`ChunkKey`."""


def split_key(key: ChunkKey) -> tuple[bytes, bytes]:
    """``(namespace digest, chained hash)`` of a chunk key."""
    return key[:NAMESPACE_BYTES], key[NAMESPACE_BYTES:]


def check_namespace(namespace: object) -> bytes:
    """``namespace`` as the 16-byte digest that starts every key of its chunks (bytes,
    bytearray or memoryview); InvalidRequestError for anything else.

    Whatever selects chunks by namespace (a purge) checks it first: a shorter prefix
    would select the chunks of every namespace that starts with it.
    """
    if isinstance(namespace, (bytearray, memoryview)):
        namespace = bytes(namespace)
    if not isinstance(namespace, bytes) or len(namespace) != NAMESPACE_BYTES:
        raise InvalidRequestError(
            f"namespace must be the {NAMESPACE_BYTES}-byte digest of a Namespace "
            f"(Namespace.digest), got {brief(namespace)}"
        )
    return namespace


HashAlgorithm = Literal["xxh3", "vllm"]
"""How chunk keys are computed: lmtier's xxh3 chain, or vLLM's own block hashes."""
HASH_ALGORITHMS: tuple[HashAlgorithm, ...] = ("xxh3", "vllm")
BLOCK_SIZE = 16
"""Tokens per GPU KV block (vLLM's default, and the device tier's): a chunk holds a
whole number of blocks, and vLLM's block hashes are taken every 16 tokens."""

_NAMESPACE_TAG = "lmtier.namespace"
_NAMESPACE_SCHEME_VERSION = 2  # 2: the KV geometry joined the namespace
_WIDTH_INT32 = b"\x04"
_WIDTH_INT64 = b"\x08"


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything besides the tokens that makes KV differ; hashed to seed every key chain.

    Fields: ``model_id`` and ``model_revision`` (a weights fingerprint: a new
    revision invalidates every key), ``kv_dtype`` and ``kv_layout`` (as stored in
    chunks), ``num_layers``/``num_kv_heads``/``head_dim`` (the KV geometry; 0 means
    unspecified, for keys computed without a model at hand), ``chunk_size`` (tokens
    per chunk), ``tp_size``/``tp_rank`` (each tensor-parallel rank stores its own
    shard), ``format_version`` (of the chunk format), ``cache_salt`` (a tenant's
    secret; equal salts share, others never do), ``kv_block_size`` (tokens per page
    block of a paged layout, ``KVSpec.block_size``; 0 otherwise, and then left out of
    the digest, so namespaces from before it keep their keys), ``kv_page_interior``
    (how the engine's attention backend arranges K and V inside a page block,
    ``KVSpec.page_interior``: ``"flash"`` or ``"cpu_attn"``; set only with a paged
    layout, else ``""`` and left out of the digest). A field of the wrong type is a
    ConfigError naming it.
    """

    model_id: str
    model_revision: str = ""
    kv_dtype: str = "float32"
    kv_layout: str = "LKTHD"
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    chunk_size: int = 256
    tp_size: int = 1
    tp_rank: int = 0
    format_version: int = FORMAT_VERSION
    cache_salt: str = ""
    kv_block_size: int = 0
    kv_page_interior: str = ""
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        strings = ("model_id", "model_revision", "kv_dtype", "kv_layout", "cache_salt")
        for name in (*strings, "kv_page_interior"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ConfigError(f"{name} must be a str, got {type(value).__name__}")
        counts = ("num_layers", "num_kv_heads", "head_dim", "chunk_size", "tp_size", "tp_rank")
        for name in (*counts, "kv_block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {brief(value)}")
        if self.chunk_size <= 0:
            raise ConfigError(f"chunk_size must be positive, got {self.chunk_size}")
        if self.tp_size <= 0 or not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"need 0 <= tp_rank < tp_size, got {self.tp_rank}/{self.tp_size}")
        if self.kv_page_interior and not self.kv_block_size:
            raise ConfigError(
                f"kv_page_interior {self.kv_page_interior!r} applies to paged layouts only "
                "(set with kv_block_size)"
            )
        fields: list[object] = [
            _NAMESPACE_TAG,
            _NAMESPACE_SCHEME_VERSION,
            self.model_id,
            self.model_revision,
            self.kv_dtype,
            self.kv_layout,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.chunk_size,
            self.tp_size,
            self.tp_rank,
            self.format_version,
            self.cache_salt,
        ]
        if self.kv_block_size:  # appended only when set: every older digest stays as it was
            fields.append(self.kv_block_size)
        if self.kv_page_interior:  # likewise: page namespaces without it keep their keys
            fields.append(self.kv_page_interior)
        encoded = msgpack.packb(fields, use_bin_type=True)
        object.__setattr__(self, "digest", xxhash.xxh3_128_digest(encoded))

    def __repr__(self) -> str:
        # cache_salt is a tenant secret: show whether one is set, never its value.
        salt = "set" if self.cache_salt else "none"
        return (
            f"Namespace(model_id={self.model_id!r}, model_revision={self.model_revision!r}, "
            f"kv_dtype={self.kv_dtype!r}, kv_layout={self.kv_layout!r}, "
            f"kv_geometry={self.num_layers}x{self.num_kv_heads}x{self.head_dim}, "
            f"kv_block_size={self.kv_block_size}, "
            f"kv_page_interior={self.kv_page_interior!r}, "
            f"chunk_size={self.chunk_size}, tp={self.tp_rank}/{self.tp_size}, "
            f"format_version={self.format_version}, cache_salt={salt}, "
            f"id={self.digest.hex()[:12]})"
        )


@dataclass(frozen=True, slots=True)
class MultimodalSpan:
    """A multimodal item (image, audio) occupying ``length`` placeholder tokens at ``offset``.

    ``identifier`` is a hash of the item's content: equal placeholder tokens with
    different images must not share KV.
    """

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """Per-request inputs that change KV inside a chunk without changing its tokens.

    ``mm_spans`` must be sorted by offset. The extra keys of one chunk use the same
    tagged tuples as vLLM, so both hash algorithms agree on what distinguishes
    chunks: ``("lora", name, path)`` and ``("mm", identifier, offset_in_chunk)``.
    """

    lora_name: str | None = None
    lora_path: str | None = None
    mm_spans: tuple[MultimodalSpan, ...] = ()

    def __post_init__(self) -> None:
        offsets = [span.offset for span in self.mm_spans]
        if offsets != sorted(offsets):
            raise ValueError("ExtraKeys.mm_spans must be sorted by offset")
        for span in self.mm_spans:
            if span.offset < 0 or span.length <= 0:
                raise ValueError(f"invalid multimodal span {span}")

    def for_range(self, start: int, end: int) -> list[tuple[Any, ...]]:
        """The tagged extra keys of the token range ``[start, end)``, LoRA first."""
        keys: list[tuple[Any, ...]] = []
        if self.lora_name is not None:
            keys.append(("lora", self.lora_name, self.lora_path or ""))
        for span in self.mm_spans:
            if span.offset >= end:
                break
            if span.offset + span.length > start:
                # The offset relative to the chunk keeps chunks distinct when the same
                # item sits at different positions among identical placeholder tokens.
                keys.append(("mm", span.identifier, span.offset - start))
        return keys


class ChunkHasher(Protocol):
    """Incremental chunk keys for one growing token sequence.

    ``extend`` takes the next tokens and returns the keys of the chunks they
    complete; the prefix is never hashed again (decode appends one token at a time).
    """

    namespace: Namespace

    @property
    def keys(self) -> Sequence[ChunkKey]:
        """Keys of every full chunk seen so far."""
        ...

    @property
    def num_tokens(self) -> int:
        """Tokens seen so far, including the partial tail not yet hashed."""
        ...

    def extend(self, tokens: TokenInput) -> list[ChunkKey]:
        """Append tokens; return the keys of newly completed full chunks."""
        ...


class Xxh3ChunkHasher:
    """The default chained xxh3-128 chunk keys (module docstring); see :class:`ChunkHasher`."""

    __slots__ = ("_keys", "_parent", "_pending", "extras", "namespace", "vocab_size")

    def __init__(
        self,
        namespace: Namespace,
        *,
        extras: ExtraKeys | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.namespace = namespace
        self.extras = extras
        self.vocab_size = vocab_size
        self._parent: bytes = namespace.digest
        self._keys: list[ChunkKey] = []
        self._pending: TokenArray = np.empty(0, dtype=np.int64)

    @property
    def keys(self) -> Sequence[ChunkKey]:
        return self._keys

    @property
    def num_tokens(self) -> int:
        return len(self._keys) * self.namespace.chunk_size + len(self._pending)

    def extend(self, tokens: TokenInput) -> list[ChunkKey]:
        new = as_token_array(tokens, vocab_size=self.vocab_size)
        pending = np.concatenate((self._pending, new)) if len(self._pending) else new
        size = self.namespace.chunk_size
        num_full = len(pending) // size
        self._pending = pending[num_full * size :].copy()
        if num_full == 0:
            return []
        fresh = self._hash_chunks(pending[: num_full * size], first_chunk=len(self._keys))
        self._keys.extend(fresh)
        return fresh

    def _hash_chunks(self, tokens: TokenArray, first_chunk: int) -> list[ChunkKey]:
        size = self.namespace.chunk_size
        num_chunks = len(tokens) // size
        narrow = int(tokens.max()) < INT32_LIMIT
        data = (tokens.astype("<i4") if narrow else tokens.astype("<i8")).data.cast("B")
        stride = size * (4 if narrow else 8)
        digest = xxhash.xxh3_128_digest
        parent = self._parent
        extras = self.extras
        prefix = self.namespace.digest
        keys: list[ChunkKey] = []
        for index in range(num_chunks):
            if narrow:
                body = data[index * stride : (index + 1) * stride]
                message = parent + _WIDTH_INT32 + body
            else:
                message = parent + _chunk_body(tokens[index * size : (index + 1) * size])
            if extras is not None:
                start = (first_chunk + index) * size
                extra = extras.for_range(start, start + size)
                if extra:
                    message += msgpack.packb(extra, use_bin_type=True)
            parent = digest(message)
            keys.append(ChunkKey(prefix + parent))
        self._parent = parent
        return keys


def _chunk_body(chunk: TokenArray) -> bytes:
    """Width byte plus token bytes of one chunk, 8-byte ids only if this chunk needs them."""
    if int(chunk.max()) < INT32_LIMIT:
        return _WIDTH_INT32 + chunk.astype("<i4").tobytes()
    return _WIDTH_INT64 + chunk.astype("<i8").tobytes()
