"""Whole-block copies between paged KV and chunk buffers, for every chunk layout.

The transfer engine (:mod:`lmtier_connector.device.transfer`) sees both sides of a
copy as blocks: pages as ``(..., N, X, Y, Z)`` (N blocks, with an optional leading
layer/K axis), the chunk's full blocks as ``(..., F, X, Y, Z)``. For a token-layout
chunk the canonical views are ``(..., K, N, S, H, D)`` and ``(..., K, T, H, D)``
split into blocks (:func:`split_tokens`); for a paged chunk (``LBHSC``, ``LBSHC``) the
pages' block views and the chunk itself, which hold the same blocks in the same order.
Two primitives move the F blocks of a run: :func:`read_blocks` (gather) and
:func:`write_blocks` (scatter), each one op for all layers of a stacked view, and a
slice copy when the run's ids are consecutive.

**Why they look the way they do** (single-threaded CPU here, 128 MiB of fp16 KV in
64 KiB blocks per layer, against a memcpy of the same bytes from written memory):

* Flat views: a block whose bytes are contiguous in both views is one row of
  :func:`as_3d`'s ``(P, N, X*Y*Z)``, so rows are copied, not 256-byte pieces.
* Gathers index the block axis as the leading axis (a transposed view when the
  stacked pages are not contiguous): torch's CPU ``index_select`` along an inner axis
  of a non-contiguous tensor runs at ~0.1 GB/s, along the leading axis it copies each
  selected slice with a strided copy (0.8-0.9x a memcpy). ``numpy.take`` is no
  better there (~0.3 GB/s).
* Scatters on CPU assign through numpy's advanced indexing, which copies each
  block's contiguous runs in one C loop: ~1.0x a memcpy, where torch's CPU ``index_copy_``
  and ``index_put_`` move one element at a time (0.36x on 2-byte elements) and one
  slice copy per block costs ~3 us each (0.75x). On other devices ``index_copy_`` is
  one kernel.
* Every copy acts on same-width integer views (:func:`bit_view`), so every dtype
  moves bit-exactly, float8 included (and numpy knows every integer width).
"""

from __future__ import annotations

import itertools
import math

import torch

__all__ = [
    "as_3d",
    "bit_view",
    "index_copy_blocks",
    "read_blocks",
    "split_tokens",
    "write_blocks",
]

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
    """(..., N, X, Y, Z) as (P, N, X*Y*Z) when that is a view, else None: each block of
    each of the P leading slices is then one row of contiguous bytes."""
    rank = blocks.dim()
    if not (_joinable(blocks, 0, rank - 4) and _joinable(blocks, rank - 3, rank)):
        return None
    return blocks.view(-1, blocks.shape[-4], math.prod(blocks.shape[-3:]))


def read_blocks(
    pages: torch.Tensor, ids: torch.Tensor, first: int | None, blocks: torch.Tensor
) -> None:
    """``blocks`` (..., F, X, Y, Z) <- the blocks ``ids`` (F of them, on the pages'
    device; ``first`` is the first when they are consecutive, else None) of ``pages``
    (..., N, X, Y, Z); one op."""
    if first is not None:
        blocks.copy_(pages.narrow(-4, first, blocks.shape[-4]))
        return
    pages_3d, blocks_3d = as_3d(pages), as_3d(blocks)
    if pages_3d is None or blocks_3d is None:
        torch.index_select(pages.movedim(-4, 0), 0, ids, out=blocks.movedim(-4, 0))
    elif pages_3d.shape[0] == 1:
        torch.index_select(pages_3d[0], 0, ids, out=blocks_3d[0])
    elif pages_3d.is_contiguous():
        torch.index_select(pages_3d, 1, ids, out=blocks_3d)
    else:
        torch.index_select(pages_3d.transpose(0, 1), 0, ids, out=blocks_3d.transpose(0, 1))


def write_blocks(
    pages: torch.Tensor, ids: torch.Tensor, first: int | None, blocks: torch.Tensor
) -> None:
    """The blocks ``ids`` (distinct; ``first`` as for :func:`read_blocks`) of ``pages``
    (..., N, X, Y, Z) <- ``blocks`` (..., F, X, Y, Z); one op (module docstring)."""
    if first is not None:
        pages.narrow(-4, first, blocks.shape[-4]).copy_(blocks)
    elif pages.device.type == "cpu":
        index = (Ellipsis, ids.numpy(), slice(None), slice(None), slice(None))
        pages.numpy()[index] = blocks.numpy()  # numpy views of the same memory
    else:
        index_copy_blocks(pages, ids, blocks)


def index_copy_blocks(pages: torch.Tensor, ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """:func:`write_blocks` with ``index_copy_``, on any device: one kernel on CUDA."""
    pages_3d, blocks_3d = as_3d(pages), as_3d(blocks)
    if pages_3d is not None and blocks_3d is not None:
        pages_3d.index_copy_(1, ids, blocks_3d)
    else:
        pages.index_copy_(-4, ids, blocks)
