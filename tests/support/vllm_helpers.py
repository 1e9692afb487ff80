"""vLLM's scheduler harness, shared by the vLLM connector tests and
``benchmarks/vllm_step.py``: a tiny model directory, vLLM configs and KV cache configs,
a real Scheduler, and one worker step around a forward pass (by default a fake one that
writes deterministic KV, :func:`expected_kv`). What the model is (:class:`Geometry`)
defaults to the tests' tiny fp32 Llama; the benchmark passes its own. Import it only
once vLLM is known to be installed (the test modules skip first); ``tests/conftest.py``
(and the benchmark, for itself) sets the environment vLLM needs on a CPU machine before
vLLM is imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        compute_layout_strides,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.utils import allocate_kv_cache

    from lmtier_connector.vllm.common import LMTierConnectorMetadata
    from lmtier_connector.vllm.connector import LMTierConnector


@dataclass(frozen=True)
class Geometry:
    """What the harness's model is: its KV geometry (layers, KV heads, head size, vLLM
    block size), dtype, ``max_model_len`` (also the model's ``max_position_embeddings``),
    the scheduler's ``max_num_seqs`` and the vocabulary. The defaults are the tests'
    tiny fp32 Llama (:data:`GEOMETRY`)."""

    layers: int = 2
    kv_heads: int = 2
    head_dim: int = 16
    block_size: int = 16
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    max_model_len: int = 4096
    max_num_seqs: int = 8
    vocab_size: int = 1000

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype)
        assert isinstance(dtype, torch.dtype)
        return dtype

    @property
    def names(self) -> list[str]:
        """The attention layers' names, as vLLM names a Llama's."""
        return [f"model.layers.{i}.self_attn.attn" for i in range(self.layers)]

    @property
    def page_bytes(self) -> int:
        """One layer's block, K and V."""
        return 2 * self.kv_heads * self.block_size * self.head_dim * self.torch_dtype.itemsize

    def model_config(self) -> dict[str, Any]:
        """A Llama ``config.json`` of this geometry (no weights: vLLM only reads it)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.kv_heads * 2 * self.head_dim,
            "intermediate_size": 128,
            "num_attention_heads": self.kv_heads * 2,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.layers,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_model_len,
            "rms_norm_eps": 1e-5,
            "torch_dtype": self.dtype,
        }


GEOMETRY = Geometry()
"""The tests' model (LAYERS to PAGE below are its values)."""
LAYERS, HEADS, HEAD_DIM = GEOMETRY.layers, GEOMETRY.kv_heads, GEOMETRY.head_dim
BLOCK = GEOMETRY.block_size
NAMES = GEOMETRY.names
PAGE = GEOMETRY.page_bytes  # one layer's block, fp32, K and V
NUM_BLOCKS, CHUNK = 128, 64  # the tests' vLLM blocks and lmtier chunk size
PREFIX = [(i * 37 + 11) % 1000 for i in range(300)]


def write_model_dir(
    path: Path, config: dict[str, Any] | None = None, geometry: Geometry = GEOMETRY
) -> Path:
    """A local model directory holding only ``config.json`` (default: ``geometry``'s
    Llama, a tiny one)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(geometry.model_config() if config is None else config)
    )
    return path


def lmtier_overrides(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "chunk_size": CHUNK,
        "cpu": {"capacity_bytes": "64MiB"},
        "disk": {"path": str(tmp_path / "disk")},
    }
    config.update(extra)
    return config


PAGE_INTERIOR = "flash"
"""The connector's ``page_interior`` in these tests unless one sets it: the harness
stands in for a GPU engine on CPU torch, and its fake forward pass writes FlashAttention
pages (each slot's K then V), which vLLM's CPU platform (``cpu_attn``) never runs. Its
layers name no attention backend, so the workers have nothing to check it against."""

LOOKUP_WAIT_MS = 60_000
"""The connector's ``lookup_wait_ms`` in these tests unless one sets it: on a loaded
machine a lookup through Redis or a sidecar can take longer than the 2 ms default, and
a test that expects a request scheduled in its first step would see "not yet". The
tests of that answer set it themselves."""


@contextlib.contextmanager
def _cpu_platform_without_triton() -> Iterator[None]:
    """While a config is built: vLLM >= 0.34's CPU platform refuses an x86 machine
    without triton-cpu (its model runner compiles kernels with it); the harness runs no
    model, only the scheduler side and the connector, so it builds one anyway. Nothing
    else changes: vLLM's modules keep their Triton placeholders."""
    import vllm.triton_utils as triton_utils

    if triton_utils.HAS_TRITON:
        yield
        return
    triton_utils.HAS_TRITON = True
    try:
        yield
    finally:
        triton_utils.HAS_TRITON = False


def make_vllm_config(
    model_dir: Path,
    extra: dict[str, Any],
    *,
    max_batched_tokens: int = 4096,
    num_blocks: int = NUM_BLOCKS,
    geometry: Geometry = GEOMETRY,
    lookup_wait_ms: float | None = LOOKUP_WAIT_MS,
    page_interior: str | None = PAGE_INTERIOR,
) -> VllmConfig:
    """vLLM's config for ``geometry``'s model in ``model_dir``, on the CPU, with our
    connector (``extra``: its ``kv_connector_extra_config``). ``lookup_wait_ms`` (None:
    the connector's default) and ``page_interior`` (None: from vLLM's platform, here
    ``cpu_attn``) unless ``extra`` sets them."""
    defaults: dict[str, Any] = {}
    if lookup_wait_ms is not None:
        defaults["lookup_wait_ms"] = lookup_wait_ms
    if page_interior is not None:
        defaults["page_interior"] = page_interior
    with warnings.catch_warnings(), _cpu_platform_without_triton():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = ModelConfig(
            model=str(model_dir),
            tokenizer=str(model_dir),
            skip_tokenizer_init=True,
            dtype=geometry.dtype,
            max_model_len=geometry.max_model_len,
        )
        cache = CacheConfig(block_size=geometry.block_size, enable_prefix_caching=True)
        cache.num_gpu_blocks = num_blocks
        return VllmConfig(
            model_config=model,
            cache_config=cache,
            scheduler_config=SchedulerConfig(
                max_num_seqs=geometry.max_num_seqs,
                max_num_batched_tokens=max_batched_tokens,
                max_model_len=geometry.max_model_len,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="LMTierConnector",
                kv_connector_module_path="lmtier_connector.vllm",
                kv_role="kv_both",
                kv_connector_extra_config={**defaults, **extra},
                # What lmtier's docs advise: a chunk that fails to load is recomputed
                # (vLLM's default, "fail", fails the request instead).
                kv_load_failure_policy="recompute",
            ),
            device_config=DeviceConfig("cpu"),
        )


def kv_cache_config(
    layout: KVCacheLayout, num_blocks: int = NUM_BLOCKS, geometry: Geometry = GEOMETRY
) -> KVCacheConfig:
    """One KV buffer for every layer in ``layout``, with the strides vLLM computes."""
    spec = FullAttentionSpec(
        block_size=geometry.block_size,
        num_kv_heads=geometry.kv_heads,
        head_size=geometry.head_dim,
        dtype=geometry.torch_dtype,
    )
    layers = geometry.layers
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, layers, layout)
    names = geometry.names
    tensor = KVCacheTensor(
        size=geometry.page_bytes * num_blocks * layers,
        layers=list(names),
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(list(names), spec)],
    )


def make_scheduler(vllm_config: VllmConfig, config: KVCacheConfig) -> Scheduler:
    """vLLM's real Scheduler; its connector is our SCHEDULER half."""
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=vllm_config.cache_config.block_size,
    )


def block_hasher(block_size: int = BLOCK) -> Callable[[Request], list[Any]]:
    """vLLM's request block hasher (sha256 over CBOR, as vLLM's default)."""
    init_none_hash(sha256_cbor)
    return get_request_block_hasher(block_size, sha256_cbor)


def make_request(
    req_id: str,
    tokens: list[int],
    hasher: Callable[[Request], list[Any]],
    max_tokens: int = 4,
    *,
    ignore_eos: bool = False,
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    return Request(req_id, tokens, params, None, block_hasher=hasher)


class SchedulerHalf:
    """vLLM's real Scheduler with our connector as its SCHEDULER half, in this process."""

    def __init__(self, vllm_config: VllmConfig, config: KVCacheConfig) -> None:
        self.scheduler = make_scheduler(vllm_config, config)
        self.hasher = block_hasher(vllm_config.cache_config.block_size)

    @property
    def connector(self) -> LMTierConnector:
        connector = self.scheduler.connector
        assert isinstance(connector, LMTierConnector)
        return connector

    def add(
        self, req_id: str, tokens: list[int], max_tokens: int = 4, *, ignore_eos: bool = False
    ) -> Request:
        request = make_request(req_id, tokens, self.hasher, max_tokens, ignore_eos=ignore_eos)
        self.scheduler.add_request(request)
        return request


def expected_kv(token: int, pos: int, layer: int) -> torch.Tensor:
    """The KV the fake forward pass writes for ``token`` at ``pos`` in ``layer``."""
    gen = torch.Generator().manual_seed(pos * 7919 + token * 31 + layer)
    return torch.randn(HEADS, 2 * HEAD_DIM, generator=gen)


def expected_tokens(tokens: list[int], start: int, stop: int, layer: int) -> torch.Tensor:
    return torch.stack([expected_kv(tokens[p], p, layer) for p in range(start, stop)])


def fake_forward(kv: dict[str, torch.Tensor], out: SchedulerOutput, layer: int) -> None:
    """Write the KV a model would write for every scheduled token (new requests)."""
    for new in out.scheduled_new_reqs:
        tokens = new.prompt_token_ids or []
        start = new.num_computed_tokens
        stop = start + out.num_scheduled_tokens[new.req_id]
        for pos in range(start, stop):
            block = new.block_ids[0][pos // BLOCK]
            kv[NAMES[layer]][block, :, pos % BLOCK, :] = expected_kv(tokens[pos], pos, layer)


def scheduler_forward(
    scheduler: Scheduler, kv: dict[str, torch.Tensor], out: SchedulerOutput, layer: int
) -> None:
    """:func:`fake_forward` for every scheduled request (new, continued, resumed),
    its block table and tokens read from the scheduler (call it after ``schedule``)."""
    for req_id, count in out.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        blocks = scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        stop = request.num_computed_tokens
        for pos in range(stop - count, stop):
            kv[NAMES[layer]][blocks[pos // BLOCK], :, pos % BLOCK, :] = expected_kv(
                request.all_token_ids[pos], pos, layer
            )


def worker_step(
    worker: LMTierConnector,
    kv: dict[str, torch.Tensor],
    out: SchedulerOutput,
    *,
    loads_first: bool | None = None,
    forward: Callable[[int], None] | None = None,
    geometry: Geometry = GEOMETRY,
) -> LMTierConnectorMetadata:
    """What vLLM's model runner does with one step's SchedulerOutput
    (``kv_connector_model_runner_mixin``): bind the connector's metadata, call
    ``start_load_kv`` before the (fake) forward pass when the step has synchronous
    loads and after it otherwise, run the forward pass layer by layer with
    ``save_kv_layer``, then ``wait_for_save``. ``loads_first`` forces one order;
    ``forward(layer)`` replaces :func:`fake_forward` (which writes the default
    geometry's KV: a harness of another :class:`Geometry` passes its own)."""
    meta = out.kv_connector_metadata
    assert isinstance(meta, LMTierConnectorMetadata)
    first = out.has_sync_kv_loads if loads_first is None else loads_first
    worker.bind_connector_metadata(meta)
    if first:
        worker.start_load_kv(None)  # type: ignore[arg-type]
    for layer, name in enumerate(geometry.names):
        worker.wait_for_layer_load(name)
        if forward is None:
            fake_forward(kv, out, layer)
        else:
            forward(layer)
        worker.save_kv_layer(name, kv[name], None)  # type: ignore[arg-type]
    if not first:
        worker.start_load_kv(None)  # type: ignore[arg-type]
    worker.wait_for_save()
    worker.clear_connector_metadata()
    return meta


def runner_output(
    scheduler: Scheduler, out: SchedulerOutput, kv_output: KVConnectorOutput
) -> ModelRunnerOutput:
    """A model runner's output for ``out``: one sampled token (7) for each request
    whose prompt is complete after this step, and the connector's output."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        sampled.append([7] if request.num_computed_tokens >= request.num_tokens else [])
    # vLLM <= 0.33 also takes each request's index (0.34 dropped the field).
    indexes: dict[str, Any] = {}
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        indexes["req_id_to_index"] = {req_id: index for index, req_id in enumerate(req_ids)}
    return ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=sampled, kv_connector_output=kv_output, **indexes
    )


def resumed_req_ids(scheduler: Scheduler, out: SchedulerOutput) -> set[str]:
    """The preempted requests ``out`` resumes: vLLM <= 0.33 names them among the cached
    requests, 0.34 sends them in full among the new ones."""
    cached = getattr(out.scheduled_cached_reqs, "resumed_req_ids", None)
    if cached is not None:
        return set(cached)
    new = (n.req_id for n in out.scheduled_new_reqs)
    return {req_id for req_id in new if scheduler.requests[req_id].num_preemptions > 0}


def block_tokens(
    kv: dict[str, torch.Tensor], block_ids: list[int], start: int, stop: int, layer: int
) -> torch.Tensor:
    """Tokens ``[start, stop)`` of a request whose block table is ``block_ids``."""
    page = kv[NAMES[layer]]
    return torch.stack([page[block_ids[p // BLOCK], :, p % BLOCK, :] for p in range(start, stop)])


class Engine(SchedulerHalf):
    """A real Scheduler with our connector, plus one worker connector on real tensors."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        layout: KVCacheLayout = KVCacheLayout.BLHNC,
        worker_config: VllmConfig | None = None,
        geometry: Geometry = GEOMETRY,
    ) -> None:
        """``vllm_config`` made by :func:`make_vllm_config` for the same ``geometry``."""
        num_blocks = vllm_config.cache_config.num_gpu_blocks or NUM_BLOCKS
        config = kv_cache_config(layout, num_blocks, geometry)
        super().__init__(vllm_config, config)
        self.geometry = geometry
        self.worker = LMTierConnector(worker_config or vllm_config, KVConnectorRole.WORKER, config)
        self.kv = allocate_kv_cache(config, torch.device("cpu"), layout)
        self.worker.register_kv_caches(self.kv)
        self.stats_seen: list[Any] = []  # the worker's connector stats, step by step

    def step(self) -> tuple[SchedulerOutput, LMTierConnectorMetadata]:
        """Schedule, then run the worker connector around a fake forward pass."""
        out = self.scheduler.schedule()
        return out, worker_step(self.worker, self.kv, out, geometry=self.geometry)

    def run_step(
        self,
        before_worker: Callable[[], None] | None = None,
        forward: Callable[[SchedulerOutput, int], None] | None = None,
        **options: Any,
    ) -> tuple[SchedulerOutput, LMTierConnectorMetadata]:
        """One whole engine step: schedule, the worker around the forward pass (default:
        :func:`scheduler_forward`; ``forward(out, layer)`` replaces it), and the
        runner's output (sampled tokens, finished transfers, load errors, KV events)
        back into the scheduler, as vLLM's engine core does. ``before_worker`` runs
        between the two halves (a fault to inject); ``options`` go to
        :func:`worker_step`."""
        out = self.scheduler.schedule()
        if before_worker is not None:
            before_worker()

        def layer_forward(layer: int) -> None:
            if forward is None:
                scheduler_forward(self.scheduler, self.kv, out, layer)
            else:
                forward(out, layer)

        meta = worker_step(
            self.worker, self.kv, out, forward=layer_forward, geometry=self.geometry, **options
        )
        sending, receiving = self.worker.get_finished(out.finished_req_ids)
        stats = self.worker.get_kv_connector_stats()
        kv_output = KVConnectorOutput(
            finished_sending=sending,
            finished_recving=receiving,
            invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
            kv_cache_events=self.worker.get_kv_connector_kv_cache_events(),
            kv_connector_stats=stats,
        )
        if stats is not None:
            self.stats_seen.append(stats)
        self.scheduler.update_from_output(out, runner_output(self.scheduler, out, kv_output))
        return out, meta

    def page_tokens(self, request: Request, start: int, stop: int, layer: int) -> torch.Tensor:
        ids = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
        return block_tokens(self.kv, ids, start, stop, layer)

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()


def finish(engine: Engine, req_id: str) -> None:
    engine.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)


def drain_finished(engine: Engine, req_ids: set[str]) -> set[str]:
    done: set[str] = set()
    for _ in range(200):
        sent, _ = engine.worker.get_finished(req_ids)
        done |= sent or set()
        if done == req_ids:
            break
        engine.worker._work()._writer.submit(lambda: None).result()
    return done


def deliver_events(engine: Engine) -> list[Any]:
    """What vLLM does each step: the worker's events into the scheduler's connector."""
    events = engine.worker.get_kv_connector_kv_cache_events()
    engine.connector.update_connector_output(KVConnectorOutput(kv_cache_events=events))
    return list(engine.connector.take_events())
