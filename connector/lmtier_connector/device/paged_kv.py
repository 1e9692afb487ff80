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
engine moves token-layout chunks (every layout but the paged ones, viewed as
``(L, K, T, H, D)`` by :func:`lmtier.kv_spec.layer_major`) through this view, so one
gather/scatter formulation serves every page layout. When all layers are equally
spaced views of one storage (our own allocation; vLLM's layer-compact and
block-outermost layouts), :attr:`PagedKVCache.stacked` is the same view with a leading
layer axis, built with ``as_strided``, and whole-model transfers use it.
:mod:`lmtier_connector.device.page_copy` holds the other views the transfer engine
takes (all views, never copies) and its block copies.

**Block views, for paged chunks.** A spec in a paged chunk layout (``LBHSC``,
``LBSHC``: :attr:`KVSpec.paged`) stores whole blocks in the page's own order, so it
needs ``NHSC`` pages of its ``block_size`` (else a ``ValueError`` that says what to
configure; :func:`paged_chunk_layout` names the layout that matches a page tensor).
:meth:`PagedKVCache.blocks` views each layer as ``(N, H, S, C)`` or ``(N, S, H, C)``, the
chunk's block order, and a save or a load is a copy of whole blocks between that view
and the chunk's ``(L, B, ..., C)``: row copies of each block's bytes where the page
stores them in the chunk's order (vLLM's LBHNC/BLHNC with ``LBHSC``, LBNHC/BLNHC with
``LBSHC``), a strided copy otherwise.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import Literal, get_args

import torch

from lmtier.chunks.keys import BLOCK_SIZE
from lmtier.kv_spec import KVSpec, layer_major, torch_dtype

__all__ = ["PAGE_LAYOUTS", "PageLayout", "PagedKVCache", "paged_chunk_layout"]

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
    return 1 if spec.latent else 2


def _block_axes(layout: PageLayout) -> tuple[int, int]:
    """(block axis, slot axis) of a per-layer tensor in ``layout``."""
    return {"KNSHD": (1, 2), "NKSHD": (0, 2), "NHSC": (0, 2), "NSD": (0, 1)}[layout]


def _allowed(layout: PageLayout, spec: KVSpec) -> bool:
    # MLA has no K/V pair, so the 5-D layouts cannot hold it; "NSD" has no head axis.
    if spec.latent:
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


_BLOCK_ORDER = {"LBHSC": (0, 1, 2, 3), "LBSHC": (0, 2, 1, 3)}
"""How a paged chunk layout orders an NHSC layer (N, H, S, C): its block view's axes."""


def paged_chunk_layout(layer: torch.Tensor) -> str:
    """The paged chunk layout whose blocks are stored like those of ``layer``, one
    ``NHSC`` per-layer tensor (N, H, S, C): ``"LBHSC"`` when its heads come before its
    slots in memory (vLLM's HND orders: LBHNC, BLHNC, LHBNC, BHLNC), ``"LBSHC"`` when
    its slots come first (NHD: LBNHC, BLNHC). With it a save or a load of a block is a
    row copy; with the other one, a strided copy."""
    if layer.dim() != 4:
        raise ValueError(f"an NHSC layer is (N, H, S, C), got shape {tuple(layer.shape)}")
    return "LBHSC" if layer.stride(1) >= layer.stride(2) else "LBSHC"


def _check_paged(spec: KVSpec, layout: PageLayout, block_size: int) -> None:
    """A paged-layout spec moves whole blocks of NHSC pages of its own block size."""
    if layout != "NHSC":
        raise ValueError(
            f"{spec.layout} chunks are whole blocks of NHSC pages (vLLM >= 0.33's [B, H, N, C] "
            f"views); these pages are {layout}: configure the chunk layout LKTHD "
            "(KVSpec(layout='LKTHD', block_size=0)) for them"
        )
    if spec.block_size != block_size:
        raise ValueError(
            f"the pages hold blocks of {block_size} slots, the spec says block_size="
            f"{spec.block_size}: configure KVSpec(block_size={block_size}) (the engine's page "
            "block size) for this cache"
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


class PagedKVCache:
    """Per-layer paged K/V on the model's device, allocated once, viewed canonically.

    ``PagedKVCache(spec, num_blocks, block_size, device)`` allocates and zeroes one
    tensor for all layers (see the module docstring for its layout; for a paged spec,
    NHSC pages stored in the chunk's block order, of ``spec.block_size`` slots when
    ``block_size`` is None, as it is by default: :data:`BLOCK_SIZE` otherwise); wrap
    an engine's existing tensors with :meth:`from_tensors`. Blocks are numbered ``0 ..
    num_blocks - 1``; which blocks a request owns is the block manager's business.
    """

    __slots__ = (
        "_block_size",
        "_blocks",
        "_canonical",
        "_layers",
        "_layout",
        "_num_blocks",
        "_spec",
        "_stacked",
        "_stacked_blocks",
    )

    def __init__(
        self,
        spec: KVSpec,
        num_blocks: int,
        block_size: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if block_size is None:
            block_size = spec.block_size or BLOCK_SIZE
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}"
            )
        dtype = torch_dtype(spec.dtype)
        layout: PageLayout = "NSD" if spec.latent else "KNSHD"
        if spec.paged:  # NHSC pages whose blocks are stored in the chunk's block order
            layout, order = "NHSC", _BLOCK_ORDER[spec.layout]
            logical = _expected_shape(layout, spec, num_blocks, block_size)
            stored = torch.zeros(
                (spec.num_layers, *(logical[a] for a in order)), dtype=dtype, device=device
            )
            whole = stored.permute(0, *(1 + order.index(a) for a in range(4)))
        else:
            shape = (spec.num_layers, *_expected_shape(layout, spec, num_blocks, block_size))
            # zeros, not empty: the first touch of every page happens now, not mid-request.
            whole = torch.zeros(shape, dtype=dtype, device=device)
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
        for layouts this module does not support, mixed shapes, dtypes or devices, and
        for a paged spec unless the pages are NHSC of ``spec.block_size`` slots.
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
        if spec.paged:
            _check_paged(spec, layout, block_size)
        self._spec = spec
        self._layers = layers
        self._layout = layout
        self._block_size = block_size
        self._num_blocks = layers[0].shape[_block_axes(layout)[0]]
        self._canonical = [_canonical(t, layout, _kv_pairs(spec)) for t in layers]
        self._stacked = _stack(self._canonical)
        order = _BLOCK_ORDER.get(spec.layout)
        self._blocks = [t.permute(order) for t in layers] if order else []
        self._stacked_blocks = _stack(self._blocks) if order else None

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

    @property
    def stacked_blocks(self) -> torch.Tensor | None:
        """For a paged spec, all layers' :meth:`blocks` as one (L, N, ..., C) view, or
        None (also when the layers do not share one evenly strided storage)."""
        return self._stacked_blocks

    def blocks(self, index: int) -> torch.Tensor:
        """Layer ``index`` in a paged spec's block order, ``(N, H, S, C)`` for ``LBHSC``
        or ``(N, S, H, C)`` for ``LBSHC`` (a view): what the chunk's ``(L, B, ..., C)``
        holds per layer, block for block. ValueError for a spec of a token layout."""
        if not self._blocks:
            raise ValueError(f"block views are for paged chunk layouts, not {self._spec.layout}")
        return self._blocks[index]

    def layer(self, index: int) -> torch.Tensor:
        """Layer ``index`` in its own layout: what the attention kernel reads."""
        return self._layers[index]

    def canonical(self, index: int) -> torch.Tensor:
        """Layer ``index`` viewed as (K, N, S, H, D), K = 2 (1 for MLA); a view."""
        return self._canonical[index]

    def chunk_view(self, chunk: torch.Tensor) -> torch.Tensor:
        """View a chunk tensor of this spec (``spec.shape(T)``, this dtype, any device or
        strides) as (L, K, T, H, D), the chunk's side of the canonical view; a paged
        chunk as itself, (L, B, ..., C), the side of :meth:`blocks`."""
        spec = self._spec
        shape = tuple(chunk.shape)
        num_tokens = spec.tokens_of(shape) or 0
        if num_tokens < 1 or chunk.dtype != self.dtype:
            count = shape[spec.token_axis] if len(shape) == len(spec.layout) else 1
            example = spec.shape(max(count, 1) * (spec.block_size if spec.paged else 1))
            raise ValueError(
                f"chunk is {chunk.dtype}{list(shape)}; these pages need {self.dtype}"
                f"{list(example)} ({spec.layout}, axis {spec.token_axis} >= 1)"
            )
        return chunk if spec.paged else layer_major(chunk, spec.layout)

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
