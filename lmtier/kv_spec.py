"""The geometry of a model's KV cache, and torch views of chunks in pool slabs.

A chunk holds the K and V of ``num_tokens`` tokens for every layer, in one of the
chunk format's layouts (``LKTHD`` by default: layer, K/V, token, head, head_dim; or a
paged layout, ``LBHSC``/``LBSHC``, holding whole page blocks in an engine's page order).
:class:`KVSpec` knows the shapes and sizes; :func:`encode_kv_into` writes a KV
tensor slice into a slab with one (possibly strided, possibly device-to-host) copy
plus one checksum pass, and :func:`chunk_tensor` gives a zero-copy tensor view of a
loaded chunk. This is the one module between the byte world of tiers and torch.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmtier.chunks.encoding import (
    HeaderTemplate,
    MacSigner,
    encoded_size,
    header_bytes,
    payload_checksum,
)
from lmtier.chunks.format import (
    DIGEST_LEN,
    DTYPE_ITEMSIZE,
    LATENT_LAYOUTS,
    LAYOUTS,
    PAGE_INTERIORS,
    PAGED_LAYOUTS,
    ChunkGeometry,
    ChunkMeta,
    DecodedChunk,
)
from lmtier.chunks.keys import KEY_BYTES, ChunkKey, split_key
from lmtier.copies import copy_many
from lmtier.errors import InvalidKVError, brief
from lmtier.storage.host_pool import SlabHandle

__all__ = [
    "ChunkFramer",
    "PAGE_INTERIORS",
    "KVSource",
    "KVSpec",
    "LayerKV",
    "check_kv",
    "chunk_tensor",
    "encode_kv_into",
    "frame_slab",
    "layer_major",
    "narrow_kv",
    "payload_tensor",
    "seal_slab",
    "torch_dtype",
]

LayerKV = tuple[torch.Tensor, torch.Tensor]
"""K and V of one layer, each shaped (tokens, kv_heads, head_dim), any strides/device."""

KVSource = torch.Tensor | Sequence[LayerKV]
"""KV to store: one tensor shaped ``KVSpec.shape(n)``, or one (K, V) pair per layer
(what an engine's per-layer cache holds; no need to stack it into one tensor first)."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a chunk-format dtype name (``"bfloat16"`` -> torch.bfloat16)."""
    if name not in DTYPE_ITEMSIZE:
        raise ValueError(f"unsupported KV dtype {name!r}; expected one of {sorted(DTYPE_ITEMSIZE)}")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"this torch build has no dtype {name!r}")
    return dtype


@dataclass(frozen=True, slots=True)
class KVSpec:
    """Shape of one model's KV per token: layers, KV heads, head size, dtype, layout.

    For the latent layouts (``LTD``, ``TLD``: MLA), ``num_kv_heads`` is 1 and
    ``head_dim`` is the latent size. ``KTLHD`` and ``TLD`` keep each token's layers
    together, as a page-first host pool does, so that its pages copy as whole runs.
    The paged layouts (``LBHSC``, ``LBSHC``; K/V models only) store whole page blocks
    of ``block_size`` tokens in the order of the engine's pages, so that saving and
    loading them are block copies: ``block_size`` is the engine's page block size
    there (>= 1), and 0 for every other layout, and ``page_interior`` (one of
    :data:`PAGE_INTERIORS`, or ``""``: unspecified) names how the engine's attention
    backend lays K and V out inside a block, so that pages of equal shape but different
    bytes (a GPU's and a CPU's) never share a namespace; ``""`` for every non-paged
    layout.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    layout: str = "LKTHD"
    block_size: int = 0
    page_interior: str = ""

    def __post_init__(self) -> None:
        dims = (self.num_layers, self.num_kv_heads, self.head_dim)
        if any(not isinstance(d, int) or isinstance(d, bool) for d in dims) or min(dims) < 1:
            raise ValueError(f"KVSpec dimensions must be ints >= 1: {self}")
        if self.layout in LATENT_LAYOUTS and self.num_kv_heads != 1:
            raise ValueError(
                f"the {self.layout} layout (MLA) has one latent per token: num_kv_heads=1, {self}"
            )
        if self.layout not in LAYOUTS:
            raise ValueError(
                f"unknown KV layout {self.layout!r}; expected one of {sorted(LAYOUTS)}"
            )
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}")
        size = self.block_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"block_size must be an int >= 0, got {size!r:.40}")
        if self.paged and size < 1:
            raise ValueError(
                f"the paged layout {self.layout} holds whole page blocks: set block_size to "
                "the engine's page block size (tokens per block, >= 1)"
            )
        if not self.paged and size:
            raise ValueError(
                f"block_size={size} applies to the paged layouts {sorted(PAGED_LAYOUTS)} "
                f"only; {self.layout} needs block_size=0"
            )
        interior = self.page_interior
        if interior and (not isinstance(interior, str) or interior not in PAGE_INTERIORS):
            raise ValueError(
                f"page_interior must be one of {sorted(PAGE_INTERIORS)} (or empty), "
                f"got {interior!r:.40}"
            )
        if interior and not self.paged:
            raise ValueError(
                f"page_interior={interior!r} applies to the paged layouts "
                f"{sorted(PAGED_LAYOUTS)} only; {self.layout} needs page_interior=''"
            )

    @classmethod
    def from_hf_config(cls, config: Any, dtype: str = "float32") -> KVSpec:
        """The spec of a transformers config (Llama-style attributes)."""
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        return cls(config.num_hidden_layers, heads, head_dim, dtype)

    @property
    def latent(self) -> bool:
        """Whether the layout holds one latent vector per token (MLA), not K and V."""
        return self.layout in LATENT_LAYOUTS

    @property
    def paged(self) -> bool:
        """Whether the layout holds whole page blocks (``LBHSC``, ``LBSHC``), not tokens."""
        return self.layout in PAGED_LAYOUTS

    def shape(self, num_tokens: int) -> tuple[int, ...]:
        """Tensor shape of the KV of ``num_tokens`` tokens in this layout (for a paged
        layout, ValueError unless ``num_tokens`` is a multiple of ``block_size``)."""
        layers, heads, dim = self.num_layers, self.num_kv_heads, self.head_dim
        if self.layout == "LKTHD":
            return (layers, 2, num_tokens, heads, dim)
        if self.layout == "KLTHD":
            return (2, layers, num_tokens, heads, dim)
        if self.layout == "KTLHD":
            return (2, num_tokens, layers, heads, dim)
        if self.layout == "TLD":
            return (num_tokens, layers, heads * dim)
        if self.paged:
            slots = self.block_size
            blocks, rest = divmod(num_tokens, slots)
            if rest:
                raise ValueError(
                    f"{num_tokens} tokens are no whole number of blocks of {slots} "
                    f"({self.layout} chunks hold whole page blocks)"
                )
            inner = (heads, slots) if self.layout == "LBHSC" else (slots, heads)
            return (layers, blocks, *inner, 2 * dim)
        return (layers, num_tokens, heads * dim)

    def tokens_of(self, shape: Sequence[int]) -> int | None:
        """How many tokens a tensor of ``shape`` holds in this layout, or None when
        ``shape`` is no ``self.shape(n)``."""
        if len(shape) != len(self.layout):
            return None
        count = int(shape[self.token_axis]) * (self.block_size if self.paged else 1)
        return count if tuple(shape) == self.shape(count) else None

    @property
    def token_axis(self) -> int:
        """Index of the axis along which tokens run in :meth:`shape`: chunks of
        consecutive tokens concatenate along it. For a paged layout it is the block axis,
        whose indices count blocks of ``block_size`` tokens: narrow a tensor by tokens
        with :meth:`narrow_tokens`, which knows both cases."""
        return self.layout.index("B" if self.paged else "T")

    def narrow_tokens(self, tensor: torch.Tensor, start: int, length: int) -> torch.Tensor:
        """Tokens ``[start, start + length)`` of a tensor shaped ``self.shape(n)``, as a
        view (no copy). For a paged layout ``start`` and ``length`` must be multiples of
        ``block_size`` (ValueError): a view cannot cut a block's slots out of its heads."""
        if not self.paged:
            return tensor.narrow(self.token_axis, start, length)
        slots = self.block_size
        if start % slots or length % slots:
            raise ValueError(
                f"tokens {start}..{start + length} of a {self.layout} chunk are not whole "
                f"blocks of {slots}: a paged chunk narrows by whole blocks only"
            )
        return tensor.narrow(self.token_axis, start // slots, length // slots)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token, all layers."""
        factor = 1 if self.latent else 2
        return (
            factor
            * self.num_layers
            * self.num_kv_heads
            * self.head_dim
            * DTYPE_ITEMSIZE[self.dtype]
        )

    def meta(self, key: ChunkKey, num_tokens: int) -> ChunkMeta:
        """The chunk-format meta of chunk ``key`` holding ``num_tokens`` tokens."""
        namespace, chain = split_key(key)
        return ChunkMeta(
            key=chain,
            namespace=namespace,
            dtype=self.dtype,
            shape=self.shape(num_tokens),
            layout=self.layout,
            num_tokens=num_tokens,
        )

    def encoded_chunk_bytes(self, chunk_size: int) -> int:
        """Encoded size of one full chunk: the pool's slab size."""
        return encoded_size(self.meta(ChunkKey(bytes(KEY_BYTES)), chunk_size))

    def geometry(self, chunk_size: int) -> ChunkGeometry:
        """What every full chunk of ``chunk_size`` tokens of this spec looks like."""
        return ChunkGeometry(self.dtype, self.layout, self.shape(chunk_size))


def layer_major(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """A view of ``tensor`` (a token-layout chunk's KV in ``layout``) as (L, K, T, H, D):
    the axes permuted by their letters, a latent layout's as K = H = 1 (no copy).
    ValueError for a paged layout, whose blocks have no token axis to view."""
    if layout in PAGED_LAYOUTS:
        raise ValueError(f"{layout} chunks hold whole page blocks, not a token axis")
    if layout in LATENT_LAYOUTS:
        ordered = tensor.permute([layout.index(axis) for axis in "LTD"])
        return ordered.unsqueeze(1).unsqueeze(-2)  # (L, T, D) -> (L, 1, T, 1, D)
    return tensor.permute([layout.index(axis) for axis in "LKTHD"])


def check_kv(kv: object, spec: KVSpec) -> int:
    """How many tokens ``kv`` covers, after checking it matches ``spec`` exactly.

    ``kv`` is one tensor shaped ``spec.shape(n)`` or (token layouts only) one
    ``(K, V)`` pair per layer, each shaped ``(n, num_kv_heads, head_dim)``; of
    ``spec``'s dtype (never cast silently), strided, on a real device (not ``meta``).
    Anything else is an :class:`~lmtier.errors.InvalidKVError` that says what was
    expected; nothing is broadcast.
    """
    if isinstance(kv, torch.Tensor):
        _check_tensor("kv", kv, spec)
        count = spec.tokens_of(kv.shape)
        if count is None:
            unit = f"blocks of {spec.block_size} tokens" if spec.paged else "tokens"
            raise InvalidKVError(
                f"kv has shape {tuple(kv.shape)}; this cache needs {spec.shape(0)} with any "
                f"number of {unit} on axis {spec.token_axis} ({spec.layout})"
            )
        return count
    if isinstance(kv, (str, bytes)) or not isinstance(kv, Sequence):
        raise InvalidKVError(
            f"kv must be a torch.Tensor shaped {spec.shape(0)} (any token count) or a "
            f"sequence of (K, V) tensor pairs per layer, got {type(kv).__name__}"
        )
    if spec.latent:
        raise InvalidKVError(
            f"per-layer (K, V) pairs need a K/V layout; pass one {spec.layout} tensor"
        )
    if spec.paged:
        raise InvalidKVError(
            f"per-layer (K, V) pairs need a K/V token layout (LKTHD, KLTHD, KTLHD); "
            f"{spec.layout} chunks hold whole page blocks: pass one tensor shaped "
            f"{spec.shape(0)} with any number of blocks of {spec.block_size} tokens on "
            f"axis {spec.token_axis}"
        )
    if len(kv) != spec.num_layers:
        raise InvalidKVError(f"kv has {len(kv)} layers; this cache has {spec.num_layers}")
    tokens: int | None = None
    for layer, pair in enumerate(kv):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InvalidKVError(f"kv[{layer}] must be a (K, V) pair of tensors, got {brief(pair)}")
        for name, tensor in zip("KV", pair, strict=True):
            where = f"kv[{layer}] {name}"
            if not isinstance(tensor, torch.Tensor):
                raise InvalidKVError(f"{where} must be a torch.Tensor, got {type(tensor).__name__}")
            _check_tensor(where, tensor, spec)
            shape = tuple(tensor.shape)
            if len(shape) != 3 or shape[1:] != (spec.num_kv_heads, spec.head_dim):
                raise InvalidKVError(
                    f"{where} has shape {shape}; expected (tokens, {spec.num_kv_heads}, "
                    f"{spec.head_dim})"
                )
            if tokens is not None and shape[0] != tokens:
                raise InvalidKVError(
                    f"{where} covers {shape[0]} tokens, other K/V tensors cover {tokens}: "
                    "every layer's K and V must cover the same tokens"
                )
            tokens = shape[0]
    return tokens or 0


def _check_tensor(where: str, tensor: torch.Tensor, spec: KVSpec) -> None:
    dtype = torch_dtype(spec.dtype)
    if tensor.dtype != dtype:
        raise InvalidKVError(
            f"{where} has dtype {tensor.dtype}; this cache stores {dtype} (KVSpec.dtype): "
            "convert it first, nothing is cast silently"
        )
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        raise InvalidKVError(
            f"{where} is a {tensor.layout} tensor on {tensor.device}; KV must be a dense "
            "tensor holding real data"
        )


def narrow_kv(kv: KVSource, spec: KVSpec, start: int, length: int) -> KVSource:
    """Tokens ``[start, start + length)`` of ``kv``, as views (no copy); whole blocks
    for a paged layout (:meth:`KVSpec.narrow_tokens`)."""
    if isinstance(kv, torch.Tensor):
        return spec.narrow_tokens(kv, start, length)
    return [(k.narrow(0, start, length), v.narrow(0, start, length)) for k, v in kv]


def payload_tensor(handle: SlabHandle, meta: ChunkMeta) -> torch.Tensor:
    """The payload region of a slab as a tensor of ``meta``'s dtype and shape (a view):
    where an encoder copies KV before :func:`seal_slab` frames it in place."""
    offset = encoded_size(meta) - meta.nbytes
    end = offset + meta.nbytes
    if end > len(handle.view):
        raise ValueError(f"chunk of {end} bytes does not fit a {len(handle.view)}-byte slab")
    return handle.tensor[offset:end].view(torch_dtype(meta.dtype)).view(meta.shape)


@functools.lru_cache(maxsize=64)
def _template(dtype: str, shape: tuple[int, ...], layout: str, num_tokens: int) -> HeaderTemplate:
    """The header template of chunks of this geometry (one per geometry, shared)."""
    blank = bytes(DIGEST_LEN)
    return HeaderTemplate(ChunkMeta(blank, blank, dtype, shape, layout, num_tokens))


class ChunkFramer:
    """Writes the full chunks of one cache (``spec``, ``chunk_size``) into slabs: the KV
    copied to its place, then a header from a template (~2 us): ``UNSEALED`` (the
    checksum and MAC come later, off the caller's thread: :mod:`lmtier.storage.sealing`)
    unless the chunk is sealed as it is copied (:meth:`write_many`). What
    :meth:`lmtier.LMTier.store` runs per chunk: one copy of the KV, and at most a hash
    of what the copy just wrote."""

    __slots__ = ("_dtype", "_end", "_meta", "_start", "template")

    def __init__(self, spec: KVSpec, chunk_size: int) -> None:
        self._meta = meta = spec.meta(ChunkKey(bytes(KEY_BYTES)), chunk_size)
        self.template = _template(meta.dtype, meta.shape, meta.layout, meta.num_tokens)
        self._dtype = torch_dtype(spec.dtype)
        self._start, self._end = self.template.payload_offset, self.template.encoded_size

    def payload(self, handle: SlabHandle) -> torch.Tensor:
        """The payload region of ``handle``'s slab, shaped as one full chunk (a view)."""
        return handle.tensor[self._start : self._end].view(self._dtype).view(self._meta.shape)

    def write(self, handle: SlabHandle, key: ChunkKey, kv: KVSource, ctime: float) -> int:
        """Copy one chunk's ``kv`` (checked by :func:`check_kv`, narrowed to one chunk)
        into ``handle``'s slab and frame it unsealed as chunk ``key``; the encoded length."""
        return self.write_many([(handle, key, kv)], ctime)[0]

    def write_many(
        self,
        chunks: Sequence[tuple[SlabHandle, ChunkKey, KVSource]],
        ctime: float,
        *,
        seal: bool = False,
    ) -> list[int]:
        """:meth:`write` for each ``(handle, key, kv)``, their copies one shared copy
        (:func:`lmtier.copies.copy_many`: a batch of small chunks is copied by several
        threads at once); the encoded lengths.

        ``seal``: frame each chunk sealed (with its checksum; no MAC), hashing it right
        after its copy on the thread that copied it, while its bytes are in the cache.
        For chunks that go below host memory at once, whose checksum would otherwise be
        a second pass over memory later (:mod:`lmtier.storage.sealing`, which skips
        chunks sealed already)."""
        meta, start, end = self._meta, self._start, self._end
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        then: list[Callable[[], None] | None] = []
        sums = [0] * len(chunks)
        for at, (handle, _, kv) in enumerate(chunks):
            own = _kv_pairs(self.payload(handle), meta, kv)
            pairs += own
            if seal:  # one tensor: one pair, its hash runs as it is copied, no countdown
                done = functools.partial(_hash, sums, at, handle, start, end)
                then += [done] if len(own) == 1 else [_Countdown(len(own), done)] * len(own)
        copy_many(pairs, then)
        frame = self.template.frame_into
        return [
            frame(handle.view, key, ctime=ctime, checksum=sums[at], sealed=seal)
            for at, (handle, key, _) in enumerate(chunks)
        ]


class _Countdown:
    """Runs ``action`` at its ``count``-th call (a chunk's last pair copied); thread-safe."""

    __slots__ = ("_action", "_left", "_lock")

    def __init__(self, count: int, action: Callable[[], None]) -> None:
        self._left, self._action, self._lock = count, action, threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self._left -= 1
            due = self._left == 0
        if due:
            self._action()


def _hash(sums: list[int], at: int, handle: SlabHandle, start: int, end: int) -> None:
    sums[at] = payload_checksum(handle.view[start:end])


def frame_slab(handle: SlabHandle, meta: ChunkMeta) -> int:
    """Write an ``UNSEALED`` header in front of a payload already in place (no pass over
    the payload: the checksum and MAC are computed when the chunk is written below host
    memory). Returns the encoded length. Call it only once the payload's copy is done."""
    template = _template(meta.dtype, meta.shape, meta.layout, meta.num_tokens)
    if template.encoded_size > len(handle.view):
        raise ValueError(f"a {template.encoded_size}-byte chunk does not fit its slab")
    ctime = meta.created if meta.created != 0.0 else time.time()
    return template.frame_into(handle.view, meta.namespace + meta.key, ctime=ctime, sealed=False)


def seal_slab(handle: SlabHandle, meta: ChunkMeta, sign: MacSigner | None = None) -> int:
    """Write the header in front of a payload already in place (one checksum pass, and
    one MAC pass with ``sign``). Returns the encoded length. Call it only once the
    payload's copy has finished."""
    offset = encoded_size(meta) - meta.nbytes
    end = offset + meta.nbytes
    handle.view[:offset] = header_bytes(meta, handle.view[offset:end], sign)
    return end


def encode_kv_into(
    handle: SlabHandle, meta: ChunkMeta, kv: KVSource, sign: MacSigner | None = None
) -> int:
    """Encode ``kv`` (checked by :func:`check_kv`; any strides/device) into a slab.

    The payload is copied once, straight to its place in the slab (a strided gather,
    or a device-to-host copy, done by torch), then hashed once for the header (and
    MACed with ``sign``). Returns the encoded length.
    """
    if isinstance(kv, torch.Tensor) and tuple(kv.shape) != meta.shape:
        raise ValueError(f"KV tensor has shape {tuple(kv.shape)}, the chunk needs {meta.shape}")
    copy_many(_kv_pairs(payload_tensor(handle, meta), meta, kv))
    return seal_slab(handle, meta, sign)


def _kv_pairs(
    target: torch.Tensor, meta: ChunkMeta, kv: KVSource
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(place, source)`` copies that put one chunk's KV, a tensor or per-layer
    (K, V) pairs, into its payload view ``target``."""
    if isinstance(kv, torch.Tensor):
        return [(target, kv)]
    if meta.layout in PAGED_LAYOUTS or meta.layout in LATENT_LAYOUTS:
        raise ValueError(f"per-layer (K, V) input needs a K/V layout, not {meta.layout}")
    layers = layer_major(target, meta.layout)
    if len(kv) != len(layers):
        raise ValueError(f"got KV for {len(kv)} layers, the chunk has {len(layers)}")
    pairs = []
    for layer, (key, value) in zip(layers, kv, strict=True):
        pairs += [(layer[0], key), (layer[1], value)]
    return pairs


def chunk_tensor(chunk: DecodedChunk) -> torch.Tensor:
    """A zero-copy tensor view of a decoded chunk's payload, shaped as its meta says."""
    meta = chunk.meta
    raw = torch.frombuffer(chunk.payload, dtype=torch.uint8)
    return raw.view(torch_dtype(meta.dtype)).view(meta.shape)
