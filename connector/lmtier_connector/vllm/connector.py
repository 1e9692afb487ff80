"""lmtier as a vLLM (0.32 to 0.34) KV connector: ``LMTierConnector``.

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
block copies; ``LKTHD``: the HF adapter's layout), ``copy_kernels`` (``auto``: the
fused CUDA kernels where cupy and a GPU are there; ``on``; ``off``), ``page_interior``
(``flash`` or ``cpu_attn``: declares the page interior instead of taking it from vLLM's
platform), ``async_loads`` and
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

vLLM versions: 0.32 (the CPU build), 0.33 and 0.34. Hooks a vLLM lacks are never
called, so each is answered where it exists (docs/vllm.md, *Supported vLLM versions*):
``get_external_cache_hit_sources`` splits a hit by the tier that holds it (``cpu`` as
``host``, ``disk``, ``peer`` as ``p2p``, remote stores as ``external_unspecified``);
``requires_kv_delivery`` is False (a best-effort cache: a dropped save is a later miss);
0.34's ``may_load_async`` predicts an asynchronous load without I/O (True where a remote
tier or a sidecar would have to be asked); ``supports_lookahead_block_hashes`` follows
``vllm_block_hashes`` (vLLM's hashes cover the drafter's lookahead, lmtier's chain does
not); ``kv_cache_access`` is ``IN_PROCESS`` (torch copies in the worker's process).
0.34 resumes a preempted request among the new ones; the scheduler half takes both.

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

from lmtier.api import LMTier
from lmtier.errors import ConfigError
from lmtier.model_dir import local_model_id
from lmtier_connector.vllm.caches import caches
from lmtier_connector.vllm.common import (
    ConnectorSettings,
    LMTierConnectorMetadata,
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
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
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
        group_caches = [caches.acquire(key) for key in self._cache_keys]
        cache = self._cache = group_caches[0]
        self._closed = False
        self._scheduler: SchedulerHalf | HybridScheduler | None = None
        self._worker: WorkerHalf | HybridWorker | None = None
        savers = 1 if mla else vllm_config.parallel_config.tensor_parallel_size
        if role == KVConnectorRole.SCHEDULER and groups:
            halves = [
                SchedulerHalf(
                    c, settings, block_size, num_savers=savers, group=g.index, window=g.window
                )
                for c, g in zip(group_caches, groups, strict=True)
            ]
            self._scheduler = HybridScheduler(halves, groups, settings)
        elif role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerHalf(cache, settings, block_size, num_savers=savers)
        elif groups:
            workers = [WorkerHalf(c, block_size, kernels=settings.kernels) for c in group_caches]
            self._worker = HybridWorker(workers, groups)
        else:
            saves = not mla or rank == 0
            self._worker = WorkerHalf(cache, block_size, saves=saves, kernels=settings.kernels)

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

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """The external tokens by the tier lmtier found them in: ``cpu`` as ``host``,
        ``disk``, ``peer`` as ``p2p``, Redis, S3 (and a sidecar over TCP) as
        ``external_unspecified`` (:mod:`~lmtier_connector.vllm.hit_sources`)."""
        return self._sched().hit_sources(request, num_external_tokens)

    def may_load_async(self, request: Request) -> bool:
        """vLLM >= 0.34, with ``--max-num-inflight-kv-loads``: whether this request's hit
        would load in the background, so it may start loading while the batch is full
        (:meth:`SchedulerHalf.may_load_async`)."""
        return self._sched().may_load_async(request)

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """vLLM >= 0.34: True when chunks are keyed by vLLM's block hashes
        (``vllm_block_hashes``, the default), which then cover the tokens an EAGLE
        drafter's KV reads past each block; lmtier's own token chain does not."""
        extra = kv_transfer_config.kv_connector_extra_config or {}
        return bool(extra.get("vllm_block_hashes", True))

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: KVTransferConfig) -> Any:
        """vLLM >= 0.34: ``IN_PROCESS``. The workers copy pages with torch in their own
        process (a sidecar gets host copies, never the device KV cache), so any
        allocation of it works."""
        from vllm.config.kv_transfer import (  # type: ignore[attr-defined,unused-ignore] # noqa: PLC0415
            KVCacheAccess,
        )

        return KVCacheAccess.IN_PROCESS

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a best-effort cache (a save that a preemption drops is a later miss),
        so vLLM need not recompute a request preempted with a save pending."""
        return False

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
        their CPU tier evicted) events for take_events, and their read rates."""
        events = connector_output.kv_cache_events
        if events is not None:
            self._sched().add_worker_events(events.get_all_events())
        stats = connector_output.kv_connector_stats
        if stats is not None:  # the workers' read rates, for the sync-or-async choice
            self._sched().observe_stats(stats.data)

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
                caches.release(key)
