"""Device KV memory: a model's paged K and V, allocated once, seen through one view.

The attention kernels read and write KV in fixed-size *blocks* (pages) of
``block_size`` token slots; a request's block table lists its blocks in token order,
and token ``t`` of a request lives in slot ``block_table[t // S] * S + t % S``
(:meth:`PagedKVCache.slot_mapping`, vLLM's convention).

Page layouts (axis letters: K = the K/V pair, N = block number, S = slot within the
block, H = KV head, D = head dim, C = K and V side by side on the last axis)::

    "KNSHD"  (2, N, S, H, D)   older vLLM FlashAttention, LMCache; our own layout
    "NKSHD"  (N, 2, S, H, D)   older vLLM FlashInfer
    "NHSC"   (N, H, S, 2*D)    vLLM 0.33: the logical [B, H, N, C] per-layer view, K then
                               V on C (C = D for MLA), in any physical stride order
    "NSD"    (N, S, D)         MLA: one latent vector per token, no K/V pair

**Our own allocation** (:class:`PagedKVCache` built from a spec) is one tensor of shape
``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)`` (``(num_layers,
num_blocks, block_size, latent)`` for MLA specs), and ``layer(i)`` is a view of it: each
layer looks exactly like a FlashAttention-style per-layer cache, a layer's K and V are
each one dense tensor, and a whole-model gather of a chunk is one indexing op on
axis 2 instead of one per layer. The rejected alternative, one
allocation per layer, costs a Python-level op per layer on every transfer.

**Wrapped tensors** (:meth:`PagedKVCache.from_tensors`) are the engine's own per-layer
tensors: any of the layouts above, with any strides (vLLM hands out permuted,
padded views of one raw buffer). The layout is detected from the shapes (or named,
where shapes are ambiguous); anything else is a ``ValueError`` that lists what is
supported. Nothing here ever assumes contiguity.

**The canonical view.** Every layout is viewed, without a copy, as ``(K, N, S, H, D)``
per layer (K is 1 for MLA): a transpose, a permute or an unsqueeze. The transfer
engine only knows this view, so one gather/scatter formulation serves every layout.
When all layers are equally spaced views of one storage (our own allocation; vLLM's
layer-compact and block-outermost layouts), :attr:`PagedKVCache.stacked` is the same
view with a leading layer axis, built with ``as_strided``, and whole-model transfers
use it. :func:`bit_view`, :func:`split_tokens` and :func:`as_3d` are the other views
the transfer engine takes (all views, never copies).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from typing import Literal, get_args

import torch

from lmtier.chunks.keys import BLOCK_SIZE
from lmtier.kv_spec import KVSpec, torch_dtype

__all__ = ["PAGE_LAYOUTS", "PageLayout", "PagedKVCache", "as_3d", "bit_view", "split_tokens"]

PageLayout = Literal["KNSHD", "NKSHD", "NHSC", "NSD"]
PAGE_LAYOUTS: tuple[PageLayout, ...] = get_args(PageLayout)


def _expected_shape(
    layout: PageLayout, spec: KVSpec, num_blocks: int, slots: int
) -> tuple[int, ...]:
    """The per-layer shape of ``layout`` for this spec (num_blocks, slots as given)."""
    heads, dim = spec.num_kv_heads, spec.head_dim
    if layout == "KNSHD":
        return (2, num_blocks, slots, heads, dim)
    if layout == "NKSHD":
        return (num_blocks, 2, slots, heads, dim)
    if layout == "NHSC":
        return (num_blocks, heads, slots, dim * _kv_pairs(spec))
    return (num_blocks, slots, dim)


def _kv_pairs(spec: KVSpec) -> int:
    """Size of the canonical K axis: 2 (K and V), or 1 for MLA's single latent."""
    return 1 if spec.layout == "LTD" else 2


def _block_axes(layout: PageLayout) -> tuple[int, int]:
    """(block axis, slot axis) of a per-layer tensor in ``layout``."""
    return {"KNSHD": (1, 2), "NKSHD": (0, 2), "NHSC": (0, 2), "NSD": (0, 1)}[layout]


def _allowed(layout: PageLayout, spec: KVSpec) -> bool:
    # MLA has no K/V pair, so the 5-D layouts cannot hold it; "NSD" has no head axis.
    if spec.layout == "LTD":
        return layout in ("NHSC", "NSD") and spec.num_kv_heads == 1
    return layout != "NSD"


def _detect_layout(spec: KVSpec, shape: tuple[int, ...], block_size: int | None) -> PageLayout:
    matches = []
    for layout in PAGE_LAYOUTS:
        if not _allowed(layout, spec) or len(shape) != len(_expected_shape(layout, spec, 1, 1)):
            continue
        block_axis, slot_axis = _block_axes(layout)
        slots = shape[slot_axis] if block_size is None else block_size
        if shape == _expected_shape(layout, spec, shape[block_axis], slots):
            matches.append(layout)
    if len(matches) == 1:
        return matches[0]
    if not matches:
        expected = ", ".join(
            f"{name} {_expected_shape(name, spec, -1, block_size or -1)}"
            for name in PAGE_LAYOUTS
            if _allowed(name, spec)
        )
        raise ValueError(
            f"per-layer KV tensors of shape {shape} match no supported page layout for "
            f"{spec} (-1: any size): {expected}"
        )
    raise ValueError(
        f"per-layer KV shape {shape} is ambiguous between layouts {matches}; "
        "pass layout= (and block_size=) to from_tensors"
    )


def _canonical(tensor: torch.Tensor, layout: PageLayout, pairs: int) -> torch.Tensor:
    """View a per-layer tensor as (K, N, S, H, D); never copies."""
    if layout == "KNSHD":
        return tensor
    if layout == "NKSHD":
        return tensor.transpose(0, 1)
    if layout == "NHSC":
        # (N, H, S, K*D) -> (N, H, S, K, D) -> (K, N, S, H, D): splitting an axis is a view.
        split = tensor.view(*tensor.shape[:-1], pairs, tensor.shape[-1] // pairs)
        return split.permute(3, 0, 2, 1, 4)
    return tensor.unsqueeze(0).unsqueeze(-2)


def _non_overlapping(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """A sufficient test that no two indices of a strided view share an element."""
    dims = sorted((stride, size) for size, stride in zip(shape, strides, strict=True) if size > 1)
    reach = 1  # every dim so far spans fewer elements than the next stride
    for stride, size in dims:
        if stride < reach:
            return False
        reach = stride * size
    return True


def _stack(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The layers as one (L, K, N, S, H, D) view when they are equally spaced views of
    one storage with equal strides, else None (then transfers go layer by layer)."""
    first = views[0]
    if len(views) == 1:
        return first.unsqueeze(0)
    storage = first.untyped_storage().data_ptr()
    offsets = [int(v.storage_offset()) for v in views]
    step = offsets[1] - offsets[0]
    same = all(
        v.untyped_storage().data_ptr() == storage and v.stride() == first.stride() for v in views
    )
    if not same or step <= 0 or any(b - a != step for a, b in itertools.pairwise(offsets)):
        return None
    shape, strides = (len(views), *first.shape), (step, *map(int, first.stride()))
    if not _non_overlapping(shape, strides):
        return None
    return first.as_strided(shape, strides, offsets[0])


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_view(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the same width (same shape and strides)."""
    return tensor.view(_BITS[tensor.element_size()])


def split_tokens(chunk: torch.Tensor, num_blocks: int, slots: int) -> torch.Tensor:
    """View (..., T, H, D) as (..., blocks, S, H, D); splitting an axis never copies."""
    shape = chunk.shape
    return chunk.view(*shape[:-3], num_blocks, slots, *shape[-2:])


def _joinable(tensor: torch.Tensor, start: int, end: int) -> bool:
    """Whether axes ``start .. end - 1`` merge into one axis by a view (no copy)."""
    axes = [(tensor.shape[i], tensor.stride(i)) for i in range(start, end) if tensor.shape[i] != 1]
    return all(outer == inner * size for (_, outer), (size, inner) in itertools.pairwise(axes))


def as_3d(blocks: torch.Tensor) -> torch.Tensor | None:
    """(..., N, S, H, D) as (P, N, S*H*D) when that is a view, else None.

    The transfer engine indexes blocks through it where it can: index_select and
    index_copy_ over 3 axes with long rows run ~25% faster on CPU than over 5 or 6
    (measured here: 13.5 vs 10.8 GB/s single-threaded).
    """
    rank = blocks.dim()
    if not (_joinable(blocks, 0, rank - 4) and _joinable(blocks, rank - 3, rank)):
        return None
    return blocks.view(-1, blocks.shape[-4], math.prod(blocks.shape[-3:]))


class PagedKVCache:
    """Per-layer paged K/V on the model's device, allocated once, viewed canonically.

    ``PagedKVCache(spec, num_blocks, block_size, device)`` allocates and zeroes one
    tensor for all layers (see the module docstring for its layout); wrap an engine's
    existing tensors with :meth:`from_tensors`. Blocks are numbered ``0 ..
    num_blocks - 1``; which blocks a request owns is the block manager's business.
    """

    __slots__ = (
        "_block_size",
        "_canonical",
        "_layers",
        "_layout",
        "_num_blocks",
        "_spec",
        "_stacked",
    )

    def __init__(
        self,
        spec: KVSpec,
        num_blocks: int,
        block_size: int = BLOCK_SIZE,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}"
            )
        layout: PageLayout = "NSD" if spec.layout == "LTD" else "KNSHD"
        shape = (spec.num_layers, *_expected_shape(layout, spec, num_blocks, block_size))
        # zeros, not empty: the first touch of every page happens now, not mid-request.
        whole = torch.zeros(shape, dtype=torch_dtype(spec.dtype), device=device)
        self._setup(spec, list(whole.unbind(0)), layout, block_size)

    @classmethod
    def from_tensors(
        cls,
        spec: KVSpec,
        layers: Sequence[torch.Tensor],
        *,
        block_size: int | None = None,
        layout: PageLayout | None = None,
    ) -> PagedKVCache:
        """Wrap an engine's per-layer KV tensors (any strides; no copy).

        ``layout`` is detected from the shapes when None; ``block_size`` (optional)
        is checked against them and settles ambiguous shapes. Raises ``ValueError``
        for layouts this module does not support, mixed shapes, dtypes or devices.
        """
        if len(layers) != spec.num_layers:
            raise ValueError(f"{len(layers)} layer tensors for a {spec.num_layers}-layer spec")
        first = layers[0]
        for tensor in layers:
            if tensor.shape != first.shape or tensor.device != first.device:
                raise ValueError(
                    f"layer tensors differ: {tuple(tensor.shape)} on {tensor.device} vs "
                    f"{tuple(first.shape)} on {first.device}"
                )
        if any(tensor.dtype != torch_dtype(spec.dtype) for tensor in layers):
            raise ValueError(f"layer tensors are {first.dtype}, the spec says {spec.dtype}")
        shape = tuple(first.shape)
        if layout is None:
            layout = _detect_layout(spec, shape, block_size)
        elif layout not in PAGE_LAYOUTS or not _allowed(layout, spec):
            raise ValueError(f"page layout {layout!r} cannot hold {spec}; known: {PAGE_LAYOUTS}")
        block_axis, slot_axis = _block_axes(layout)
        slots = shape[slot_axis]
        if shape != _expected_shape(layout, spec, shape[block_axis], block_size or slots):
            expected = _expected_shape(layout, spec, -1, block_size or -1)
            raise ValueError(f"layer shape {shape} is not {layout} {expected} (-1: any size)")
        pages = cls.__new__(cls)
        pages._setup(spec, list(layers), layout, slots)
        return pages

    def _setup(
        self, spec: KVSpec, layers: list[torch.Tensor], layout: PageLayout, block_size: int
    ) -> None:
        self._spec = spec
        self._layers = layers
        self._layout = layout
        self._block_size = block_size
        self._num_blocks = layers[0].shape[_block_axes(layout)[0]]
        self._canonical = [_canonical(t, layout, _kv_pairs(spec)) for t in layers]
        self._stacked = _stack(self._canonical)

    @property
    def spec(self) -> KVSpec:
        """The model's KV geometry."""
        return self._spec

    @property
    def layout(self) -> PageLayout:
        """Per-layer page layout (see the module docstring)."""
        return self._layout

    @property
    def num_layers(self) -> int:
        return self._spec.num_layers

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        """Token slots per block."""
        return self._block_size

    @property
    def bytes_per_block(self) -> int:
        """KV bytes one block holds over all layers, K and V (padding excluded)."""
        return self._block_size * self._spec.bytes_per_token

    @property
    def dtype(self) -> torch.dtype:
        return self._layers[0].dtype

    @property
    def device(self) -> torch.device:
        return self._layers[0].device

    @property
    def stacked(self) -> torch.Tensor | None:
        """All layers as one canonical (L, K, N, S, H, D) view, or None when the
        layers do not share one evenly strided storage."""
        return self._stacked

    def layer(self, index: int) -> torch.Tensor:
        """Layer ``index`` in its own layout: what the attention kernel reads."""
        return self._layers[index]

    def canonical(self, index: int) -> torch.Tensor:
        """Layer ``index`` viewed as (K, N, S, H, D), K = 2 (1 for MLA); a view."""
        return self._canonical[index]

    def chunk_view(self, chunk: torch.Tensor) -> torch.Tensor:
        """View a chunk tensor of this spec (``spec.shape(T)``, this dtype, any device or
        strides) as (L, K, T, H, D), the chunk's side of the canonical view."""
        spec = self._spec
        shape = tuple(chunk.shape)
        num_tokens = shape[spec.token_axis] if len(shape) == len(spec.layout) else 0
        if num_tokens < 1 or shape != spec.shape(num_tokens) or chunk.dtype != self.dtype:
            raise ValueError(
                f"chunk is {chunk.dtype}{list(shape)}; these pages need "
                f"{self.dtype}{list(spec.shape(max(num_tokens, 1)))} ({spec.layout}, T >= 1)"
            )
        if spec.layout == "LKTHD":
            return chunk
        if spec.layout == "KLTHD":
            return chunk.transpose(0, 1)
        return chunk.unsqueeze(1).unsqueeze(-2)  # LTD: (L, T, D) -> (L, 1, T, 1, D)

    def check_run(self, block_ids: Sequence[int] | torch.Tensor, num_tokens: int) -> list[int]:
        """Validate the run of blocks holding ``num_tokens`` tokens: exactly
        ``ceil(num_tokens / block_size)`` ids in range. Returns them as ints (a CUDA
        tensor of ids costs a sync here; block tables are usually lists)."""
        raw = block_ids.tolist() if isinstance(block_ids, torch.Tensor) else block_ids
        ids = [operator.index(b) for b in raw]
        need = -(-num_tokens // self._block_size)
        if len(ids) != need:
            raise ValueError(
                f"{num_tokens} tokens fill {need} blocks of {self._block_size}, "
                f"but {len(ids)} block ids were given"
            )
        bad = [b for b in ids if not 0 <= b < self._num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:8]} are outside 0..{self._num_blocks - 1}")
        return ids

    def slot_mapping(
        self, block_ids: Sequence[int] | torch.Tensor, num_tokens: int
    ) -> torch.Tensor:
        """Slot of each of the first ``num_tokens`` tokens of a block table (int64, on
        the block ids' device): ``block_id * block_size + offset``."""
        ids = torch.as_tensor(block_ids, dtype=torch.int64)
        if num_tokens > ids.numel() * self._block_size:
            raise ValueError(f"{ids.numel()} blocks cannot hold {num_tokens} tokens")
        offsets = torch.arange(self._block_size, dtype=torch.int64, device=ids.device)
        return (ids[:, None] * self._block_size + offsets).flatten()[:num_tokens]

    def __repr__(self) -> str:
        return (
            f"PagedKVCache({self._spec}, num_blocks={self._num_blocks}, "
            f"block_size={self._block_size}, layout={self._layout}, device={self.device}, "
            f"stacked={self._stacked is not None})"
        )
