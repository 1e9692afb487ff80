"""What the facade returns: :class:`CacheLookup`, :class:`LoadResult`, :class:`HostMemory`.

A :class:`LoadResult` holds leases on pool slabs until it is released. Forgetting to
release it used to leak them for good (after 40 such loads, stores stored nothing),
so a result that is garbage-collected unreleased gives its slabs back itself and
logs a warning naming the line that made it. The tensor views it hands out keep it
alive: the slabs are never reclaimed while a view of them can still be read.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmtier.chunks.format import DTYPE_ITEMSIZE
from lmtier.chunks.keys import ChunkKey
from lmtier.copies import copy_many
from lmtier.errors import InvalidKVError
from lmtier.kv_spec import KVSpec, torch_dtype
from lmtier.storage.lookup import LoadedChunk, Lookup

__all__ = ["CacheLookup", "HostMemory", "LoadResult", "caller"]

logger = logging.getLogger(__name__)

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def caller() -> str:
    """``file:line`` of the nearest frame outside lmtier's core package: who asked."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


@dataclass(frozen=True, slots=True)
class CacheLookup:
    """How much of a prompt is cached: ``num_tokens`` (whole chunks) and who holds them."""

    num_tokens: int
    keys: tuple[ChunkKey, ...]
    lookup: Lookup

    @property
    def num_chunks(self) -> int:
        """Leading chunks found in some tier."""
        return self.lookup.num_chunks

    def tokens_by_tier(self, chunk_size: int) -> dict[str, int]:
        """Cached tokens per tier name."""
        return {s.tier: (s.stop - s.start) * chunk_size for s in self.lookup.spans}


@dataclass(frozen=True, slots=True)
class HostMemory:
    """A cache's host memory: ``total_bytes`` in ``slabs`` of ``slab_bytes`` (one chunk
    each), ``slabs_in_use`` by cached chunks, readers and writes in flight,
    ``cached_chunks`` in the CPU tier of at most ``cache_capacity_chunks``."""

    total_bytes: int
    slab_bytes: int
    slabs: int
    slabs_in_use: int
    cached_chunks: int
    cache_capacity_chunks: int


class _Owned(np.ndarray[Any, Any]):
    """A numpy view whose ``owner`` attribute keeps a LoadResult alive (tensors made
    from it with ``torch.from_numpy`` hold it)."""

    owner: object


def _copy_chunks(chunks: list[LoadedChunk], axis: int, out: torch.Tensor) -> None:
    """Copy the payloads of ``chunks`` (in order) into ``out``, one after another along
    ``axis``, with one copy per run of chunks that lie at a constant distance from each
    other in one region (slabs leased together do: they are handed out in address
    order).

    ``torch.cat`` into ``out`` cost a view and a kernel launch per chunk; a ``copy_``
    per chunk, a parallel region of torch's intra-op threads per chunk, which a busy
    machine stretches (a region waits for its slowest thread). So a run is one strided
    view over the region, shaped ``(chunks, *chunk shape)``, copied into the matching
    view of ``out``; a chunk in no run is a view of its own. All of them are then one
    shared copy (:func:`lmtier.copies.copy_many`: cut into pieces that this thread and
    helpers take in turn, none of them spinning). Only a run's first chunk gets a
    tensor view (~5 us each); the others are addresses.
    """
    places = [_place(chunk) for chunk in chunks]
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    start = first = 0
    while first < len(chunks):
        last, step = first + 1, 0
        if last < len(chunks):
            step = _step(places[first], places[last])
            while last < len(chunks) and step and _step(places[last - 1], places[last]) == step:
                last += 1
        head, count = LoadResult._transient_view(chunks[first]), last - first
        extent = int(head.shape[axis])
        target = out.narrow(axis, start, count * extent)
        if count == 1:
            pairs.append((target, head))
        else:  # step is in bytes, a whole number of elements (_step)
            strides = (step // head.element_size(), *head.stride())
            source = head.as_strided((count, *head.shape), strides)
            runs = (*target.shape[:axis], count, extent, *target.shape[axis + 1 :])
            pairs.append((target.view(runs).movedim(axis, 0), source))
        start += count * extent
        first = last
    copy_many(pairs)


_Place = tuple[int, int, tuple[int, ...], str]
"""Where a chunk's payload lies: its region's address, its own, its shape and dtype."""


def _place(loaded: LoadedChunk) -> _Place:
    """A chunk's :data:`_Place` (no view made)."""
    slab, decoded = loaded.handle.tensor, loaded.chunk
    region = slab.data_ptr() - int(slab.storage_offset())  # uint8: offsets are bytes
    meta = decoded.meta
    return region, slab.data_ptr() + decoded.payload_offset, meta.shape, meta.dtype


def _step(before: _Place, after: _Place) -> int:
    """Bytes from one payload to the next when one strided view can step between them
    (same region, shape and dtype; further on, by whole elements, without overlap), else 0."""
    region, address, shape, dtype = before
    if after[0] != region or after[2] != shape or after[3] != dtype:
        return 0
    gap = after[1] - address
    size = DTYPE_ITEMSIZE[dtype]
    return gap if gap % size == 0 and gap >= math.prod(shape) * size else 0


class LoadResult:
    """Loaded chunks of a prompt's cached prefix. Release it (or use ``with``) when done;
    one dropped unreleased is reclaimed when collected, with a warning (module docstring).
    """

    __slots__ = (
        "__weakref__",
        "_released",
        "chunk_size",
        "chunks",
        "kv_spec",
        "origin",
        "token_axis",
    )

    def __init__(
        self, chunks: list[LoadedChunk], chunk_size: int, kv_spec: KVSpec, origin: str = "?"
    ) -> None:
        self.chunks = chunks
        self.chunk_size = chunk_size
        self.kv_spec = kv_spec
        self.token_axis = kv_spec.token_axis
        self.origin = origin
        """Where the load was asked for (``file:line``), named if it leaks."""
        self._released = not chunks

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV was loaded."""
        return len(self.chunks) * self.chunk_size

    def tensors(self) -> list[torch.Tensor]:
        """Zero-copy tensor views of each chunk (valid until :meth:`release`)."""
        return [self._view(chunk) for chunk in self.chunks]

    def kv(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """All loaded KV concatenated on the token axis, ``KVSpec.token_axis`` (the block
        axis of a paged layout), shaped ``kv_spec.shape(num_tokens)``: a new tensor, or
        written into ``out`` (shaped for :attr:`num_tokens`, any device), which spares
        an allocation whose first touch costs more than the copy.

        A miss is KV of 0 tokens (``out``: its 0-token view), not None: code that
        compares or concatenates the prefix's KV runs unchanged when nothing was cached
        (a cold cache, a sidecar that is down)."""
        if not self.chunks:
            if out is not None:
                return out.narrow(self.token_axis, 0, 0)
            return torch.empty(self.kv_spec.shape(0), dtype=torch_dtype(self.kv_spec.dtype))
        # The copy cuts views for itself only (none escapes): from each slab's tensor,
        # not the ~13 us a chunk of a view that keeps this result alive (tensors()).
        axis, metas = self.token_axis, [chunk.chunk.meta for chunk in self.chunks]
        shape = list(metas[0].shape)
        shape[axis] = sum(meta.shape[axis] for meta in metas)
        if out is None:
            out = torch.empty(shape, dtype=torch_dtype(metas[0].dtype))
        elif list(out.shape) != shape:
            raise InvalidKVError(
                f"out has shape {tuple(out.shape)}; the {self.num_tokens} loaded tokens "
                f"need {tuple(shape)}"
            )
        _copy_chunks(self.chunks, axis, out)
        return out

    def copy_to(self, targets: Sequence[torch.Tensor]) -> int:
        """Copy loaded chunk ``i`` into ``targets[i]`` (each shaped as one chunk, any
        strides, any device), all as one shared copy; how many chunks were copied (the
        fewer of the loaded chunks and ``targets``). For engines whose pages lie apart
        (SGLang's host pool): no per-chunk view that keeps this result alive is made."""
        count = min(len(targets), len(self.chunks))
        pairs = []
        for at in range(count):
            loaded = self.chunks[at]
            loaded.handle.check("a loaded chunk")
            source = self._transient_view(loaded)
            if tuple(targets[at].shape) != tuple(source.shape):
                raise InvalidKVError(
                    f"target {at} has shape {tuple(targets[at].shape)}, a chunk "
                    f"{tuple(source.shape)}"
                )
            pairs.append((targets[at], source))
        copy_many(pairs)
        return count

    def tokens_by_tier(self) -> dict[str, int]:
        """Loaded tokens per tier that served them."""
        out: dict[str, int] = {}
        for chunk in self.chunks:
            out[chunk.tier] = out.get(chunk.tier, 0) + self.chunk_size
        return out

    def release(self) -> None:
        """Give every chunk's slab back. Idempotent."""
        if not self._released:
            self._released = True
            for chunk in self.chunks:
                chunk.release()

    def detach(self) -> list[LoadedChunk]:
        """Take the chunks out: releasing each becomes the caller's job, and this result
        holds nothing any more (for engines that release chunk by chunk)."""
        chunks, self.chunks = self.chunks, []
        self._released = True
        return chunks

    @staticmethod
    def _transient_view(loaded: LoadedChunk) -> torch.Tensor:
        meta, decoded = loaded.chunk.meta, loaded.chunk
        start = decoded.payload_offset
        raw = loaded.handle.tensor[start : start + len(decoded.payload)]
        return raw.view(torch_dtype(meta.dtype)).view(meta.shape)

    def _view(self, loaded: LoadedChunk) -> torch.Tensor:
        loaded.handle.check("a loaded chunk")  # a lease that ended is never read
        meta = loaded.chunk.meta
        raw = np.frombuffer(loaded.chunk.payload, dtype=np.uint8).view(_Owned)
        raw.owner = self
        return torch.from_numpy(raw).view(torch_dtype(meta.dtype)).view(meta.shape)

    def __enter__(self) -> LoadResult:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __del__(self) -> None:
        if self._released:
            return
        self.release()
        try:
            logger.warning(
                "a LoadResult of %d chunk(s) made at %s was never released; its slabs are "
                "reclaimed now (use `with cache.load(...) as hit:` or call release())",
                len(self.chunks),
                self.origin,
            )
        except Exception:  # logging torn down at interpreter exit: nothing to tell
            return

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"LoadResult({self.num_tokens} tokens, {self.tokens_by_tier()}, {state})"
