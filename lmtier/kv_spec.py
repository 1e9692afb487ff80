"""The geometry of a model's KV cache, and torch views of chunks in pool slabs.

A chunk holds the K and V of ``num_tokens`` tokens for every layer, in one of the
chunk format's layouts (``LKTHD`` by default: layer, K/V, token, head, head_dim).
:class:`KVSpec` knows the shapes and sizes; :func:`encode_kv_into` writes a KV
tensor slice into a slab with one (possibly strided, possibly device-to-host) copy
plus one checksum pass, and :func:`chunk_tensor` gives a zero-copy tensor view of a
loaded chunk. This is the one module between the byte world of tiers and torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmtier.chunk_format import (
    DTYPE_ITEMSIZE,
    LAYOUTS,
    ChunkMeta,
    DecodedChunk,
    encoded_size,
    header_bytes,
)
from lmtier.keys import KEY_BYTES, ChunkKey, split_key
from lmtier.memory import SlabHandle

__all__ = [
    "KVSource",
    "KVSpec",
    "LayerKV",
    "chunk_tensor",
    "encode_kv_into",
    "kv_num_tokens",
    "narrow_kv",
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

    For the ``LTD`` layout (MLA: one latent vector per token), ``num_kv_heads`` is 1
    and ``head_dim`` is the latent size.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    layout: str = "LKTHD"

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim) < 1:
            raise ValueError(f"KVSpec dimensions must be >= 1: {self}")
        if self.layout not in LAYOUTS:
            raise ValueError(
                f"unknown KV layout {self.layout!r}; expected one of {sorted(LAYOUTS)}"
            )
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}")

    @classmethod
    def from_hf_config(cls, config: Any, dtype: str = "float32") -> KVSpec:
        """The spec of a transformers config (Llama-style attributes)."""
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        return cls(config.num_hidden_layers, heads, head_dim, dtype)

    def shape(self, num_tokens: int) -> tuple[int, ...]:
        """Tensor shape of the KV of ``num_tokens`` tokens in this layout."""
        layers, heads, dim = self.num_layers, self.num_kv_heads, self.head_dim
        if self.layout == "LKTHD":
            return (layers, 2, num_tokens, heads, dim)
        if self.layout == "KLTHD":
            return (2, layers, num_tokens, heads, dim)
        return (layers, num_tokens, heads * dim)

    @property
    def token_axis(self) -> int:
        """Index of the token axis in :meth:`shape`."""
        return LAYOUTS_TOKEN_AXIS[self.layout]

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token, all layers."""
        factor = 1 if self.layout == "LTD" else 2
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


LAYOUTS_TOKEN_AXIS = {"LKTHD": 2, "KLTHD": 2, "LTD": 1}


def kv_num_tokens(kv: KVSource, spec: KVSpec) -> int:
    """Tokens covered by ``kv``."""
    if isinstance(kv, torch.Tensor):
        return int(kv.shape[spec.token_axis])
    return min((int(k.shape[0]) for k, _ in kv), default=0)


def narrow_kv(kv: KVSource, spec: KVSpec, start: int, length: int) -> KVSource:
    """Tokens ``[start, start + length)`` of ``kv``, as views (no copy)."""
    if isinstance(kv, torch.Tensor):
        return kv.narrow(spec.token_axis, start, length)
    return [(k.narrow(0, start, length), v.narrow(0, start, length)) for k, v in kv]


def encode_kv_into(handle: SlabHandle, meta: ChunkMeta, kv: KVSource) -> int:
    """Encode ``kv`` (shape ``meta.shape``, or per-layer pairs; any strides/device) into a slab.

    The payload is copied once, straight to its place in the slab (a strided gather,
    or a device-to-host copy, done by torch), then hashed once for the header.
    Returns the encoded length.
    """
    offset = encoded_size(meta) - meta.nbytes
    end = offset + meta.nbytes
    if end > len(handle.view):
        raise ValueError(f"chunk of {end} bytes does not fit a {len(handle.view)}-byte slab")
    target = handle.tensor[offset:end].view(torch_dtype(meta.dtype)).view(meta.shape)
    if isinstance(kv, torch.Tensor):
        if tuple(kv.shape) != meta.shape:
            raise ValueError(f"KV tensor has shape {tuple(kv.shape)}, the chunk needs {meta.shape}")
        target.copy_(kv)
    else:
        _copy_layers(target, meta, kv)
    handle.view[:offset] = header_bytes(meta, handle.view[offset:end])
    return end


def _copy_layers(target: torch.Tensor, meta: ChunkMeta, kv: Sequence[LayerKV]) -> None:
    if meta.layout not in ("LKTHD", "KLTHD"):
        raise ValueError(f"per-layer (K, V) input needs a K/V layout, not {meta.layout}")
    layers = meta.shape[0] if meta.layout == "LKTHD" else meta.shape[1]
    if len(kv) != layers:
        raise ValueError(f"got KV for {len(kv)} layers, the chunk has {layers}")
    for layer, (key, value) in enumerate(kv):
        if meta.layout == "LKTHD":
            target[layer, 0].copy_(key)
            target[layer, 1].copy_(value)
        else:
            target[0, layer].copy_(key)
            target[1, layer].copy_(value)


def chunk_tensor(chunk: DecodedChunk) -> torch.Tensor:
    """A zero-copy tensor view of a decoded chunk's payload, shaped as its meta says."""
    meta = chunk.meta
    raw = torch.frombuffer(chunk.payload, dtype=torch.uint8)
    return raw.view(torch_dtype(meta.dtype)).view(meta.shape)
