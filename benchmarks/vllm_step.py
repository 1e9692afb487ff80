"""The scheduler-step part of ``bench_vllm_connector.py``: what admitting a request
with a 32k-token hit on disk costs the requests already running.

vLLM's real Scheduler, our connector (both halves, one process), real per-layer KV
tensors from vLLM's ``allocate_kv_cache``, and a stand-in forward pass (a fixed
matmul per layer, calibrated to ~2 ms a layer, so a step costs what a small decode
step costs). A writer engine computes the 32k-token prompt and stores its chunks on
the disk tier; then, for each mode, a fresh reader engine (its own, empty CPU tier)
runs eight decoding requests and admits a request whose whole prompt hits on disk:

* ``baseline``: the median step while the eight decode and nothing is admitted;
* ``sync`` (``async_loads: never``): the load runs inside the step that admits the
  request; every running request waits for it;
* ``async`` (``async_loads: auto``): the step only plans the load; the loader thread
  reads and scatters while the following steps run.

Per mode: the admitting step (and the connector's share of it: time inside its
methods, both halves), the median and the slowest step until the request computes
(the longest any running request waited), and the wall time until it computes.
vLLM's own share of the admitting step (allocating 2048 blocks) is there with any
connector.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

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
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.utils import allocate_kv_cache

    from lmtier_connector.vllm.connector import LMTierConnector

__all__ = ["step_bench"]

LAYERS, HEADS, DIM, BLOCK, CHUNK = 2, 8, 128, 16, 256
RUNNING = 8
SCHEDULER_CALLS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
)
WORKER_CALLS = (
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
)


class _Clock:
    """Seconds spent inside the connector's methods (both halves), since the last take."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, target: object, names: tuple[str, ...]) -> None:
        for name in names:
            method = getattr(target, name)

            def timed(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return _method(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - started

            setattr(target, name, timed)

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _model_dir(root: Path) -> Path:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2 * HEADS * DIM,
        "intermediate_size": 256,
        "num_attention_heads": 2 * HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": DIM,
        "num_hidden_layers": LAYERS,
        "vocab_size": 32000,
        "max_position_embeddings": 65536,
        "torch_dtype": "float16",
    }
    (root / "config.json").write_text(json.dumps(config))
    return root


class _Engine:
    """Scheduler + worker connector + KV tensors + the stand-in forward pass."""

    def __init__(
        self, model: Path, extra: dict[str, Any], num_blocks: int, batch: int, work: torch.Tensor
    ) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
            cache.num_gpu_blocks = num_blocks
            config = VllmConfig(
                model_config=ModelConfig(
                    model=str(model),
                    tokenizer=str(model),
                    skip_tokenizer_init=True,
                    dtype="float16",
                    max_model_len=65536,
                ),
                cache_config=cache,
                scheduler_config=SchedulerConfig(
                    max_num_seqs=RUNNING + 2,
                    max_num_batched_tokens=batch,
                    max_model_len=65536,
                    is_encoder_decoder=False,
                ),
                kv_transfer_config=KVTransferConfig(
                    kv_connector="LMTierConnector",
                    kv_connector_module_path="lmtier_connector.vllm",
                    kv_role="kv_both",
                    kv_connector_extra_config=extra,
                    kv_load_failure_policy="recompute",
                ),
                device_config=DeviceConfig("cpu"),
            )
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        page = 2 * HEADS * BLOCK * DIM * 2
        layout = KVCacheLayout.BLHNC
        kv_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=page * num_blocks * LAYERS,
                    layers=names,
                    layer_stride=page,
                    block_stride=page * LAYERS,
                )
            ],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    names,
                    FullAttentionSpec(
                        block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float16
                    ),
                )
            ],
        )
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
        )
        self.worker = LMTierConnector(config, KVConnectorRole.WORKER, kv_config)
        self.kv = allocate_kv_cache(kv_config, torch.device("cpu"), layout)
        self.worker.register_kv_caches(self.kv)
        self.names = names
        self.work = work
        self.clock = _Clock()
        self.clock.wrap(self.worker, WORKER_CALLS)
        if self.scheduler.connector is not None:
            self.clock.wrap(self.scheduler.connector, SCHEDULER_CALLS)
        init_none_hash(sha256_cbor)
        self.hasher = get_request_block_hasher(BLOCK, sha256_cbor)

    def add(self, req_id: str, tokens: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(req_id, tokens, params, None, block_hasher=self.hasher)
        self.scheduler.add_request(request)

    def step(self) -> tuple[SchedulerOutput, float]:
        """One engine step (schedule, connector around the forward pass, output back);
        its wall time in seconds."""
        started = time.perf_counter()
        out = self.scheduler.schedule()
        worker = self.worker
        worker.bind_connector_metadata(out.kv_connector_metadata)
        if out.has_sync_kv_loads:
            worker.start_load_kv(None)  # type: ignore[arg-type]
        for name in self.names:
            worker.wait_for_layer_load(name)
            if out.total_num_scheduled_tokens:
                torch.mm(self.work, self.work)
            worker.save_kv_layer(name, self.kv[name], None)  # type: ignore[arg-type]
        if not out.has_sync_kv_loads:
            worker.start_load_kv(None)  # type: ignore[arg-type]
        worker.wait_for_save()
        sending, receiving = worker.get_finished(out.finished_req_ids)
        kv_output = KVConnectorOutput(
            finished_sending=sending,
            finished_recving=receiving,
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
        )
        worker.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        requests = self.scheduler.requests
        sampled = [
            [7] if requests[r].num_computed_tokens >= requests[r].num_tokens else []
            for r in req_ids
        ]
        self.scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled,
                kv_connector_output=kv_output,
            ),
        )
        return out, time.perf_counter() - started

    def close(self) -> None:
        self.worker.shutdown()
        connector = self.scheduler.connector
        if connector is not None:
            connector.shutdown()


def _calibrated_work() -> torch.Tensor:
    """A square matrix whose product with itself takes ~2 ms here (one layer's work)."""
    size = 128
    while size < 4096:
        work = torch.randn(size, size)
        torch.mm(work, work)
        started = time.perf_counter()
        torch.mm(work, work)
        if time.perf_counter() - started >= 0.002:
            return work
        size = int(size * 1.25)
    return torch.randn(size, size)


def _mode(
    model: Path, disk: Path, mode: str, hit: int, capacity: str, work: torch.Tensor, decode: int
) -> dict[str, Any]:
    extra = {"config": _lmtier(disk, capacity), "async_loads": mode}
    num_blocks = hit // BLOCK + RUNNING * 64 + 64
    engine = _Engine(model, extra, num_blocks, 4096, work)
    try:
        for index in range(RUNNING):
            engine.add(f"run{index}", [(index * 31 + t) % 32000 for t in range(100)], 10_000)
        for _ in range(3):
            engine.step()  # the eight prefill, then decode
        baseline = statistics.median(engine.step()[1] for _ in range(decode))
        prompt = _prompt(hit)
        engine.add("hit", [*prompt, 5], 4)
        engine.clock.take()
        started = time.perf_counter()
        out, admitting = engine.step()
        connector = engine.clock.take()
        steps = [admitting]
        while "hit" not in out.num_scheduled_tokens:
            out, seconds = engine.step()
            steps.append(seconds)
            if len(steps) > 10_000:
                raise RuntimeError("the request with the hit was never scheduled")
        ready = time.perf_counter() - started
        during = steps[1:-1] or steps[:1]
        cached = engine.scheduler.requests["hit"].num_computed_tokens
        return {
            "baseline_step_ms": round(1e3 * baseline, 2),
            "admit_step_ms": round(1e3 * admitting, 2),
            "admit_connector_ms": round(1e3 * connector, 2),
            "steps_during_load_ms": round(1e3 * statistics.median(during), 2),
            "worst_wait_ms": round(1e3 * max(steps[:-1] or steps), 2),
            "steps_until_computed": len(steps) - 1,
            "ready_ms": round(1e3 * ready, 1),
            "loaded_tokens": cached - out.num_scheduled_tokens["hit"],
        }
    finally:
        engine.close()


def _lmtier(disk: Path, capacity: str) -> dict[str, Any]:
    return {
        "chunk_size": CHUNK,
        "cpu": {"capacity_bytes": capacity},
        "disk": {"path": str(disk), "capacity_bytes": "2GiB"},
    }


def _prompt(hit: int) -> list[int]:
    return [(t * 7919 + 17) % 32000 for t in range(hit)]


def step_bench(hit: int = 32768, decode: int = 20) -> dict[str, Any]:
    """Store a ``hit``-token prompt on disk, then admit it into engines that are
    decoding, with synchronous and with asynchronous loads (module docstring)."""
    work = _calibrated_work()
    with tempfile.TemporaryDirectory(prefix="lmtier-step-") as root:
        model = _model_dir(Path(root))
        disk = Path(root) / "disk"
        writer = _Engine(
            model,
            {"config": _lmtier(disk, "1GiB")},
            hit // BLOCK + 64,
            hit + 64,
            work,
        )
        try:
            writer.add("w", [*_prompt(hit), 5], 1)
            writer.step()
            writer.worker._work()._writer.submit(lambda: None).result()
            writer.worker.lmtier.flush()
        finally:
            writer.close()
        # Distinct CPU capacities: each mode gets its own cache (an empty CPU tier).
        sync = _mode(model, disk, "never", hit, "48MiB", work, decode)
        asyn = _mode(model, disk, "auto", hit, "40MiB", work, decode)
    return {
        "hit_tokens": hit,
        "kv_bytes": hit * 2 * LAYERS * HEADS * DIM * 2,
        "running_requests": RUNNING,
        "sync": sync,
        "async": asyn,
        "async_admit_vs_baseline": round(asyn["admit_step_ms"] / asyn["baseline_step_ms"], 3),
        "async_connector_share_of_baseline": round(
            asyn["admit_connector_ms"] / asyn["baseline_step_ms"], 3
        ),
        "async_during_vs_baseline": round(
            asyn["steps_during_load_ms"] / asyn["baseline_step_ms"], 3
        ),
        "async_worst_vs_baseline": round(asyn["worst_wait_ms"] / asyn["baseline_step_ms"], 3),
        "sync_admit_vs_baseline": round(sync["admit_step_ms"] / sync["baseline_step_ms"], 3),
    }
