"""LMTierConnector's second version under vLLM's real Scheduler: asynchronous loads
from disk and a real redis-server, lookups that answer "not yet", faults mid-load,
preemption during a load, chunked prefill with saves, both step orders of vLLM's
model runner, and the refusal of chunked local attention beside full attention.

Each engine step is the whole loop vLLM's engine core runs (:meth:`Engine.run_step`):
schedule, the worker around a fake forward pass in the runner's order, and the
runner's output (finished transfers, load errors) back into the scheduler.
"""

from __future__ import annotations

import importlib.util
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.request import Request, RequestStatus

    from lmtier.errors import ConfigError
    from lmtier.kv_spec import payload_tensor
    from lmtier_connector.vllm.common import ConnectorSettings, chunk_keys
    from lmtier_connector.vllm.connector import LMTierConnector
    from support.redis_servers import RedisServer, redis_server
    from support.vllm_helpers import (
        BLOCK,
        CHUNK,
        HEAD_DIM,
        HEADS,
        LAYERS,
        NAMES,
        PREFIX,
        Engine,
        drain_finished,
        expected_tokens,
        finish,
        lmtier_overrides,
        make_vllm_config,
        resumed_req_ids,
        worker_step,
    )

__all__ = ["redis_server"]  # the module-scoped fixture, imported for this module

PROMPT = PREFIX[:200]  # three 64-token chunks and 8 tokens


@pytest.fixture
def hold(engines: list[Engine]) -> Iterator[Callable[[Any], threading.Event]]:
    """``hold(executor)`` holds that thread pool's thread (what is submitted after waits)
    until the returned gate is set; a gate a failed test left closed is set at teardown,
    before the engines close (their close waits for those threads)."""
    gates: list[threading.Event] = []

    def hold_(executor: Any) -> threading.Event:
        gate = threading.Event()
        executor.submit(gate.wait)
        gates.append(gate)
        return gate

    yield hold_
    for gate in gates:
        gate.set()


def engine(engines: list[Engine], model_dir: Path, config: dict[str, Any], **extra: Any) -> Engine:
    """An engine whose ``auto`` loads every hit below host memory in the background (a
    zero read budget: these tests exercise that path; test_vllm_load_paths.py tests the
    choice)."""
    extra.setdefault("sync_load_max_ms", 0)
    made = Engine(make_vllm_config(model_dir, {"config": config, **extra}))
    engines.append(made)
    return made


def save_prompt(writer: Engine, tokens: list[int] = PROMPT) -> None:
    """The writer computes ``tokens``, saves its chunks and flushes them below memory."""
    writer.add("w", tokens)
    run_until_scheduled(writer, "w")  # a first Redis lookup may answer "not yet"
    finish(writer, "w")
    assert drain_finished(writer, {"w"}) == {"w"}
    writer.connector.lmtier.flush()


def run_until_scheduled(engine: Engine, req_id: str, steps: int = 20) -> SchedulerOutput:
    """Whole engine steps until ``req_id`` computes; the step that scheduled it."""
    for _ in range(steps):
        engine.worker._work().loader.wait()  # the load in flight has landed
        pending = engine.connector._sched()._lookups.get(req_id)
        if pending is not None:  # a lookup answered "not yet": its answer is coming
            pending.future.result(timeout=120)
        out, _ = engine.run_step()
        if req_id in out.num_scheduled_tokens:
            return out
    raise AssertionError(f"{req_id} was not scheduled in {steps} steps")


def slab_tokens(handle: Any, meta: Any, layer: int) -> torch.Tensor:
    """One layer of a chunk in a slab as ``[tokens, heads, 2 * head_dim]`` (K then V),
    whatever its layout."""
    chunk = payload_tensor(handle, meta)[layer]
    if meta.layout == "LBHSC":  # (blocks, heads, slots, 2D)
        return chunk.permute(0, 2, 1, 3).reshape(CHUNK, HEADS, 2 * HEAD_DIM)
    if meta.layout == "LBSHC":  # (blocks, slots, heads, 2D)
        return chunk.reshape(CHUNK, HEADS, 2 * HEAD_DIM)
    assert meta.layout == "LKTHD"  # (2, tokens, heads, D)
    return chunk.permute(1, 2, 0, 3).reshape(CHUNK, HEADS, 2 * HEAD_DIM)


def assert_pages(engine: Engine, request: Request, tokens: list[int], stop: int) -> None:
    for layer in range(LAYERS):
        got = engine.page_tokens(request, 0, stop, layer)
        assert torch.equal(got, expected_tokens(tokens, 0, stop, layer))


# ---- asynchronous loads -------------------------------------------------------------


def test_a_disk_hit_loads_in_the_background_while_the_request_waits(
    model_dir: Path, tmp_path: Path, engines: list[Engine], hold: Callable[[Any], threading.Event]
) -> None:
    save_prompt(engine(engines, model_dir, lmtier_overrides(tmp_path)))
    # Another cache (its own, empty CPU tier) over the same disk tier.
    reader = engine(engines, model_dir, lmtier_overrides(tmp_path, cpu={"capacity_bytes": "32MiB"}))
    tokens = [*PROMPT, 5, 6, 7]
    request = reader.add("b", tokens)
    assert reader.connector.get_num_new_matched_tokens(request, 0) == (192, True)
    gate = hold(reader.worker._work().loader._thread)
    out, meta = reader.run_step()
    (load,) = meta.loads
    assert load.asynchronous and (load.start_token, load.end_token) == (0, 192)
    assert out.num_scheduled_tokens == {} and not out.has_sync_kv_loads
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    out, _ = reader.run_step()  # the load is in flight: the request keeps waiting
    assert out.num_scheduled_tokens == {}
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    gate.set()
    out = run_until_scheduled(reader, "b")
    (new,) = out.scheduled_new_reqs
    assert (new.num_computed_tokens, out.num_scheduled_tokens["b"]) == (192, len(tokens) - 192)
    assert_pages(reader, request, tokens, len(tokens))  # loaded, then computed after it
    assert reader.worker.get_block_ids_with_load_errors() == set()


def test_a_request_aborted_during_its_load_frees_its_blocks_once_the_load_is_done(
    model_dir: Path, tmp_path: Path, engines: list[Engine], hold: Callable[[Any], threading.Event]
) -> None:
    save_prompt(engine(engines, model_dir, lmtier_overrides(tmp_path)))
    reader = engine(engines, model_dir, lmtier_overrides(tmp_path, cpu={"capacity_bytes": "32MiB"}))
    pool = reader.scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    request = reader.add("b", [*PROMPT, 5])
    gate = hold(reader.worker._work().loader._thread)  # the load stays in flight
    reader.run_step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    finish(reader, "b")  # the client went away
    reader.run_step()
    assert pool.get_num_free_blocks() < free  # the load may still write them: held
    gate.set()
    reader.worker._work().loader.wait()
    out, _ = reader.run_step()  # the worker reports the load; vLLM frees the blocks
    assert out.num_scheduled_tokens == {}
    assert pool.get_num_free_blocks() == free


def test_host_memory_hits_stay_synchronous_and_never_makes_every_load_so(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    config = lmtier_overrides(tmp_path)
    writer = engine(engines, model_dir, config)
    save_prompt(writer)
    request = writer.add("b", [*PROMPT, 1])  # the same cache: a CPU tier hit
    assert writer.connector.get_num_new_matched_tokens(request, 0) == (192, False)
    never = engine(
        engines, model_dir, lmtier_overrides(tmp_path, cpu={"enabled": False}), async_loads="never"
    )
    request = never.add("c", [*PROMPT, 1])
    assert never.connector.get_num_new_matched_tokens(request, 0) == (192, False)
    out, meta = never.run_step()
    assert out.has_sync_kv_loads and not meta.loads[0].asynchronous
    assert_pages(never, request, [*PROMPT, 1], 192)
    with pytest.raises(ConfigError, match="async_loads"):
        ConnectorSettings.from_extra_config({"async_loads": "sometimes"})
    with pytest.raises(ConfigError, match="lookup_wait_ms"):
        ConnectorSettings.from_extra_config({"lookup_wait_ms": -1})


def redis_config(tmp_path: Path, url: str, **extra: Any) -> dict[str, Any]:
    return lmtier_overrides(tmp_path, disk={"enabled": False}, redis={"url": url}, **extra)


def test_a_redis_hit_loads_asynchronously_bit_exact(
    model_dir: Path, tmp_path: Path, engines: list[Engine], redis_server: RedisServer
) -> None:
    save_prompt(engine(engines, model_dir, redis_config(tmp_path, redis_server.url)))
    reader_config = redis_config(tmp_path, redis_server.url, cpu={"capacity_bytes": "32MiB"})
    reader = engine(engines, model_dir, reader_config)
    cache = reader.connector.lmtier
    request = reader.add("b", [*PROMPT, 5])
    found = reader.connector.get_num_new_matched_tokens(request, 0)
    if found[0] is None:  # a lookup slower than lookup_wait_ms: asked again
        reader.connector._sched()._lookups["b"].future.result(timeout=120)
        found = reader.connector.get_num_new_matched_tokens(request, 0)
    assert found == (192, True)
    keys = chunk_keys(cache, reader.connector._sched().refs(request, 0, 3))
    assert [s.tier for s in cache.lookup_keys(keys).spans] == ["redis"]
    _, meta = reader.run_step()
    assert meta.loads[0].asynchronous
    run_until_scheduled(reader, "b")
    assert_pages(reader, request, [*PROMPT, 5], 193)


def test_a_slow_lookup_answers_not_yet_and_the_scheduler_goes_on(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    with RedisServer(tmp_path / "redis") as server:
        save_prompt(engine(engines, model_dir, redis_config(tmp_path, server.url)))
        config = redis_config(tmp_path, server.url, cpu={"capacity_bytes": "32MiB"})
        config["redis"]["timeout_s"] = 60
        reader = engine(engines, model_dir, config, lookup_wait_ms=0)
        other = reader.add("other", [(i * 7 + 3) % 1000 for i in range(40)])  # no hit
        server.pause()  # Redis hangs: the lookup cannot finish
        try:
            request = reader.add("b", [*PROMPT, 5])
            out, _ = reader.run_step()
            assert request.status == RequestStatus.WAITING  # "not yet": skipped...
            assert "other" in out.num_scheduled_tokens  # ...the others are scheduled
            assert other.status == RequestStatus.RUNNING
            out, _ = reader.run_step()
            assert "b" not in out.num_scheduled_tokens
        finally:
            server.resume()
        reader.connector._sched()._lookups["b"].future.result(timeout=120)
        out, meta = reader.run_step()  # the answer that came in the background
        (load,) = meta.loads
        assert load.asynchronous and (load.start_token, load.end_token) == (0, 192)
        run_until_scheduled(reader, "b")
        assert_pages(reader, request, [*PROMPT, 5], 193)


def test_a_redis_killed_mid_load_costs_a_recompute_not_a_failed_request(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    with RedisServer(tmp_path / "redis") as server:
        save_prompt(engine(engines, model_dir, redis_config(tmp_path, server.url)))
        config = redis_config(tmp_path, server.url, cpu={"capacity_bytes": "32MiB"})
        config["redis"]["timeout_s"] = 0.5
        reader = engine(engines, model_dir, config, lookup_wait_ms=10_000)
        tokens = [*PROMPT, 5]
        request = reader.add("b", tokens)
        out, meta = reader.run_step(before_worker=server.kill)  # planned, then Redis dies
        (load,) = meta.loads
        assert load.asynchronous
        out = run_until_scheduled(reader, "b")
        # vLLM learnt which blocks failed and recomputes the request from token 0.
        (new,) = out.scheduled_new_reqs
        assert (new.num_computed_tokens, out.num_scheduled_tokens["b"]) == (0, len(tokens))
        assert_pages(reader, request, tokens, len(tokens))
        for _ in range(10):
            if request.is_finished():
                break
            reader.run_step()
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


# ---- preemption, chunked prefill, step orders --------------------------------------------


def test_preemption_while_a_load_is_in_flight(
    model_dir: Path, tmp_path: Path, engines: list[Engine], hold: Callable[[Any], threading.Event]
) -> None:
    save_prompt(engine(engines, model_dir, lmtier_overrides(tmp_path)))
    config = lmtier_overrides(tmp_path, cpu={"capacity_bytes": "32MiB"})
    extra = {"config": config, "sync_load_max_ms": 0}  # a disk hit loads in the background
    reader = Engine(make_vllm_config(model_dir, extra, num_blocks=30))
    engines.append(reader)
    other_tokens = [(i * 11 + 2) % 1000 for i in range(200)]
    other = reader.add("x", other_tokens, max_tokens=200)  # 13 blocks, then grows
    reader.run_step()
    assert other.status == RequestStatus.RUNNING
    request = reader.add("b", [*PROMPT, 5])  # 13 blocks, loaded from disk
    gate = hold(reader.worker._work().loader._thread)
    reader.run_step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    preempted = False
    for _ in range(100):  # "x" decodes until the pool runs out of blocks
        out, meta = reader.run_step()
        if "x" in meta.preempted_req_ids:
            preempted = True
            break
    assert preempted and other.status == RequestStatus.PREEMPTED
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # never preempted
    gate.set()
    run_until_scheduled(reader, "b")
    assert_pages(reader, request, [*PROMPT, 5], 193)
    # The preempted request comes back with its own saved chunks, bit-exact.
    out = run_until_scheduled(reader, "x", steps=40)
    assert resumed_req_ids(reader.scheduler, out) == {"x"}
    assert_pages(reader, other, other_tokens, 192)


def test_chunked_prefill_saves_each_chunk_in_the_step_that_completes_it(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    config = lmtier_overrides(tmp_path)
    writer = Engine(make_vllm_config(model_dir, {"config": config}, max_batched_tokens=48))
    engines.append(writer)
    writer.add("a", PROMPT)
    planned = []
    for _ in range(5):  # 200 tokens, 48 per step
        _, meta = writer.run_step()
        planned.append([(s.refs.first_chunk, s.refs.num_chunks) for s in meta.saves])
    # The steps end at tokens 48, 96, 144, 192 and 200.
    assert planned == [[], [(0, 1)], [(1, 1)], [(2, 1)], []]
    finish(writer, "a")
    assert drain_finished(writer, {"a"}) == {"a"}
    writer.connector.lmtier.flush()
    reader = engine(engines, model_dir, lmtier_overrides(tmp_path, cpu={"capacity_bytes": "32MiB"}))
    request = reader.add("b", [*PROMPT, 5])
    reader.run_step()
    run_until_scheduled(reader, "b")
    assert_pages(reader, request, [*PROMPT, 5], 193)


@pytest.mark.parametrize("chunk_layout", ["page", "LKTHD"])
@pytest.mark.parametrize("loads_first", [True, False], ids=["loads-first", "loads-after"])
def test_saves_copy_each_layer_during_the_forward_pass_in_both_step_orders(
    model_dir: Path, tmp_path: Path, engines: list[Engine], loads_first: bool, chunk_layout: str
) -> None:
    writer = engine(engines, model_dir, lmtier_overrides(tmp_path), chunk_layout=chunk_layout)
    writer.add("a", PROMPT)
    out = writer.scheduler.schedule()
    assert not out.has_sync_kv_loads  # vLLM calls start_load_kv after this forward pass
    connector, work = writer.worker, writer.worker._work()
    gate = threading.Event()
    work._writer.submit(gate.wait)  # keep the slabs unsealed for inspection
    try:
        connector.bind_connector_metadata(out.kv_connector_metadata)
        if loads_first:
            connector.start_load_kv(None)  # type: ignore[arg-type]
        step = work._save
        assert step is not None and len(step.slabs) == 3
        from support.vllm_helpers import fake_forward

        for layer, name in enumerate(NAMES):
            connector.wait_for_layer_load(name)
            fake_forward(writer.kv, out, layer)
            connector.save_kv_layer(name, writer.kv[name], None)  # type: ignore[arg-type]
            assert step.handle.pending_layers == list(range(layer + 1, LAYERS))
            for index, slab in enumerate(step.slabs):  # layer `layer` is in the slab now
                want = expected_tokens(PROMPT, index * CHUNK, (index + 1) * CHUNK, layer)
                assert torch.equal(slab_tokens(slab.handle, slab.meta, layer), want)
        if not loads_first:
            connector.start_load_kv(None)  # type: ignore[arg-type]
        connector.wait_for_save()
        connector.clear_connector_metadata()
    finally:
        gate.set()
    finish(writer, "a")
    assert drain_finished(writer, {"a"}) == {"a"}


def test_worker_step_follows_the_runner_order(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    """The helper every test uses drives the connector as vLLM's runner does."""
    writer = engine(engines, model_dir, lmtier_overrides(tmp_path))
    writer.add("a", PROMPT)
    out = writer.scheduler.schedule()
    calls: list[str] = []
    original = writer.worker.start_load_kv

    def spy(*args: Any, **kwargs: Any) -> None:
        calls.append(f"load after {len(calls)} saves")
        original(*args, **kwargs)

    save = writer.worker.save_kv_layer

    def save_spy(*args: Any, **kwargs: Any) -> None:
        calls.append("save")
        save(*args, **kwargs)

    writer.worker.start_load_kv = spy  # type: ignore[method-assign]
    writer.worker.save_kv_layer = save_spy  # type: ignore[method-assign]
    worker_step(writer.worker, writer.kv, out)
    assert calls == ["save", "save", f"load after {LAYERS} saves"]


# ---- hybrid models -----------------------------------------------------------------------


def test_chunked_local_hybrid_models_are_refused_at_startup(
    model_dir: Path, tmp_path: Path
) -> None:
    """Full attention beside sliding window is cached (test_vllm_hybrid.py); chunked
    local attention is not."""
    full = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32
    )
    window = ChunkedLocalAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_size=HEAD_DIM,
        dtype=torch.float32,
        attention_chunk_size=128,
    )
    config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([NAMES[0]], full),
            KVCacheGroupSpec([NAMES[1]], window),
        ],
    )
    vllm_config = make_vllm_config(model_dir, {"config": lmtier_overrides(tmp_path)})
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match=r"2 group\(s\).*ChunkedLocalAttentionSpec") as raised:
            LMTierConnector(vllm_config, role, config)
        assert "FullAttentionSpec over 1 layers (model.layers.0" in str(raised.value)
