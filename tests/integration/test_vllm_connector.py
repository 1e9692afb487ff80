"""LMTierConnector against vLLM's real Scheduler and real KV tensors in vLLM's layout.

The scheduler side runs inside ``vllm.v1.core.sched.scheduler.Scheduler`` (a VllmConfig
from a tiny local Llama config.json, no hub). The worker side gets KV tensors made by
vLLM's own ``allocate_kv_cache`` (strided ``[B, H, N, C]`` views of one int8 buffer);
a fake forward pass writes deterministic KV into the scheduled tokens' slots.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

for _name, _value in {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}.items():
    os.environ.setdefault(_name, _value)

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
    from vllm.distributed.kv_events import BlockStored
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorRole,
    )
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
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.utils import allocate_kv_cache

    from lmtier_connector.vllm_connector import LMTierConnector
    from lmtier_connector.vllm_meta import LMTierConnectorMetadata, chunk_keys, lookup_keys

LAYERS, HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, CHUNK = 2, 2, 16, 16, 128, 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
PAGE = 2 * HEADS * BLOCK * HEAD_DIM * 4  # one layer's block, fp32, K and V


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HEADS * 2 * HEAD_DIM,
        "intermediate_size": 128,
        "num_attention_heads": HEADS * 2,
        "num_key_value_heads": HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": LAYERS,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def lmtier_overrides(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "chunk_size": CHUNK,
        "cpu": {"capacity_bytes": "64MiB"},
        "disk": {"path": str(tmp_path / "disk")},
    }
    config.update(extra)
    return config


def make_vllm_config(model_dir: Path, extra: dict[str, Any]) -> VllmConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = ModelConfig(
            model=str(model_dir),
            tokenizer=str(model_dir),
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=4096,
        )
        cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
        cache.num_gpu_blocks = NUM_BLOCKS
        return VllmConfig(
            model_config=model,
            cache_config=cache,
            scheduler_config=SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=4096,
                max_model_len=4096,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="LMTierConnector",
                kv_connector_module_path="lmtier_connector.vllm_connector",
                kv_role="kv_both",
                kv_connector_extra_config=extra,
            ),
            device_config=DeviceConfig("cpu"),
        )


def kv_cache_config(layout: KVCacheLayout) -> KVCacheConfig:
    compact = layout.is_layer_compact
    tensor = KVCacheTensor(
        size=PAGE * NUM_BLOCKS * LAYERS,
        layers=list(NAMES),
        layer_stride=PAGE * NUM_BLOCKS if compact else PAGE,
        block_stride=PAGE if compact else PAGE * LAYERS,
    )
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(list(NAMES), spec)],
    )


class Engine:
    """A real Scheduler with our connector, plus one worker connector on real tensors."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        layout: KVCacheLayout = KVCacheLayout.BLHNC,
        worker_config: VllmConfig | None = None,
    ) -> None:
        config = kv_cache_config(layout)
        self.scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK,
        )
        self.worker = LMTierConnector(worker_config or vllm_config, KVConnectorRole.WORKER, config)
        self.kv = allocate_kv_cache(config, torch.device("cpu"), layout)
        self.worker.register_kv_caches(self.kv)
        init_none_hash(sha256_cbor)
        self.hasher = get_request_block_hasher(BLOCK, sha256_cbor)

    @property
    def connector(self) -> LMTierConnector:
        connector = self.scheduler.connector
        assert isinstance(connector, LMTierConnector)
        return connector

    def add(self, req_id: str, tokens: list[int]) -> Request:
        request = Request(
            req_id, tokens, SamplingParams(max_tokens=4), None, block_hasher=self.hasher
        )
        self.scheduler.add_request(request)
        return request

    def step(self) -> tuple[SchedulerOutput, LMTierConnectorMetadata]:
        """Schedule, then run the worker connector around a fake forward pass."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, LMTierConnectorMetadata)
        worker = self.worker
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)  # type: ignore[arg-type]
        for layer, name in enumerate(NAMES):
            worker.wait_for_layer_load(name)
            self.compute(out, layer)
            worker.save_kv_layer(name, self.kv[name], None)  # type: ignore[arg-type]
        worker.wait_for_save()
        worker.clear_connector_metadata()
        return out, meta

    def compute(self, out: SchedulerOutput, layer: int) -> None:
        """Write the KV a model would write for every scheduled token (new requests)."""
        for new in out.scheduled_new_reqs:
            tokens = new.prompt_token_ids or []
            start = new.num_computed_tokens
            stop = start + out.num_scheduled_tokens[new.req_id]
            for pos in range(start, stop):
                block = new.block_ids[0][pos // BLOCK]
                self.kv[NAMES[layer]][block, :, pos % BLOCK, :] = expected_kv(
                    tokens[pos], pos, layer
                )

    def page_tokens(self, request: Request, start: int, stop: int, layer: int) -> torch.Tensor:
        ids = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
        rows = [self.kv[NAMES[layer]][ids[p // BLOCK], :, p % BLOCK, :] for p in range(start, stop)]
        return torch.stack(rows)

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()


def expected_kv(token: int, pos: int, layer: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(pos * 7919 + token * 31 + layer)
    return torch.randn(HEADS, 2 * HEAD_DIM, generator=gen)


def expected_tokens(tokens: list[int], start: int, stop: int, layer: int) -> torch.Tensor:
    return torch.stack([expected_kv(tokens[p], p, layer) for p in range(start, stop)])


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


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


PREFIX = [(i * 37 + 11) % 1000 for i in range(300)]


def test_the_factory_builds_our_connector(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    engine = Engine(make_vllm_config(model_dir, {"config": lmtier_overrides(tmp_path)}))
    engines.append(engine)
    assert isinstance(engine.connector, KVConnectorBase_V1)
    assert engine.worker.lmtier is engine.connector.lmtier  # one process: one cache


def test_saves_then_a_fresh_scheduler_loads_bit_exact(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    extra = {"config": lmtier_overrides(tmp_path)}
    first = Engine(make_vllm_config(model_dir, extra), KVCacheLayout.BLHNC)
    engines.append(first)
    prompt = PREFIX[:200]
    first.add("a", prompt)
    _, meta = first.step()
    assert meta.loads == []
    (save,) = meta.saves
    assert (save.refs.first_chunk, save.refs.num_chunks) == (0, 200 // CHUNK)
    events = list(first.connector.take_events())
    assert isinstance(events[0], BlockStored) and len(events[0].block_hashes) == 12
    finish(first, "a")
    assert drain_finished(first, {"a"}) == {"a"}

    # A fresh scheduler (empty vLLM prefix cache) with other page strides, same tiers.
    second = Engine(make_vllm_config(model_dir, extra), KVCacheLayout.LBHNC)
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
    extra = {"config": lmtier_overrides(tmp_path, cpu={"enabled": False})}
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
    matched, _ = second.connector.get_num_new_matched_tokens(request, 0)
    assert matched == 192
    for path in files:  # flip a payload byte of every chunk: checksums fail on read
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    _, meta = second.step()
    (load,) = meta.loads
    assert second.worker.get_block_ids_with_load_errors() == set(load.block_ids[:12])


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
    assert lookup_keys(cache, keys) == 0  # not stored while the save is in flight
    gate.set()
    work._writer.submit(lambda: None).result()  # the save thread has run the save
    assert engine.worker.get_finished(set()) == ({"a"}, None)
    assert lookup_keys(cache, keys) == 3
