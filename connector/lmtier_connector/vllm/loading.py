"""The worker's loads: chunks from lmtier's tiers into the request's vLLM blocks.

* **Synchronous loads** (:meth:`Loader.start`, before the forward pass that reads
  them) read the planned chunks into pool slabs and hand them to the transfer
  engine, which scatters them into the blocks layer by layer (on CUDA, on its load
  stream, one event per layer; :meth:`Loader.wait_layer` waits on that layer's event
  only). The slabs are released once the step's copies are done (:meth:`Loader.finish`).
* **Asynchronous loads** (``LoadSpec.asynchronous``) run on the loader thread: read,
  scatter, wait for the copies, release. vLLM does not schedule the request
  meanwhile, so no forward pass reads those blocks, and nothing waits for the loader
  but the request itself. A finished request is reported once by
  :meth:`Loader.finished`, its unloadable blocks (if any) no later than that.

Blocks before a load's first token belong to vLLM's own prefix cache and are never
written. Chunks the tiers cannot serve (a tier down or dying mid-load, a corrupt
chunk) become block ids for ``get_block_ids_with_load_errors``, so that vLLM
recomputes them; never an exception.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from lmtier import LoadedChunk
from lmtier.api import LMTier
from lmtier.kv_spec import chunk_tensor
from lmtier_connector.device.transfer import LoadHandle, TransferEngine
from lmtier_connector.vllm.common import LoadSpec, chunk_keys
from lmtier_connector.vllm.load_paths import HOST_TIER
from lmtier_connector.vllm.stats import StepCounters

__all__ = ["Loader"]

logger = logging.getLogger(__name__)

KernelIds = Callable[[Sequence[int], int, int], list[int]]
"""Kernel block ids holding tokens ``[start, stop)`` of a request's block table."""


@dataclass(slots=True)
class _StepLoad:
    """The synchronous loads of one step: the slabs must outlive the copies."""

    handle: LoadHandle
    chunks: list[LoadedChunk] = field(default_factory=list)
    started: float = 0.0  # perf_counter at the start of its reads


class Loader:
    """Loads for one worker (module docstring); ``engine`` gives the transfer engine
    once vLLM has registered its KV caches, ``kernel_ids`` maps token ranges to blocks,
    ``kernel_blocks`` is how many kernel blocks one vLLM block holds; what it loads is
    counted in ``counters`` (:mod:`~lmtier_connector.vllm.stats`)."""

    def __init__(
        self,
        cache: LMTier,
        engine: Callable[[], TransferEngine],
        kernel_ids: KernelIds,
        kernel_blocks: Callable[[], int],
        counters: StepCounters,
    ) -> None:
        self.cache = cache
        self.counters = counters
        self._engine = engine
        self._kernel_ids = kernel_ids
        self._kernel_blocks = kernel_blocks
        self._step: _StepLoad | None = None
        self._lock = threading.Lock()  # guards the two sets below (loader vs vLLM thread)
        self._failed_blocks: set[int] = set()
        self._received: set[str] = set()
        # One thread: loads run in submission order. Started now (a no-op), not by the
        # first load: starting a thread costs ~0.5 ms of the step that asks for it.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="lmtier-load")
        self._thread.submit(lambda: None)

    def start(self, loads: Sequence[LoadSpec]) -> None:
        """Start this step's loads: synchronous ones onto the engine (the forward pass
        waits per layer), asynchronous ones onto the loader thread."""
        chunks: list[torch.Tensor] = []
        runs: list[list[int]] = []
        loaded: list[LoadedChunk] = []
        started = time.perf_counter()
        for load in loads:
            if load.asynchronous:
                self._submit(load)
            else:
                loaded.extend(self._read(load, chunks, runs, "sync"))
        if chunks:
            self._step = _StepLoad(self._engine().start_load(chunks, runs), loaded, started)
        else:
            for chunk in loaded:
                chunk.release()

    def _submit(self, load: LoadSpec) -> None:
        self._thread.submit(self._load_in_background, load)

    def _load_in_background(self, load: LoadSpec) -> None:
        """One asynchronous load, on the loader thread: read, scatter, wait, release."""
        loaded: list[LoadedChunk] = []
        started = time.perf_counter()
        try:
            chunks: list[torch.Tensor] = []
            runs: list[list[int]] = []
            loaded = self._read(load, chunks, runs, "async")
            if chunks:
                self._engine().start_load(chunks, runs).synchronize()
            self.counters.add("load_seconds", time.perf_counter() - started, "async")
        except Exception:  # a load that fails is recomputed, never a failed step
            logger.exception("lmtier: asynchronous load of request %s failed", load.req_id)
            self._fail(load, load.start_token)
        finally:
            for chunk in loaded:
                chunk.release()
            with self._lock:
                self._received.add(load.req_id)

    def _read(
        self, load: LoadSpec, chunks: list[torch.Tensor], runs: list[list[int]], mode: str
    ) -> list[LoadedChunk]:
        """Load one request's chunks; queue their token ranges; note unloadable blocks;
        count them (``mode``: the load path, ``sync`` or ``async``)."""
        size = self.cache.chunk_size
        started = time.perf_counter()
        try:
            got = self.cache.load_keys(chunk_keys(self.cache, load.refs)).detach()
        except Exception:  # a failed load is a recompute, never a failed step
            logger.exception("lmtier: load of request %s failed", load.req_id)
            got = []
        if got:  # the scheduler's read rates (load_paths): by the tier serving most of it
            tiers = Counter(chunk.tier for chunk in got)
            tier = max(tiers, key=lambda name: (name != HOST_TIER, tiers[name]))
            read = len(got) * self.cache.kv_spec.bytes_per_token * size
            self.counters.add("read_bytes", read, tier)
            self.counters.add("read_seconds", time.perf_counter() - started, tier)
        spec = self.cache.kv_spec
        device = self._engine().pages.device
        for index, chunk in enumerate(got):
            base = (load.refs.first_chunk + index) * size
            start = max(base, load.start_token)
            whole = chunk_tensor(chunk.chunk)
            tensor = spec.narrow_tokens(whole, start - base, base + size - start)
            if start != base and device.type == "cuda" and not spec.paged:
                # Async copies need pinned, layer-major host chunks; a part of a token-
                # layout chunk is neither (a paged chunk narrows by whole blocks: it is).
                staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                tensor = staged.copy_(tensor)
            chunks.append(tensor)
            runs.append(self._kernel_ids(load.block_ids, start, base + size))
            self.counters.add("loaded_chunks", 1, chunk.tier, mode)
            self.counters.add("loaded_bytes", tensor.numel() * tensor.element_size(), chunk.tier)
        loaded_end = (load.refs.first_chunk + len(got)) * size
        if loaded_end < load.end_token:
            self._fail(load, max(loaded_end, load.start_token))
        return got

    def _fail(self, load: LoadSpec, failed_from: int) -> None:
        """Report tokens ``failed_from .. end_token`` of ``load`` as not loaded."""
        per = self._kernel_blocks()
        failed = self._kernel_ids(load.block_ids, failed_from, load.end_token)
        size = self.cache.chunk_size
        self.counters.add("load_failed_chunks", -(-(load.end_token - failed_from) // size))
        with self._lock:
            self._failed_blocks.update(b // per for b in failed)
        logger.debug(
            "lmtier: request %s: tokens %d..%d not loadable, recomputed",
            load.req_id,
            failed_from,
            load.end_token,
        )

    def wait_layer(self, index: int) -> None:
        """Make the forward pass wait until layer ``index`` of this step's loads landed."""
        if self._step is not None:
            self._step.handle.wait_layer(index)

    def finish(self) -> None:
        """Wait for this step's synchronous copies, then release their slabs."""
        step, self._step = self._step, None
        if step is not None:
            step.handle.synchronize()
            self.counters.add("load_seconds", time.perf_counter() - step.started, "sync")
            for chunk in step.chunks:
                chunk.release()

    def failed_block_ids(self) -> set[int]:
        """Blocks that could not be loaded since the last call."""
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def finished(self) -> set[str]:
        """Requests whose asynchronous load completed since the last call (their
        failed blocks were already handed to :meth:`failed_block_ids`)."""
        with self._lock:
            done, self._received = self._received, set()
        return done

    def wait(self) -> None:
        """Block until every asynchronous load submitted so far has completed."""
        self._thread.submit(lambda: None).result()  # one thread: loads run in order

    def shutdown(self) -> None:
        """Finish the step's copies and every asynchronous load in flight."""
        self.finish()
        self._thread.shutdown(wait=True)
