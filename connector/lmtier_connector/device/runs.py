"""Runs of blocks and the torch path's copies of them (the transfer engine's fallback
and its CPU path; :mod:`lmtier_connector.device.transfer` explains the formulation).

A :class:`Run` is the blocks of one chunk with their ids on the pages' device;
:func:`gather_run` / :func:`scatter_run` copy one run for one layer view or a stacked
view of all layers, and :func:`whole_copy` copies every layer of a run synchronously.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmtier_connector.device.page_copy import bit_view, read_blocks, split_tokens, write_blocks
from lmtier_connector.device.paged_kv import PagedKVCache

__all__ = [
    "BlockIds",
    "Run",
    "check_runs",
    "gather_run",
    "layer_view",
    "make_runs",
    "scatter_run",
    "whole_copy",
]

BlockIds = Sequence[int] | torch.Tensor
"""A run of block ids; Python ints preferred (a CUDA tensor costs a sync to validate)."""


@dataclass(frozen=True, slots=True)
class Run:
    """The blocks of one chunk: ids on the pages' device, and how the tokens fill them."""

    ids: torch.Tensor
    num_tokens: int
    num_full: int  # blocks that the chunk fills completely
    tail: int  # tokens in the last, partly filled block; 0 when there is none
    tail_block: int  # that block's id (meaningful only when tail > 0)
    first: int | None  # the first id when the ids are consecutive: a slice replaces indexing
    paged: bool  # a paged-layout chunk: the chunk view is already the blocks, no tail


def check_runs(
    pages: PagedKVCache, block_ids: Sequence[BlockIds], token_counts: Sequence[int], *, unique: bool
) -> list[list[int]]:
    """The runs as lists of checked ids (:meth:`PagedKVCache.check_run`)."""
    if len(block_ids) != len(token_counts):
        raise ValueError(f"{len(block_ids)} block id runs for {len(token_counts)} chunks")
    lists = [pages.check_run(ids, n) for ids, n in zip(block_ids, token_counts, strict=True)]
    flat_list = [b for ids in lists for b in ids]
    if unique and len(set(flat_list)) != len(flat_list):
        raise ValueError("a block id repeats: writing one block twice has no defined result")
    return lists


def make_runs(
    pages: PagedKVCache, lists: Sequence[list[int]], token_counts: Sequence[int]
) -> list[Run]:
    """Put the checked runs' ids on the pages' device in one copy.

    Called on the stream that will use the ids, so the copy is ordered before them.
    """
    flat = torch.tensor([b for ids in lists for b in ids], dtype=torch.int64)
    if pages.device.type == "cuda":
        # Pinned and non_blocking: a pageable copy would make the host wait on the stream.
        flat = flat.pin_memory().to(pages.device, non_blocking=True)
    else:
        flat = flat.to(pages.device)
    runs, start = [], 0
    for ids, n in zip(lists, token_counts, strict=True):
        full, tail = divmod(n, pages.block_size)
        consecutive = ids == list(range(ids[0], ids[0] + len(ids)))
        first, paged = (ids[0] if consecutive else None), pages.spec.paged
        runs.append(Run(flat[start : start + len(ids)], n, full, tail, ids[-1], first, paged))
        start += len(ids)
    return runs


def layer_view(pages: PagedKVCache, layer: int) -> torch.Tensor:
    """The pages' side of one layer: its block view for a paged spec, else canonical."""
    return pages.blocks(layer) if pages.spec.paged else pages.canonical(layer)


def chunk_blocks(chunk: torch.Tensor, run: Run, slots: int) -> torch.Tensor:
    """The run's full blocks on the chunk side: a paged chunk itself, else its first
    ``F * S`` tokens split into (F, S)."""
    if run.paged:
        return chunk
    return split_tokens(chunk[..., : run.num_full * slots, :, :], run.num_full, slots)


def gather_run(pages: torch.Tensor, run: Run, out: torch.Tensor, non_blocking: bool) -> None:
    """Pages (..., K, N, S, H, D) -> chunk (..., K, T, H, D); paged: the block views
    (..., N, X, Y, C) -> chunk (..., B, X, Y, C)."""
    src, dst = bit_view(pages), bit_view(out)
    if dst.device != src.device:
        picked = src.index_select(-4, run.ids)  # contiguous, on the device
        if not run.paged:
            picked = picked.flatten(-4, -3)[..., : run.num_tokens, :, :]
        dst.copy_(picked, non_blocking=non_blocking)
        return
    slots = src.shape[-3]
    if run.num_full:
        read_blocks(src, run.ids[: run.num_full], run.first, chunk_blocks(dst, run, slots))
    if run.tail:
        full = run.num_full * slots
        dst[..., full:, :, :].copy_(src.select(-4, run.tail_block)[..., : run.tail, :, :])


def scatter_run(chunk: torch.Tensor, pages: torch.Tensor, run: Run, non_blocking: bool) -> None:
    """Chunk (..., K, T, H, D) -> pages (..., K, N, S, H, D); paged: chunk (..., B, X, Y,
    C) -> the block views (..., N, X, Y, C)."""
    dst = bit_view(pages)
    src = bit_view(chunk).to(dst.device, non_blocking=non_blocking)  # no-op on one device
    slots = dst.shape[-3]
    if run.num_full:
        write_blocks(dst, run.ids[: run.num_full], run.first, chunk_blocks(src, run, slots))
    if run.tail:
        full = run.num_full * slots
        dst.select(-4, run.tail_block)[..., : run.tail, :, :].copy_(src[..., full:, :, :])


def whole_copy(pages: PagedKVCache, run: Run, chunk: torch.Tensor, *, save: bool) -> None:
    """Every layer of one chunk, synchronously: one op for all when the pages are stacked.

    A token-layout scatter into stacked pages goes K and V separately: torch's strided
    copy is ~1.8x faster on the two halves than on the whole (measured on vLLM's page
    layout, where heads come before tokens); gathers gain nothing from the split, nor
    do paged chunks, whose blocks are copied as they are stored.
    """
    stacked = pages.stacked_blocks if run.paged else pages.stacked
    if stacked is not None and not save and not run.paged:
        pairs = [(stacked[:, k], chunk[:, k]) for k in range(chunk.shape[1])]
    elif stacked is not None:
        pairs = [(stacked, chunk)]
    else:
        pairs = [(layer_view(pages, layer), chunk[layer]) for layer in range(pages.num_layers)]
    for page_view, chunk_view in pairs:
        if save:
            gather_run(page_view, run, chunk_view, non_blocking=False)
        else:
            scatter_run(chunk_view, page_view, run, non_blocking=False)
