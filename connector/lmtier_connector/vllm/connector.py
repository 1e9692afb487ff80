"""lmtier as a vLLM (>= 0.33) KV connector: ``LMTierConnector``.

::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "LMTierConnector",
        "kv_connector_module_path": "lmtier_connector.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"config_path": "/etc/lmtier.yaml"}}'

vLLM builds one connector per role: a SCHEDULER one in the engine core (lookups and
plans, :mod:`lmtier_connector.vllm.scheduler`) and a WORKER one per GPU worker
(loads and saves, :mod:`lmtier_connector.vllm.worker`), possibly in other processes.
Each owns its own :class:`~lmtier.api.LMTier`, so what the scheduler finds must be
reachable by the workers: a shared tier (disk, Redis, S3), one process, or a sidecar.

Options (``kv_connector_extra_config``; see :class:`ConnectorSettings`):
``config_path`` (an lmtier YAML file, else ``$LMTIER_CONFIG``), ``config``
(overrides of it), ``vllm_block_hashes`` (default true), ``save_decode_tokens``,
``chunk_layout`` (``page``: chunks in the pages' own order, so saves and loads are
block copies; ``LKTHD``: the HF adapter's layout), ``page_interior`` (``flash`` or
``cpu_attn``: declares the page interior instead of taking it from vLLM's platform),
``async_loads`` and
``lookup_wait_ms`` (loads and lookups off the scheduling step),
``sidecar`` (``unix:///run/lmtier/sidecar.sock``: every process uses that
``lmtier serve`` through :func:`lmtier.connect` instead of opening tiers of
its own; ``sidecar_token`` or ``sidecar_token_file``, ``sidecar_shared_memory``,
``sidecar_timeout_s``).
Over a sidecar the config's tier sections are the sidecar's business; what matters
here is what keys chunks (``chunk_size``, ``hash_algorithm``, ``model_id``...). A
sidecar that is down costs misses and load errors (recomputed), never a failed step.

Page interior: vLLM's GPU backends (FlashAttention, Triton, FlexAttention, FlashInfer)
hold each slot's K then V on the last axis of a page block; its CPU backend holds, per
block and head, a K region then a V region, in the same shape. The connector names which one in
the namespace of ``page`` chunks (:func:`page_interior_of`, from vLLM's platform, unless
``kv_connector_extra_config.page_interior`` declares it; either way checked against the
layers' attention backends at ``register_kv_caches``), so a CPU and a GPU
engine sharing a tier never load each other's pages, and refuses the transcoded layouts
(``LKTHD``, MLA's ``LTD``) on the CPU backend, whose page interior it cannot transcode.

Tensor parallelism: each rank stores its own shard under a namespace naming its
rank. MLA caches one latent per token, the same on every rank: only rank 0 saves,
every rank loads, and the namespace says tp 1 / rank 0. The scheduler looks up
rank 0's namespace; a rank missing its shard reports a load error (recomputed).

Hybrid models (``SupportsHMA``: full-attention and sliding-window KV cache groups,
vLLM's hybrid allocator kept on) are cached per group, each with its own cache and
namespace; sliding-window groups keep only the chunks of a window
(:mod:`lmtier_connector.vllm.hybrid`). Mamba/SSM state groups are refused.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput

import lmtier
from lmtier.api import LMTier
from lmtier.config import LMTierConfig
from lmtier.errors import ConfigError
from lmtier.kv_spec import KVSpec
from lmtier.model_dir import local_model_id
from lmtier_connector.vllm.common import (
    ConnectorSettings,
    LMTierConnectorMetadata,
    SidecarSettings,
)
from lmtier_connector.vllm.geometry import (
    check_kv_cache_groups,
    kv_spec_of,
    lmtier_config_of,
    tp_rank_of,
)
from lmtier_connector.vllm.hybrid import group_configs, group_revision, is_hybrid, kv_groups_of
from lmtier_connector.vllm.hybrid_scheduler import HybridScheduler
from lmtier_connector.vllm.hybrid_worker import HybridWorker
from lmtier_connector.vllm.pages import check_page_interior, page_interior_of
from lmtier_connector.vllm.scheduler import SchedulerHalf
from lmtier_connector.vllm.stats import LMTierConnectorStats, LMTierPromMetrics, route_logs_to_vllm
from lmtier_connector.vllm.worker import WorkerHalf

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "LMTierConnector",
    "check_kv_cache_groups",
    "check_page_interior",
    "kv_spec_of",
    "lmtier_config_of",
    "page_interior_of",
    "tp_rank_of",
]

logger = logging.getLogger(__name__)


_CacheKey = tuple[LMTierConfig, KVSpec, str, str, int, int, SidecarSettings | None]
"""(config, geometry, model id, revision, TP size, TP rank, sidecar). The frozen config
itself, not its repr: a key may be printed or logged, and the config's secrets print
redacted (an unredacted repr of them must never sit in a key)."""


class _Caches:
    """The started caches of this process, one per :data:`_CacheKey`, counted.

    When vLLM runs the scheduler and the worker in one process (its in-process
    executor, tests), both halves share one cache, CPU tier included; in separate
    processes each half opens its own and they meet in the shared tiers. With a
    sidecar (the key's last part) the cache is a client of it
    (:func:`lmtier.connect`): every process meets in the sidecar's tiers,
    its CPU tier included.

    A forked child inherits this registry but not the threads, event loop and
    sockets behind the parent's caches, so it must never use them: every call first
    checks the process id (as redis-py's ``ConnectionPool._checkpid`` does) and, in
    a new process, forgets the parent's caches, unclosed (closing them would act on
    the parent's tiers and memory), and opens its own. The lock is made anew in a
    forked child, since one a parent's thread held at the fork stays held there.
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._entries: dict[_CacheKey, tuple[LMTier, int]] = {}
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def _owned(self) -> dict[_CacheKey, tuple[LMTier, int]]:
        """This process's entries (call holding the lock): none right after a fork."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._entries = {}
        return self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._owned())

    def acquire(self, key: _CacheKey) -> LMTier:
        """The started cache of ``key`` in this process, opened on first use."""
        with self._lock:
            entries = self._owned()
            found = entries.get(key)
            if found is not None:
                entries[key] = (found[0], found[1] + 1)
                return found[0]
            cache = _open_cache(key)
            entries[key] = (cache, 1)
            return cache

    def release(self, key: _CacheKey) -> None:
        """Drop one use of ``key``'s cache; the last closes it (not one of a parent's)."""
        with self._lock:
            entries = self._owned()
            found = entries.pop(key, None)
            if found is None:
                return
            cache, count = found
            if count > 1:
                entries[key] = (cache, count - 1)
                return
        cache.close()


def _open_cache(key: _CacheKey) -> LMTier:
    """A started LMTier for ``key``: a sidecar's client, or a cache of its own."""
    config, spec, model_id, revision, tp_size, tp_rank, sidecar = key
    if sidecar is not None:
        # A sidecar that is down is not an error here: calls miss until it is up.
        return lmtier.connect(
            sidecar.target,
            config,
            kv=spec,
            model_id=model_id,
            model_revision=revision,
            tp_size=tp_size,
            tp_rank=tp_rank,
            token=sidecar.token,
            shared_memory=sidecar.shared_memory,
            timeout_s=sidecar.timeout_s,
            client_name=f"vllm pid {os.getpid()} rank {tp_rank}",
        )
    cache = LMTier(
        config,
        spec,
        model_id=model_id,
        model_revision=revision,
        tp_size=tp_size,
        tp_rank=tp_rank,
    )
    # Opened here, not lazily: a misconfigured tier should fail at startup.
    cache.start()
    return cache


_caches = _Caches()


class LMTierConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by lmtier's tiers. See the module docstring."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        route_logs_to_vllm()
        check_kv_cache_groups(kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        settings = ConnectorSettings.from_extra_config(extra)
        config = lmtier_config_of(settings)
        block_size = vllm_config.cache_config.block_size
        if config.chunk_size % block_size:
            raise ConfigError(
                f"lmtier chunk_size {config.chunk_size} must be a multiple of vLLM's "
                f"block size {block_size}"
            )
        # Declared (a platform the connector cannot identify, a test harness), else
        # what vLLM's platform runs; both halves read the same extra config.
        interior = settings.page_interior or page_interior_of(vllm_config)
        spec = kv_spec_of(vllm_config, settings.chunk_layout, kv_cache_config, interior)
        mla = spec.layout == "LTD"
        # What the worker checks its layers' backends against (MLA pages: no K/V pair).
        self._page_interior = None if mla else interior
        tp_size = 1 if mla else vllm_config.parallel_config.tensor_parallel_size
        rank = tp_rank_of(vllm_config) if role == KVConnectorRole.WORKER else 0
        model = vllm_config.model_config
        self._cache_key = (
            config,
            spec,
            # A local directory is named by its resolved path, as every lmtier command
            # names it: `--model ./m` and `--model $PWD/m` share one namespace.
            config.model_id or local_model_id(model.model),
            config.model_revision or (model.revision or ""),
            tp_size,
            0 if mla else rank,
            settings.sidecar,
        )
        hybrid = kv_cache_config is not None and is_hybrid(kv_cache_config)
        groups = kv_groups_of(spec, kv_cache_config, config.chunk_size) if hybrid else []
        # One cache per KV cache group of a hybrid model (module docstring).
        self._cache_keys = [self._cache_key]
        if groups:
            _, _, model_id, revision, _, group_rank, sidecar = self._cache_key
            self._cache_keys = [
                (
                    group_config,
                    group.spec,
                    model_id,
                    group_revision(revision, group, len(groups)),
                    tp_size,
                    group_rank,
                    sidecar,
                )
                for group_config, group in zip(group_configs(config, groups), groups, strict=True)
            ]
        caches = [_caches.acquire(key) for key in self._cache_keys]
        cache = self._cache = caches[0]
        self._closed = False
        self._scheduler: SchedulerHalf | HybridScheduler | None = None
        self._worker: WorkerHalf | HybridWorker | None = None
        savers = 1 if mla else vllm_config.parallel_config.tensor_parallel_size
        if role == KVConnectorRole.SCHEDULER and groups:
            halves = [
                SchedulerHalf(
                    c, settings, block_size, num_savers=savers, group=g.index, window=g.window
                )
                for c, g in zip(caches, groups, strict=True)
            ]
            self._scheduler = HybridScheduler(halves, groups, settings)
        elif role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerHalf(cache, settings, block_size, num_savers=savers)
        elif groups:
            workers = [WorkerHalf(c, block_size) for c in caches]
            self._worker = HybridWorker(workers, groups)
        else:
            self._worker = WorkerHalf(cache, block_size, saves=not mla or rank == 0)

    # ---- helpers -------------------------------------------------------------------

    @property
    def lmtier(self) -> LMTier:
        """This side's cache (for stats and tests)."""
        return self._cache

    def _sched(self) -> SchedulerHalf | HybridScheduler:
        if self._scheduler is None:
            raise RuntimeError("scheduler-side method called on a WORKER connector")
        return self._scheduler

    def _work(self) -> WorkerHalf | HybridWorker:
        if self._worker is None:
            raise RuntimeError("worker-side method called on a SCHEDULER connector")
        return self._worker

    def _meta(self) -> LMTierConnectorMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, LMTierConnectorMetadata):
            raise TypeError(f"expected LMTierConnectorMetadata, got {type(meta).__name__}")
        return meta

    # ---- scheduler side ------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids), None  # type: ignore[arg-type]

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid allocator (``SupportsHMA``) calls this, with one block table per
        KV cache group, instead of :meth:`request_finished`."""
        scheduler = self._sched()
        if isinstance(scheduler, HybridScheduler):
            return scheduler.request_finished(request, block_ids), None
        return scheduler.request_finished(request, block_ids[0]), None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Collect the workers' ``BlockStored`` (stored chunks) and ``BlockRemoved`` (chunks
        their CPU tier evicted) events for take_events."""
        events = connector_output.kv_cache_events
        if events is not None:
            self._sched().add_worker_events(events.get_all_events())

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._sched().take_events()

    # ---- worker side ---------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self._work()
        if self._page_interior is not None:
            # The model is loaded: its layers name the backends that write these pages.
            layers = self._vllm_config.compilation_config.static_forward_context
            check_page_interior(
                self._page_interior,
                (
                    layer.attn_backend.get_name()
                    for name, layer in layers.items()
                    if name in kv_caches and getattr(layer, "attn_backend", None) is not None
                ),
            )
        worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, LMTierConnectorMetadata):
            self._work().handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind the step's plan and prepare its saves here: vLLM binds before the
        forward pass on every step, while ``start_load_kv`` may come after it (steps
        without synchronous loads), too late for ``save_kv_layer``."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind(self._meta())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._work().start_load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work().wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        self._work().save_layer(layer_name)

    def wait_for_save(self) -> None:
        self._work().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        work = self._work()
        done = work.finished_saves(finished_req_ids)
        received = work.finished_loads()
        return (done or None), (received or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().failed_block_ids()

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        return self._work().take_events()

    # ---- stats (lmtier_connector.vllm.stats) -----------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The worker's loads and saves since the last step (the scheduler has none)."""
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return LMTierConnectorStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> LMTierPromMetrics:
        return LMTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Finish saves in flight, then release this side's cache. Idempotent."""
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if not self._closed:
            self._closed = True
            for key in self._cache_keys:
                _caches.release(key)
