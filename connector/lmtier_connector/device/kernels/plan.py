"""The arguments of the fused copy kernels (``kv_copy.cu``), and their CPU reference.

A :class:`CopyPlan` describes one family of launches over a set of chunks: every
layer's page base address, one row per chunk (its address, token count, first block
id, layer and K/V strides), the flat block ids, and the byte strides shared by all of
them. :func:`plan_copy` builds it from the same views the torch path copies through
(:meth:`PagedKVCache.canonical` or :meth:`PagedKVCache.blocks` on the page side, the
chunk views on the other), so both paths move the same bytes by construction:

* token layouts: pages ``(K, N, S, H, D)``, chunk ``(L, K, T, H, D)``; a *row* is one
  head's ``D`` elements of one token;
* paged layouts: pages ``(N, X, Y, C)``, chunk ``(L, B, X, Y, C)`` (``X, Y`` = ``H, S``
  or ``S, H``); the block's ``X`` axis plays the slots, ``Y`` the heads, ``C`` the row.

Then rows merge while both sides keep them contiguous (all heads of a token, in NHD
pages; a whole block when every chunk fills its blocks: HND pages with ``LBHSC``), and
the widest vector (16, 8, 4, 2, 1 bytes) dividing every address and stride is chosen.

:func:`reference_copy` runs a plan on CPU tensors with numpy, unit by unit, with the
kernel's own index arithmetic (the flat index split into layer, pair, token, row,
unit); it checks that every address falls inside the tensors given and that no unit is
written twice. The tests compare it with the torch path bit for bit, and run the CUDA
source itself, compiled as C++, on the same plans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmtier_connector.device.paged_kv import PagedKVCache

__all__ = ["MAX_CHUNKS", "MAX_WORK", "WIDTHS", "CopyPlan", "plan_copy", "reference_copy"]

WIDTHS = (16, 8, 4, 2, 1)
"""Vector widths the kernels copy in, widest first (``uint4`` .. ``unsigned char``)."""
MAX_WORK = 2**31 - 1
"""The kernels index one chunk's work with 32-bit unsigned integers: plans stay below."""
MAX_CHUNKS = 65535
"""Chunks of one launch (the grid's y dimension)."""
_Array = np.ndarray[Any, np.dtype[Any]]
TABLE_ROW = 5  # address, tokens, first id, layer stride, pair stride: LMTIER_TABLE_ROW


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """One set of runs, ready for :mod:`kv_copy.cu` (every size and stride in bytes).

    ``tokens`` counts each chunk's positions along the (merged) token axis; ``slots``
    positions make one block (1 once whole blocks are rows).
    """

    layers: tuple[int, ...]  # page base address of each layer
    addresses: tuple[int, ...]  # chunk base address (its layer 0) of each chunk
    tokens: tuple[int, ...]
    starts: tuple[int, ...]  # index of each chunk's first block id in ``ids``
    chunk_layer: tuple[int, ...]
    chunk_pair: tuple[int, ...]
    ids: tuple[int, ...]
    pairs: int
    slots: int
    rows: int
    units: int
    width: int
    page_pair: int
    page_block: int
    page_slot: int
    page_row: int
    chunk_block: int
    chunk_slot: int
    chunk_row: int

    @property
    def num_chunks(self) -> int:
        return len(self.addresses)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def work(self, num_layers: int) -> int:
        """Units of the largest chunk for ``num_layers`` layers (one launch's x extent)."""
        return num_layers * self.pairs * max(self.tokens) * self.rows * self.units

    def words(self) -> list[int]:
        """``layers``, then the chunk table, then the ids: the int64 array the kernels
        read (one host-to-device copy); :meth:`offsets` says where each part starts."""
        table = [
            value
            for row in zip(
                self.addresses,
                self.tokens,
                self.starts,
                self.chunk_layer,
                self.chunk_pair,
                strict=True,
            )
            for value in row
        ]
        return [*self.layers, *table, *self.ids]

    def offsets(self) -> tuple[int, int]:
        """Where the chunk table and the ids start in :meth:`words`."""
        table = len(self.layers)
        return table, table + TABLE_ROW * self.num_chunks

    def scalars(self) -> tuple[int, ...]:
        """The kernels' arguments after ``layer0, num_layers``, in their order."""
        return (
            self.pairs,
            self.slots,
            self.rows,
            self.units,
            self.page_pair,
            self.page_block,
            self.page_slot,
            self.page_row,
            self.chunk_block,
            self.chunk_slot,
            self.chunk_row,
        )


def _refusal(
    views: Sequence[torch.Tensor], chunks: Sequence[torch.Tensor], shared: int
) -> str | None:
    """Why the kernels cannot copy between these layer views and chunks (whose strides
    from axis ``shared`` on must be the same for all), or None."""
    if not chunks or len(chunks) > MAX_CHUNKS:
        return f"{len(chunks)} chunks in one transfer (1 to {MAX_CHUNKS})"
    first = views[0]
    if any(v.shape != first.shape or v.stride() != first.stride() for v in views):
        return "the layers' page tensors differ in strides"
    if any(x.stride(-1) != 1 for x in (*chunks, first)):
        return "a row (the last axis) is strided"
    if any(x.stride()[shared:] != chunks[0].stride()[shared:] for x in chunks):
        return "the chunks' inner strides differ"
    return None


def plan_copy(
    pages: PagedKVCache,
    runs: Sequence[Sequence[int]],
    counts: Sequence[int],
    chunks: Sequence[torch.Tensor],
) -> CopyPlan | str:
    """The plan that copies the blocks ``runs[j]`` (checked ids) holding ``counts[j]``
    tokens to or from ``chunks[j]`` (:meth:`PagedKVCache.chunk_view` views), or why the
    kernels cannot: a string (then the torch path copies them)."""
    paged = pages.spec.paged
    views = [pages.blocks(i) if paged else pages.canonical(i) for i in range(pages.num_layers)]
    why = _refusal(views, chunks, 1 if paged else 2)
    if why is not None:
        return why
    page, chunk, size = views[0], chunks[0], pages.dtype.itemsize
    s = [stride * size for stride in page.stride()]
    c = [stride * size for stride in chunk.stride()]
    row_bytes, rows = page.shape[-1] * size, page.shape[-2]
    chunk_layer = [x.stride(0) * size for x in chunks]
    if paged:  # pages (N, X, Y, C), chunks (L, B, X, Y, C)
        pairs, slots = 1, page.shape[1]
        page_pair, page_block, page_slot, page_row = 0, s[0], s[1], s[2]
        chunk_pair, chunk_block, chunk_slot, chunk_row = [0] * len(chunks), c[1], c[2], c[3]
        tokens = [x.shape[1] * slots for x in chunks]
    else:  # pages (K, N, S, H, D), chunks (L, K, T, H, D)
        pairs, slots = page.shape[0], page.shape[2]
        page_pair, page_block, page_slot, page_row = s[0], s[1], s[2], s[3]
        chunk_pair = [x.stride(1) * size for x in chunks]
        chunk_block, chunk_slot, chunk_row = c[2] * slots, c[2], c[3]
        tokens = list(counts)
    if rows == 1 or (page_row == row_bytes and chunk_row == row_bytes):
        row_bytes, rows, page_row, chunk_row = row_bytes * rows, 1, 0, 0
    whole = all(t % slots == 0 for t in tokens)
    if rows == 1 and whole and (slots == 1 or (page_slot == chunk_slot == row_bytes)):
        row_bytes, tokens = row_bytes * slots, [t // slots for t in tokens]
        slots, page_slot, chunk_slot = 1, 0, 0
    if pairs == 1:
        page_pair, chunk_pair = 0, [0] * len(chunks)
    layers = tuple(view.data_ptr() for view in views)
    addresses = tuple(x.data_ptr() for x in chunks)
    strides = [page_pair, page_block, page_slot, page_row, chunk_block, chunk_slot, chunk_row]
    every = [row_bytes, *layers, *addresses, *strides, *chunk_layer, *chunk_pair]
    width = next(w for w in WIDTHS if all(value % w == 0 for value in every))
    ids = [b for run in runs for b in run]
    starts = [0, *np.cumsum([len(run) for run in runs[:-1]], dtype=np.int64).tolist()]
    plan = CopyPlan(
        layers=layers,
        addresses=addresses,
        tokens=tuple(tokens),
        starts=tuple(int(start) for start in starts),
        chunk_layer=tuple(chunk_layer),
        chunk_pair=tuple(chunk_pair),
        ids=tuple(ids),
        pairs=pairs,
        slots=slots,
        rows=rows,
        units=row_bytes // width,
        width=width,
        page_pair=page_pair,
        page_block=page_block,
        page_slot=page_slot,
        page_row=page_row,
        chunk_block=chunk_block,
        chunk_slot=chunk_slot,
        chunk_row=chunk_row,
    )
    if plan.work(pages.num_layers) > MAX_WORK:
        return f"a chunk of {plan.work(pages.num_layers)} copy units (at most {MAX_WORK})"
    return plan


# ---- the CPU reference ------------------------------------------------------------------


class _Memory:
    """CPU tensors' storages as byte arrays, found by address."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        spans: dict[int, _Array] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            raw = torch.empty(0, dtype=torch.uint8).set_(storage)  # the whole storage
            spans[storage.data_ptr()] = raw.numpy()
        self._bases = np.array(sorted(spans), dtype=np.int64)
        self._arrays = [spans[base] for base in sorted(spans)]

    def locate(self, addresses: _Array, width: int) -> tuple[_Array, _Array]:
        """(storage index, offset) of each address; AssertionError outside them."""
        which = np.searchsorted(self._bases, addresses, side="right") - 1
        assert (which >= 0).all(), "an address below every tensor"
        offsets = addresses - self._bases[which]
        ends = np.array([len(a) for a in self._arrays], dtype=np.int64)[which]
        assert (offsets + width <= ends).all(), "an address past the end of its tensor"
        return which, offsets

    def copy(self, dst: _Array, src: _Array, width: int) -> None:
        """Copy ``width`` bytes from each ``src`` address to the matching ``dst`` one."""
        dst_at, dst_off = self.locate(dst, width)
        src_at, src_off = self.locate(src, width)
        lane = np.arange(width, dtype=np.int64)
        for d in np.unique(dst_at):
            for s in np.unique(src_at):
                pick = (dst_at == d) & (src_at == s)
                if pick.any():
                    values = self._arrays[s][src_off[pick][:, None] + lane]
                    self._arrays[d][dst_off[pick][:, None] + lane] = values


def _addresses(plan: CopyPlan, chunk: int, layer0: int, num_layers: int) -> tuple[_Array, ...]:
    """(page, chunk) byte address of every unit of one chunk: the kernel's arithmetic."""
    tokens = plan.tokens[chunk]
    i = np.arange(num_layers * plan.pairs * tokens * plan.rows * plan.units, dtype=np.int64)
    u, rest = i % plan.units, i // plan.units
    h, rest = rest % plan.rows, rest // plan.rows
    t, rest = rest % tokens, rest // tokens
    k, l_ = rest % plan.pairs, rest // plan.pairs
    b, s = t // plan.slots, t % plan.slots
    layer = layer0 + l_
    ids = np.array(plan.ids, dtype=np.int64)[plan.starts[chunk] + b]
    page = (
        np.array(plan.layers, dtype=np.int64)[layer]
        + k * plan.page_pair
        + ids * plan.page_block
        + s * plan.page_slot
        + h * plan.page_row
        + u * plan.width
    )
    into = (
        plan.addresses[chunk]
        + layer * plan.chunk_layer[chunk]
        + k * plan.chunk_pair[chunk]
        + b * plan.chunk_block
        + s * plan.chunk_slot
        + h * plan.chunk_row
        + u * plan.width
    )
    return page, into


def reference_copy(
    plan: CopyPlan,
    tensors: Sequence[torch.Tensor],
    *,
    save: bool,
    layer0: int = 0,
    num_layers: int | None = None,
) -> None:
    """Run ``plan`` on the CPU for layers ``layer0 ..`` (all by default): save copies
    pages to chunks, load the reverse. ``tensors``: every CPU tensor the plan's
    addresses point into (pages and chunks)."""
    count = plan.num_layers - layer0 if num_layers is None else num_layers
    memory = _Memory(tensors)
    pages, chunks = [], []
    for chunk in range(plan.num_chunks):
        page, into = _addresses(plan, chunk, layer0, count)
        pages.append(page)
        chunks.append(into)
    src = np.concatenate(pages if save else chunks)
    dst = np.concatenate(chunks if save else pages)
    assert not (src % plan.width).any() and not (dst % plan.width).any(), "a misaligned unit"
    assert len(np.unique(dst)) == len(dst), "a unit is written twice"
    memory.copy(dst, src, plan.width)
