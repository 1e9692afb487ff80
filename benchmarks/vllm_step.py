"""The scheduler-step part of ``bench_vllm_connector.py``: what admitting a request
with a 32k-token hit on disk costs the requests already running.

vLLM's real Scheduler, our connector (both halves, one process), real per-layer KV
tensors from vLLM's ``allocate_kv_cache`` (the tests' scheduler harness,
``tests/support/vllm_helpers.py``, with this benchmark's :data:`GEOMETRY`), and a
stand-in forward pass (a fixed matmul per layer, calibrated to ~2 ms a layer, so a
step costs what a small decode step costs). A writer engine computes the 32k-token
prompt and stores its chunks on the disk tier; then, for each mode, a fresh reader
engine (its own, empty CPU tier) runs eight decoding requests and admits a request
whose whole prompt hits on disk:

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

import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

# The vLLM scheduler harness is the tests' (tests/support/vllm_helpers.py): benchmarks
# run from a checkout, so put its tests/ folder on the path, as pytest's pythonpath does.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.v1.core.sched.output import SchedulerOutput

    from support.vllm_helpers import Engine, Geometry, make_vllm_config, write_model_dir

__all__ = ["step_bench"]

RUNNING = 8
GEOMETRY = Geometry(
    kv_heads=8,
    head_dim=128,
    dtype="float16",
    max_model_len=65536,
    max_num_seqs=RUNNING + 2,
    vocab_size=32000,
)
"""Two layers of a Llama-8B-like rank (8 KV heads of 128, fp16), 64k tokens long."""
LAYERS, HEADS, DIM = GEOMETRY.layers, GEOMETRY.kv_heads, GEOMETRY.head_dim
BLOCK = GEOMETRY.block_size
CHUNK = 256
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


class _Engine(Engine):
    """The harness's engine (Scheduler + worker connector + KV tensors) with the
    connector's methods timed and the stand-in forward pass."""

    def __init__(
        self, model: Path, extra: dict[str, Any], num_blocks: int, batch: int, work: torch.Tensor
    ) -> None:
        config = make_vllm_config(
            model,
            extra,
            max_batched_tokens=batch,
            num_blocks=num_blocks,
            geometry=GEOMETRY,
            lookup_wait_ms=None,  # the connector's default, as a server runs it
            # A GPU engine's pages (FlashAttention's interior) on CPU torch: declared, as
            # vLLM's CPU platform would otherwise key them "cpu_attn".
            page_interior="flash",
        )
        super().__init__(config, geometry=GEOMETRY)
        self.work = work
        self.clock = _Clock()
        self.clock.wrap(self.worker, WORKER_CALLS)
        self.clock.wrap(self.connector, SCHEDULER_CALLS)

    def _forward(self, out: SchedulerOutput, layer: int) -> None:
        if out.total_num_scheduled_tokens:
            torch.mm(self.work, self.work)

    def timed_step(self) -> tuple[SchedulerOutput, float]:
        """One engine step (schedule, connector around the forward pass, output back);
        its wall time in seconds."""
        started = time.perf_counter()
        out, _ = self.run_step(forward=self._forward)
        return out, time.perf_counter() - started


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
            tokens = [(index * 31 + t) % 32000 for t in range(100)]
            engine.add(f"run{index}", tokens, 10_000, ignore_eos=True)
        for _ in range(3):
            engine.timed_step()  # the eight prefill, then decode
        baseline = statistics.median(engine.timed_step()[1] for _ in range(decode))
        prompt = _prompt(hit)
        engine.add("hit", [*prompt, 5], 4, ignore_eos=True)
        engine.clock.take()
        started = time.perf_counter()
        out, admitting = engine.timed_step()
        connector = engine.clock.take()
        steps = [admitting]
        while "hit" not in out.num_scheduled_tokens:
            out, seconds = engine.timed_step()
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
        model = write_model_dir(Path(root), geometry=GEOMETRY)
        disk = Path(root) / "disk"
        writer = _Engine(
            model,
            {"config": _lmtier(disk, "1GiB")},
            hit // BLOCK + 64,
            hit + 64,
            work,
        )
        try:
            writer.add("w", [*_prompt(hit), 5], 1, ignore_eos=True)
            writer.timed_step()
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
