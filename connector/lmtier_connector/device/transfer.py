"""The transfer engine: moves KV between device pages and chunk buffers.

A chunk is the KV of up to ``chunk_size`` consecutive tokens of one request, for every
layer, in the spec's layout (``LKTHD``: ``(L, 2, T, H, D)``; a paged layout, ``LBHSC``
``(L, B, H, S, C)`` or ``LBSHC`` ``(L, B, S, H, C)``: whole blocks); it usually lives in
the payload region of a host pool slab. Its tokens sit in a *run* of blocks, the slice
of the request's block table that covers them: ``ceil(T / block_size)`` blocks, the last
one partly filled when ``T`` is not a multiple of the block size (never, for a paged
layout).

**Two copy paths** (:class:`TransferEngine` chooses, once):

* *The fused kernels* (CUDA, with cupy: :mod:`lmtier_connector.device.kernels`): one
  launch moves every chunk of a transfer for a range of layers, walking each layer's
  pages from a table of base addresses and reading or writing the pinned host chunks in
  place over the bus, in 16-byte vectors where the rows allow: a load launches once per
  layer, a whole-model save (``save_all``) once. A transfer they cannot address (a
  strided row, layers of different strides) takes the torch path.
* *The torch path* (every device). Token-layout chunks: pages are seen canonically as
  ``(..., K, N, S, H, D)`` (:mod:`lmtier_connector.device.paged_kv`), the chunk as
  ``(..., K, T, H, D)``, an optional leading layer axis; splitting the chunk's token
  axis into ``(blocks, S)`` is a view. Paged chunks: pages are seen through their block
  views ``(..., N, H, S, C)`` (or ``(..., N, S, H, C)``), the chunk as itself. Then
  gather = ``index_select`` along the block axis into the chunk viewed as blocks,
  scatter = ``index_copy_`` (on CPU, where torch's ``index_copy_`` moves one element at
  a time, an assignment through numpy's advanced indexing:
  :mod:`lmtier_connector.device.page_copy`); one op for all layers and the full blocks
  when the layers share a storage, a slice copy when the ids are consecutive, plus, for
  a token layout, one copy of the first ``T mod S`` slots of a partly filled last
  block, whose other slots are never touched. On CUDA, gather picks the blocks on the
  device and crosses the bus once per chunk and layer; scatter crosses it once.

Both copy same-width integers, so every dtype moves bit-exactly, float8 included.

**Streams and events (CUDA; CPU runs the same calls synchronously).** A
:class:`TransferEngine` owns two side streams. ``start_load`` enqueues, layer by
layer on the load stream, the layer's copies (a kernel launch, or one host-to-device
copy per chunk from pinned slabs, ``non_blocking``, and the block scatter), then
records one event per layer; ``LoadHandle.wait_layer(i)`` makes the *current* stream
wait on event ``i``, so layer ``i`` computes as soon as its KV has landed while the
load of layer ``i + 1`` goes on::

    load    |H2D+scatter L0|e0|H2D+scatter L1|e1|H2D+scatter L2|e2|
    compute          wait e0 ->|  layer 0  |wait e1 ->| layer 1 |wait e2 ->| layer 2 |
    save                        c0 ->|gather+D2H L0|  c1 ->|gather+D2H L1|  ...

Saves run the other way: ``save_layer(i)`` makes the save stream wait for what the
current stream has enqueued so far (``c_i``: layer ``i``'s KV is written), then
gathers the blocks on the save stream and copies them into pinned slabs with
``non_blocking``. **Saves never block compute**: the compute stream never waits on
the save stream, the host returns as soon as the copies are enqueued, and only
``SaveHandle.wait()`` (the connector calls it off the forward path, or polls
``done()``) blocks the host. The price is a rule for the caller: the pages being saved
must not be rewritten, and the slabs must not be reused, until the handle is done
(vLLM holds the blocks of a request whose save is in flight).

Host buffers on the CUDA path must be pinned (pageable copies would make the host wait)
and layer-major (``LKTHD``, ``LTD``, ``LBHSC``, ``LBSHC``: one contiguous copy per chunk
and layer);
anything else is a ``ValueError``, and :func:`gather` / :func:`scatter` remain for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lmtier import SlabHandle
from lmtier.chunks.format import ChunkMeta, DecodedChunk
from lmtier.kv_spec import chunk_tensor, payload_tensor, seal_slab
from lmtier_connector.device.kernels.cuda import Launches, launches_for, use_kernels
from lmtier_connector.device.page_copy import bit_view, read_blocks, split_tokens, write_blocks
from lmtier_connector.device.paged_kv import PagedKVCache

__all__ = [
    "BlockIds",
    "ChunkSource",
    "LoadHandle",
    "SaveHandle",
    "TransferEngine",
    "gather",
    "load_chunk_from_slab",
    "save_chunk_into_slab",
    "scatter",
]

BlockIds = Sequence[int] | torch.Tensor
"""A run of block ids; Python ints preferred (a CUDA tensor costs a sync to validate)."""
ChunkSource = torch.Tensor | DecodedChunk


@dataclass(frozen=True, slots=True)
class _Run:
    """The blocks of one chunk: ids on the pages' device, and how the tokens fill them."""

    ids: torch.Tensor
    num_tokens: int
    num_full: int  # blocks that the chunk fills completely
    tail: int  # tokens in the last, partly filled block; 0 when there is none
    tail_block: int  # that block's id (meaningful only when tail > 0)
    first: int | None  # the first id when the ids are consecutive: a slice replaces indexing
    paged: bool  # a paged-layout chunk: the chunk view is already the blocks, no tail


def _check_runs(
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


def _make_runs(
    pages: PagedKVCache, lists: Sequence[list[int]], token_counts: Sequence[int]
) -> list[_Run]:
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
        runs.append(_Run(flat[start : start + len(ids)], n, full, tail, ids[-1], first, paged))
        start += len(ids)
    return runs


def _as_tensor(chunk: ChunkSource) -> torch.Tensor:
    return chunk_tensor(chunk) if isinstance(chunk, DecodedChunk) else chunk


def _views(
    pages: PagedKVCache, chunks: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[int]]:
    """The chunks' views on the chunk side (:meth:`PagedKVCache.chunk_view`, which checks
    them), and how many tokens each holds."""
    views = [pages.chunk_view(chunk) for chunk in chunks]
    return views, [pages.spec.tokens_of(chunk.shape) or 0 for chunk in chunks]


def _layer(pages: PagedKVCache, layer: int) -> torch.Tensor:
    """The pages' side of one layer: its block view for a paged spec, else canonical."""
    return pages.blocks(layer) if pages.spec.paged else pages.canonical(layer)


def _chunk_blocks(chunk: torch.Tensor, run: _Run, slots: int) -> torch.Tensor:
    """The run's full blocks on the chunk side: a paged chunk itself, else its first
    ``F * S`` tokens split into (F, S)."""
    if run.paged:
        return chunk
    return split_tokens(chunk[..., : run.num_full * slots, :, :], run.num_full, slots)


def _gather_run(pages: torch.Tensor, run: _Run, out: torch.Tensor, non_blocking: bool) -> None:
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
        read_blocks(src, run.ids[: run.num_full], run.first, _chunk_blocks(dst, run, slots))
    if run.tail:
        full = run.num_full * slots
        dst[..., full:, :, :].copy_(src.select(-4, run.tail_block)[..., : run.tail, :, :])


def _scatter_run(chunk: torch.Tensor, pages: torch.Tensor, run: _Run, non_blocking: bool) -> None:
    """Chunk (..., K, T, H, D) -> pages (..., K, N, S, H, D); paged: chunk (..., B, X, Y,
    C) -> the block views (..., N, X, Y, C)."""
    dst = bit_view(pages)
    src = bit_view(chunk).to(dst.device, non_blocking=non_blocking)  # no-op on one device
    slots = dst.shape[-3]
    if run.num_full:
        write_blocks(dst, run.ids[: run.num_full], run.first, _chunk_blocks(src, run, slots))
    if run.tail:
        full = run.num_full * slots
        dst.select(-4, run.tail_block)[..., : run.tail, :, :].copy_(src[..., full:, :, :])


def _whole(pages: PagedKVCache, run: _Run, chunk: torch.Tensor, *, save: bool) -> None:
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
        pairs = [(_layer(pages, layer), chunk[layer]) for layer in range(pages.num_layers)]
    for page_view, chunk_view in pairs:
        if save:
            _gather_run(page_view, run, chunk_view, non_blocking=False)
        else:
            _scatter_run(chunk_view, page_view, run, non_blocking=False)


def _record(stream: torch.cuda.Stream, timing: bool) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]
    event.record(stream)
    return event


def gather(pages: PagedKVCache, block_ids: BlockIds, out: torch.Tensor) -> None:
    """Copy the KV of a run of blocks into ``out`` (shape ``spec.shape(T)``, any device).

    ``block_ids`` holds ``ceil(T / block_size)`` ids in token order; only the first
    ``T`` slots are read. Synchronous: ``out`` is complete on return.
    """
    (chunk,), counts = _views(pages, [out])
    (run,) = _make_runs(pages, _check_runs(pages, [block_ids], counts, unique=False), counts)
    _whole(pages, run, chunk, save=True)


def scatter(chunk: torch.Tensor, pages: PagedKVCache, block_ids: BlockIds) -> None:
    """Copy a chunk into a run of distinct blocks (the inverse of :func:`gather`).

    Slots past ``T`` in a partly filled last block keep their contents. Synchronous.
    """
    (view,), counts = _views(pages, [chunk])
    (run,) = _make_runs(pages, _check_runs(pages, [block_ids], counts, unique=True), counts)
    _whole(pages, run, view, save=False)


def save_chunk_into_slab(
    pages: PagedKVCache, block_ids: BlockIds, handle: SlabHandle, meta: ChunkMeta
) -> int:
    """Gather a run of blocks straight into a slab and encode it there, like
    ``encode_kv_into``: one copy of the payload, one checksum pass. Returns the length."""
    gather(pages, block_ids, payload_tensor(handle, meta))
    return seal_slab(handle, meta)


def load_chunk_from_slab(chunk: ChunkSource, pages: PagedKVCache, block_ids: BlockIds) -> None:
    """Scatter a decoded chunk (or a chunk tensor) into a run of blocks."""
    scatter(_as_tensor(chunk), pages, block_ids)


@dataclass(frozen=True, slots=True, eq=False)
class LoadHandle:
    """The layers of one :meth:`TransferEngine.start_load`.

    On CUDA, ``events`` holds one event per layer and ``keep`` the source tensors, which
    must outlive the copies; on CPU the load finished before the handle was made,
    ``events`` is empty and waiting is a no-op. Reuse the source slabs once done.
    """

    num_layers: int
    device: torch.device
    events: tuple[torch.cuda.Event, ...] = ()
    keep: object = field(default=None, repr=False)

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait until layer ``layer`` has landed (any order)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside 0..{self.num_layers - 1}")
        if self.events:  # CUDA path
            torch.cuda.current_stream(self.device).wait_event(self.events[layer])

    def wait(self) -> None:
        """Make the current stream wait for every layer (the load stream is in order)."""
        self.wait_layer(self.num_layers - 1)

    def done(self) -> bool:
        """Whether every layer has landed; never blocks."""
        return not self.events or bool(self.events[-1].query())  # type: ignore[no-untyped-call]

    def synchronize(self) -> None:
        """Block the host until every layer has landed."""
        if self.events:
            self.events[-1].synchronize()


class SaveHandle:
    """The save of a set of runs into chunk tensors, enqueued layer by layer.

    Made by :meth:`TransferEngine.begin_save`. Holds the destinations until done;
    seal slabs (:func:`seal_slab`) only after :meth:`wait` or once :meth:`done`.
    """

    __slots__ = ("_last_event", "_outs", "_pages", "_runs", "_saved", "_stream", "_timing")

    def __init__(
        self,
        pages: PagedKVCache,
        runs: list[_Run] | Launches,
        outs: list[torch.Tensor],
        stream: torch.cuda.Stream | None,
        timing: bool,
    ) -> None:
        self._pages = pages
        self._runs = runs  # Launches: the fused kernels copy (CUDA only)
        self._outs = outs
        self._stream = stream
        self._timing = timing
        self._saved = [False] * pages.num_layers
        self._last_event: torch.cuda.Event | None = None

    @property
    def pending_layers(self) -> list[int]:
        """Layers not enqueued yet."""
        return [layer for layer, saved in enumerate(self._saved) if not saved]

    def save_layer(self, layer: int) -> None:
        """Enqueue layer ``layer`` once what the current stream has enqueued so far (its
        KV) is done: call it right after the layer's attention. Returns at once on CUDA."""
        if not 0 <= layer < len(self._saved) or self._saved[layer]:
            raise ValueError(f"layer {layer} is outside 0..{len(self._saved) - 1} or was saved")
        self._save(layer, 1)

    def _save(self, layer0: int, count: int) -> None:
        """Enqueue layers ``layer0 .. layer0 + count - 1`` (checked: not saved yet)."""
        self._saved[layer0 : layer0 + count] = [True] * count
        pages, stream, runs = self._pages, self._stream, self._runs
        layers = range(layer0, layer0 + count)
        if stream is None:  # CPU: runs, never launches
            for layer in layers:
                for run, out in zip(runs, self._outs, strict=True):  # type: ignore[arg-type]
                    _gather_run(_layer(pages, layer), run, out[layer], non_blocking=False)
            return
        # CUDA path: the save stream waits for the layers' KV, then gathers + copies D2H
        # (the kernels: in one launch, writing the pinned chunks in place).
        stream.wait_stream(torch.cuda.current_stream(pages.device))
        with torch.cuda.stream(stream):
            if isinstance(runs, list):
                for layer in layers:
                    for run, out in zip(runs, self._outs, strict=True):
                        _gather_run(_layer(pages, layer), run, out[layer], non_blocking=True)
            else:
                runs.launch(save=True, layer0=layer0, num_layers=count, stream=stream)
            self._last_event = _record(stream, self._timing)

    def save_all(self) -> None:
        """Enqueue every pending layer; when none was yet, as whole-model gathers on CPU
        (where it can) and as one launch of the kernels."""
        runs, count = self._runs, len(self._saved)
        if not any(self._saved) and self._stream is None and isinstance(runs, list):
            for run, out in zip(runs, self._outs, strict=True):
                _whole(self._pages, run, out, save=True)
            self._saved = [True] * count
        elif not any(self._saved) and not isinstance(runs, list):
            self._save(0, count)
        else:
            for layer in self.pending_layers:
                self.save_layer(layer)

    def done(self) -> bool:
        """Whether every layer was enqueued and has reached its destination; never blocks."""
        if not all(self._saved):
            return False
        event = self._last_event
        return event is None or bool(event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        """Block the host until every layer's save finished."""
        if not all(self._saved):
            raise RuntimeError(
                f"waiting on a save whose layers {self.pending_layers} were never enqueued"
            )
        if self._last_event is not None:
            self._last_event.synchronize()


class TransferEngine:
    """Loads and saves chunks for one :class:`PagedKVCache`: asynchronous on CUDA, on
    dedicated load and save streams; synchronous on CPU. ``timing=True`` makes the
    CUDA events timing events (for benchmarks).

    ``kernels``: copy with the fused CUDA kernels (:mod:`lmtier_connector.device.kernels`)
    where they run: None (the default) uses them when cupy and a CUDA device are there
    and the torch path otherwise (logged once); True requires them (``RuntimeError``
    saying why not); False never uses them. A transfer the kernels cannot address (a
    strided row, layers of different strides) goes the torch path. ``staged_loads``:
    the kernels' loads copy each layer into a device buffer first (:func:`launches_for`).
    """

    __slots__ = ("_kernels", "_load_stream", "_pages", "_save_stream", "_staged", "_timing")

    def __init__(
        self,
        pages: PagedKVCache,
        *,
        timing: bool = False,
        kernels: bool | None = None,
        staged_loads: bool = False,
    ) -> None:
        self._pages = pages
        self._timing = timing
        self._staged = staged_loads
        self._load_stream: torch.cuda.Stream | None = None
        self._save_stream: torch.cuda.Stream | None = None
        self._kernels = use_kernels(pages.device, kernels)
        if pages.device.type == "cuda":  # CUDA path
            self._load_stream = torch.cuda.Stream(pages.device)  # type: ignore[no-untyped-call]
            self._save_stream = torch.cuda.Stream(pages.device)  # type: ignore[no-untyped-call]

    @property
    def pages(self) -> PagedKVCache:
        return self._pages

    @property
    def kernels(self) -> bool:
        """Whether the fused CUDA kernels copy (else the torch path does)."""
        return self._kernels

    def _plan(
        self, lists: list[list[int]], counts: list[int], views: list[torch.Tensor], load: bool
    ) -> Launches | None:
        """The kernels' launches for these runs (made on the stream that launches them),
        or None: the torch path copies."""
        if not self._kernels:
            return None
        return launches_for(self._pages, lists, counts, views, staged=load and self._staged)

    def start_load(
        self, chunks: Sequence[ChunkSource], block_ids: Sequence[BlockIds]
    ) -> LoadHandle:
        """Start loading ``chunks[j]`` into the blocks ``block_ids[j]`` (distinct over all j)."""
        pages, stream = self._pages, self._load_stream
        views, counts = _views(pages, [_as_tensor(chunk) for chunk in chunks])
        lists = _check_runs(pages, block_ids, counts, unique=True)
        if stream is None:
            for view, run in zip(views, _make_runs(pages, lists, counts), strict=True):
                _whole(pages, run, view, save=False)
            return LoadHandle(pages.num_layers, pages.device)
        # CUDA path: per layer, the kernels' launch (reading the pinned chunks in place),
        # or one H2D copy per chunk and its scatter; then one event.
        self._check_host_buffers(views)
        stream.wait_stream(torch.cuda.current_stream(pages.device))  # the blocks may be in use
        events = []
        with torch.cuda.stream(stream):
            launches = self._plan(lists, counts, views, load=True)
            runs = _make_runs(pages, lists, counts) if launches is None else []
            for layer in range(pages.num_layers):
                if launches is not None:
                    launches.launch(save=False, layer0=layer, num_layers=1, stream=stream)
                else:
                    for view, run in zip(views, runs, strict=True):
                        _scatter_run(view[layer], _layer(pages, layer), run, non_blocking=True)
                events.append(_record(stream, self._timing))
        keep = (views, launches or runs)
        return LoadHandle(pages.num_layers, pages.device, tuple(events), keep=keep)

    def begin_save(self, block_ids: Sequence[BlockIds], outs: Sequence[torch.Tensor]) -> SaveHandle:
        """Prepare saving the runs ``block_ids[j]`` into ``outs[j]`` (chunk-layout tensors,
        e.g. :func:`lmtier.kv_spec.payload_tensor`); nothing is copied until
        ``save_layer``/``save_all``."""
        pages, stream = self._pages, self._save_stream
        views, counts = _views(pages, outs)
        lists = _check_runs(pages, block_ids, counts, unique=False)
        if stream is None:
            return SaveHandle(pages, _make_runs(pages, lists, counts), views, None, self._timing)
        self._check_host_buffers(views)
        with torch.cuda.stream(stream):  # CUDA path: the ids are copied on the save stream
            launches = self._plan(lists, counts, views, load=False)
            runs = _make_runs(pages, lists, counts) if launches is None else launches
        return SaveHandle(pages, runs, views, stream, self._timing)

    def fence_saves(self) -> None:
        """Make the current stream wait for every save enqueued so far, so that the
        blocks they read may be rewritten (a no-op on the CPU: its copies are done)."""
        if self._save_stream is not None:
            torch.cuda.current_stream(self._pages.device).wait_stream(self._save_stream)

    def _check_host_buffers(self, views: Sequence[torch.Tensor]) -> None:
        for view in views:
            if view.device != self._pages.device and not (
                view[0].is_contiguous() and view.is_pinned()
            ):
                raise ValueError(
                    "async transfers need pinned, layer-major host chunks (HostPool(pin=True); "
                    f"LKTHD, LTD, LBHSC or LBSHC), got {self._pages.spec.layout} with "
                    f"pinned={view.is_pinned()}; use gather()/scatter() for these"
                )
