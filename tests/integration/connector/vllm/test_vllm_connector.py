"""LMTierConnector against vLLM's real Scheduler and real KV tensors in vLLM's layout.

The scheduler side runs inside ``vllm.v1.core.sched.scheduler.Scheduler`` (a VllmConfig
from a tiny local Llama config.json, no hub). The worker side gets KV tensors made by
vLLM's own ``allocate_kv_cache`` (strided ``[B, H, N, C]`` views of one int8 buffer);
a fake forward pass writes deterministic KV into the scheduled tokens' slots.
Tensor parallelism and MLA: ``test_vllm_connector_tp.py``.
"""

from __future__ import annotations

import importlib.util
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)


with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.request import Request

    from lmtier.api import LMTier
    from lmtier.config import load_config
    from lmtier.errors import ConfigError
    from lmtier.kv_spec import KVSpec
    from lmtier_connector.vllm.common import ConnectorSettings, chunk_keys
    from lmtier_connector.vllm.connector import kv_spec_of as connector_kv_spec_of
    from support.vllm_helpers import (
        BLOCK,
        CHUNK,
        HEAD_DIM,
        HEADS,
        LAYERS,
        PREFIX,
        Engine,
        deliver_events,
        drain_finished,
        expected_tokens,
        finish,
        kv_cache_config,
        lmtier_overrides,
        make_vllm_config,
    )


def test_the_factory_builds_our_connector(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    engine = Engine(make_vllm_config(model_dir, {"config": lmtier_overrides(tmp_path)}))
    engines.append(engine)
    assert isinstance(engine.connector, KVConnectorBase_V1)
    assert engine.worker.lmtier is engine.connector.lmtier  # one process: one cache


@pytest.mark.parametrize("reader_layout", ["LBHNC", "BLNHC", "BHLNC"])
@pytest.mark.parametrize("chunk_layout", ["page", "LKTHD"])
def test_saves_then_a_fresh_scheduler_loads_bit_exact(
    model_dir: Path, tmp_path: Path, engines: list[Engine], chunk_layout: str, reader_layout: str
) -> None:
    extra = {"config": lmtier_overrides(tmp_path), "chunk_layout": chunk_layout}
    first = Engine(make_vllm_config(model_dir, extra), KVCacheLayout.BLHNC)
    engines.append(first)
    prompt = PREFIX[:200]
    first.add("a", prompt)
    _, meta = first.step()
    assert meta.loads == []
    (save,) = meta.saves
    assert (save.refs.first_chunk, save.refs.num_chunks) == (0, 200 // CHUNK)
    finish(first, "a")
    assert drain_finished(first, {"a"}) == {"a"}

    # A fresh scheduler (empty vLLM prefix cache) with other page strides, same tiers.
    second = Engine(make_vllm_config(model_dir, extra), KVCacheLayout[reader_layout])
    engines.append(second)
    request = second.add("b", [*PREFIX[:200], 5, 6, 7])
    matched, is_async = second.connector.get_num_new_matched_tokens(request, 0)
    assert (matched, is_async) == (192, False)
    _, meta = second.step()
    (load,) = meta.loads
    assert (load.start_token, load.end_token) == (0, 192)
    assert request.num_computed_tokens >= 192
    for layer in range(LAYERS):
        got = second.page_tokens(request, 0, 192, layer)
        assert torch.equal(got, expected_tokens(prompt, 0, 192, layer))
    assert second.worker.get_block_ids_with_load_errors() == set()


def test_hits_count_beyond_vllms_own_prefix_cache(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    extra = {"config": lmtier_overrides(tmp_path)}
    first = Engine(make_vllm_config(model_dir, extra))
    engines.append(first)
    first.add("long", PREFIX[:300])
    first.step()  # stores chunks 0..3 (256 tokens)

    second = Engine(make_vllm_config(model_dir, extra))
    engines.append(second)
    second.add("short", PREFIX[:150])  # vLLM caches 9 full blocks = 144 tokens
    second.step()
    request = second.add("tail", [*PREFIX[:256], 1])  # 257 tokens: last one recomputed
    out, meta = second.step()
    (load,) = (spec for spec in meta.loads if spec.req_id == "tail")
    assert (load.start_token, load.end_token) == (144, 256)  # starts inside chunk 2
    (new,) = out.scheduled_new_reqs
    assert (new.num_computed_tokens, out.num_scheduled_tokens["tail"]) == (256, 1)
    for layer in range(LAYERS):
        got = second.page_tokens(request, 0, 256, layer)
        assert torch.equal(got, expected_tokens(PREFIX, 0, 256, layer))
    # Whole prompt cached: still never the last token.
    again = Request(
        "x", PREFIX[:256], SamplingParams(max_tokens=1), None, block_hasher=second.hasher
    )
    assert second.connector.get_num_new_matched_tokens(again, 0) == (192, False)


def test_chunks_of_vllms_own_prefix_cache_hit_get_no_save_plan(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    """They were saved when this engine computed them: a plan for them would only hold
    the request's blocks one step longer (request_finished True) for a save the
    worker skips."""
    engine = Engine(make_vllm_config(model_dir, {"config": lmtier_overrides(tmp_path)}))
    engines.append(engine)
    engine.add("first", PREFIX[:200], max_tokens=8)
    _, meta = engine.run_step()
    assert [save.req_id for save in meta.saves] == ["first"]  # chunks 0..2
    again = engine.add("again", [*PREFIX[:200], 9, 9])
    out, meta = engine.run_step()
    (new,) = (n for n in out.scheduled_new_reqs if n.req_id == "again")
    assert new.num_computed_tokens == 192  # vLLM's own hit: 12 blocks of 16, 3 chunks
    assert meta.saves == [] and meta.loads == []
    assert engine.connector.request_finished(again, []) == (False, None)


def test_xxh3_keys_mode(model_dir: Path, tmp_path: Path, engines: list[Engine]) -> None:
    extra = {"config": lmtier_overrides(tmp_path), "vllm_block_hashes": False}
    first = Engine(make_vllm_config(model_dir, extra))
    engines.append(first)
    first.add("a", PREFIX[:130])
    first.step()
    second = Engine(make_vllm_config(model_dir, extra))
    engines.append(second)
    request = second.add("b", PREFIX[:140])
    second.step()
    assert request.num_computed_tokens >= 128
    assert torch.equal(second.page_tokens(request, 0, 128, 1), expected_tokens(PREFIX, 0, 128, 1))


def test_a_down_tier_reports_load_errors_not_exceptions(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    good = {"config": lmtier_overrides(tmp_path)}
    down = {
        "config": {
            "chunk_size": CHUNK,
            "cpu": {"enabled": False},
            "disk": {"enabled": False},
            "redis": {"url": "redis://127.0.0.1:1/0", "timeout_s": 0.2},
        }
    }
    first = Engine(make_vllm_config(model_dir, good))
    engines.append(first)
    first.add("a", PREFIX[:200])
    first.step()
    # The scheduler sees the chunks; this worker's only tier is unreachable.
    second = Engine(
        make_vllm_config(model_dir, good), worker_config=make_vllm_config(model_dir, down)
    )
    engines.append(second)
    second.add("b", PREFIX[:200])
    _, meta = second.step()
    (load,) = meta.loads
    failed = second.worker.get_block_ids_with_load_errors()
    assert failed == set(load.block_ids[: 192 // BLOCK])
    assert second.worker.get_block_ids_with_load_errors() == set()


def test_a_corrupt_chunk_reports_its_blocks(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    # A zero read budget: the disk hit loads in the background (its errors come then).
    extra = {"config": lmtier_overrides(tmp_path, cpu={"enabled": False}), "sync_load_max_ms": 0}
    first = Engine(make_vllm_config(model_dir, extra))
    engines.append(first)
    first.add("a", PREFIX[:200])
    first.step()
    finish(first, "a")
    drain_finished(first, {"a"})
    first.connector.lmtier.flush()
    files = sorted((tmp_path / "disk").rglob("*.lmtc"), key=lambda p: p.stat().st_mtime)
    assert len(files) == 3
    second = Engine(make_vllm_config(model_dir, extra))
    engines.append(second)
    request = second.add("b", PREFIX[:200])
    assert second.connector.get_num_new_matched_tokens(request, 0) == (192, True)  # disk
    for path in files:  # flip a payload byte of every chunk: checksums fail on read
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    out, meta = second.step()
    (load,) = meta.loads
    assert load.asynchronous and out.num_scheduled_tokens == {}
    second.worker._work().loader.wait()
    assert second.worker.get_block_ids_with_load_errors() == set(load.block_ids[:12])
    assert second.worker.get_finished(set()) == (None, {"b"})


def test_finished_is_reported_only_once_saves_are_done(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    engine = Engine(make_vllm_config(model_dir, {"config": lmtier_overrides(tmp_path)}))
    engines.append(engine)
    engine.add("a", PREFIX[:200])
    work = engine.worker._work()
    gate = threading.Event()
    work._writer.submit(gate.wait)  # hold the save thread: the save stays in flight
    _, meta = engine.step()
    finish(engine, "a")
    assert engine.worker.get_finished({"a"}) == (None, None)
    cache = engine.connector.lmtier
    keys = chunk_keys(cache, meta.saves[0].refs)
    assert cache.lookup_keys(keys).num_chunks == 0  # not stored while the save is in flight
    gate.set()
    work._writer.submit(lambda: None).result()  # the save thread has run the save
    assert engine.worker.get_finished(set()) == ({"a"}, None)
    assert cache.lookup_keys(keys).num_chunks == 3


def test_block_stored_is_announced_once_the_chunks_are_stored(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    engine = Engine(make_vllm_config(model_dir, {"config": lmtier_overrides(tmp_path)}))
    engines.append(engine)
    request = engine.add("a", PREFIX[:200])
    work = engine.worker._work()
    gate = threading.Event()
    work._writer.submit(gate.wait)  # hold the save thread: planned, not stored
    engine.step()
    assert deliver_events(engine) == []
    gate.set()
    work._writer.submit(lambda: None).result()
    events = deliver_events(engine)
    assert [type(e) for e in events] == [BlockStored] * 3  # one per 64-token chunk
    hashes = [h for e in events for h in e.block_hashes]
    assert hashes == list(request.block_hashes[:12])
    assert [e.parent_block_hash for e in events] == [None, hashes[3], hashes[7]]
    assert [e.token_ids for e in events] == [PREFIX[i : i + CHUNK] for i in (0, 64, 128)]
    assert {(e.medium, e.block_size) for e in events} == {(MEDIUM_CPU, BLOCK)}
    assert deliver_events(engine) == []  # announced once
    # Chunks already stored are not saved again, hence not announced again.
    engine.add("b", PREFIX[:200])
    engine.step()
    work._writer.submit(lambda: None).result()
    assert deliver_events(engine) == []


def test_block_removed_is_announced_when_the_cpu_tier_evicts(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    slab = 2 * LAYERS * HEADS * HEAD_DIM * CHUNK * 4 + 4096  # one encoded chunk
    config = lmtier_overrides(tmp_path, cpu={"capacity_bytes": 2 * slab})  # two chunks
    engine = Engine(make_vllm_config(model_dir, {"config": config}))
    engines.append(engine)
    assert engine.worker.lmtier.host_memory().cache_capacity_chunks == 2
    first = engine.add("a", PREFIX[:200])  # three chunks in one step: the first is
    engine.step()  # evicted by the third while they are being put
    engine.worker._work()._writer.submit(lambda: None).result()
    events = deliver_events(engine)
    hashes = list(first.block_hashes[:12])
    assert [type(e) for e in events] == [BlockStored, BlockRemoved, BlockStored, BlockStored]
    assert events[0].block_hashes == events[1].block_hashes == hashes[:4]  # after its store
    assert events[1] == BlockRemoved(block_hashes=hashes[:4], medium=MEDIUM_CPU)
    # Another chunk evicts the least recently stored one: chunk 1 of "a".
    second = engine.add("b", [(i * 13 + 5) % 1000 for i in range(70)])
    engine.step()
    engine.worker._work()._writer.submit(lambda: None).result()
    events = deliver_events(engine)
    assert [type(e) for e in events] == [BlockRemoved, BlockStored]
    assert events[0] == BlockRemoved(block_hashes=hashes[4:8], medium=MEDIUM_CPU)
    assert events[1].block_hashes == list(second.block_hashes[:4])
    assert deliver_events(engine) == []
    # Evicted from the CPU tier only: the disk tier still serves every chunk.
    cache = engine.connector.lmtier
    cache.flush()
    keys = chunk_keys(cache, engine.connector._sched().refs(first, 0, 3))
    assert cache.lookup_keys(keys).num_chunks == 3


def test_chunk_layout_follows_the_page_order_vllm_resolved(model_dir: Path, tmp_path: Path) -> None:
    config = make_vllm_config(model_dir, {"config": lmtier_overrides(tmp_path)})

    def kv_spec_of(*args: Any) -> KVSpec:
        # The harness's GPU pages: what the connector takes from the config's declared
        # page_interior (kv_spec_of's own default is vLLM's platform, here cpu_attn).
        return connector_kv_spec_of(*args, page_interior="flash")

    assert kv_spec_of(config, "page") == KVSpec(
        LAYERS, HEADS, HEAD_DIM, "float32", "LBHSC", 16, page_interior="flash"
    )
    config.cache_config.kv_cache_layout = "BLNHC"  # slots before heads (NHD)
    assert kv_spec_of(config, "page").layout == "LBSHC"
    resolved = kv_cache_config(KVCacheLayout.LBHNC)
    resolved.kv_cache_layout = "LBHNC"  # what the engine core hands the workers wins
    assert kv_spec_of(config, "page", resolved).layout == "LBHSC"
    assert kv_spec_of(config, "LKTHD") == KVSpec(LAYERS, HEADS, HEAD_DIM, "float32")
    # The layout is part of the namespace: page chunks and LKTHD chunks never mix.
    caches = [
        LMTier(load_config(overrides={"chunk_size": CHUNK}), spec, model_id="m")
        for spec in (kv_spec_of(config, "page"), kv_spec_of(config, "LKTHD"))
    ]
    assert caches[0].namespace("") != caches[1].namespace("")
    with pytest.raises(ConfigError, match="chunk_layout"):
        ConnectorSettings.from_extra_config({"chunk_layout": "LBHSC"})


def test_a_refused_salt_is_one_line_once_and_a_miss(caplog: pytest.LogCaptureFixture) -> None:
    """A sidecar token that does not cover a request's cache_salt refuses every lookup
    of that salt: a miss each time, logged once in one line (it was a warning with a
    traceback per request)."""
    from lmtier.errors import PermissionDeniedError
    from lmtier_connector.vllm import lookups

    refusal = PermissionDeniedError("tenant-a may not use model 'm' under cache_salt 'b'")
    with caplog.at_level("DEBUG", logger=lookups.__name__):
        for request in ("r1", "r2", "r3"):
            lookups.lookup_failed(refusal, f"lookup for {request}")
    records = [r for r in caplog.records if r.name == lookups.__name__]
    assert len(records) == 1 and records[0].exc_info is None
    assert "tenant-a may not use" in records[0].getMessage()
