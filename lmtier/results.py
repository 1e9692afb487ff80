"""What the facade returns: :class:`CacheLookup`, :class:`LoadResult`, :class:`HostMemory`.

A :class:`LoadResult` holds leases on pool slabs until it is released. Forgetting to
release it used to leak them for good (after 40 such loads, stores stored nothing),
so a result that is garbage-collected unreleased gives its slabs back itself and
logs a warning naming the line that made it. The tensor views it hands out keep it
alive: the slabs are never reclaimed while a view of them can still be read.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmtier.chunks.keys import ChunkKey
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
        # Views for the copy only (none escapes): cut from each slab's tensor, ~3 us a
        # chunk, not the ~13 us of a view that keeps this result alive (tensors()).
        views = [self._transient_view(chunk) for chunk in self.chunks]
        if out is None:
            return torch.cat(views, dim=self.token_axis)
        return torch.cat(views, dim=self.token_axis, out=out)

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
