"""LMTierConnector under tensor parallelism and MLA: worker connectors of two ranks
in one process, on real KV tensors shaped as each rank's shard (or MLA's latent).
"""

from __future__ import annotations

import importlib.util
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
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from lmtier_connector.vllm import connector as vllm_connector
    from lmtier_connector.vllm.common import (
        ChunkRefs,
        LMTierConnectorMetadata,
        LoadSpec,
        SaveSpec,
        chunk_keys,
    )
    from lmtier_connector.vllm.connector import LMTierConnector
    from support.vllm_helpers import (
        BLOCK,
        HEAD_DIM,
        HEADS,
        LAYERS,
        NAMES,
        NUM_BLOCKS,
        PREFIX,
        kv_cache_config,
        lmtier_overrides,
        make_vllm_config,
        write_model_dir,
    )


# ---- tensor parallelism and MLA: worker connectors of two ranks in one process ----
# vLLM builds a TP=2 VllmConfig on the CPU; only the rank, which the connector reads
# from vLLM's TP process group (none exists in one process), is patched in.


def make_tp_config(model_dir: Path, extra: dict[str, Any]) -> VllmConfig:
    config = make_vllm_config(model_dir, extra)
    config.parallel_config.tensor_parallel_size = 2
    return config


def rank_worker(
    config: VllmConfig, rank: int, monkeypatch: pytest.MonkeyPatch, kv: dict[str, torch.Tensor]
) -> LMTierConnector:
    monkeypatch.setattr(vllm_connector, "tp_rank_of", lambda _config: rank)
    worker = LMTierConnector(config, KVConnectorRole.WORKER, kv_cache_config(KVCacheLayout.BLHNC))
    worker.register_kv_caches(kv)
    return worker


def run_worker(worker: LMTierConnector, meta: LMTierConnectorMetadata) -> None:
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)  # type: ignore[arg-type]
    for name in NAMES:
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, torch.empty(0), None)  # type: ignore[arg-type]
    worker.wait_for_save()
    worker.clear_connector_metadata()
    worker._work()._writer.submit(lambda: None).result()


SRC, DST = tuple(range(8)), tuple(range(8, 16))  # 128 tokens: two chunks


def save_meta(req_id: str, tokens: list[int]) -> LMTierConnectorMetadata:
    return LMTierConnectorMetadata(saves=[SaveSpec(req_id, refs_of(tokens), SRC)])


def load_meta(req_id: str, tokens: list[int]) -> LMTierConnectorMetadata:
    return LMTierConnectorMetadata(loads=[LoadSpec(req_id, refs_of(tokens), 0, 128, DST)])


def refs_of(tokens: list[int]) -> ChunkRefs:
    return ChunkRefs("", 0, 2, token_ids=tuple(tokens[:128]))


def random_kv(shape: tuple[int, ...], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name in NAMES}


def test_tp_ranks_store_and_load_their_own_shards(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_tp_config(model_dir, {"config": lmtier_overrides(tmp_path)})
    shard = (NUM_BLOCKS, HEADS // 2, BLOCK, 2 * HEAD_DIM)  # [B, H/tp, N, C]
    kvs = [random_kv(shard, seed) for seed in (0, 1)]
    ranks = [rank_worker(config, rank, monkeypatch, kvs[rank]) for rank in (0, 1)]
    try:
        caches = [worker.lmtier for worker in ranks]
        assert caches[0] is not caches[1]
        assert [c.namespace().tp_rank for c in caches] == [0, 1]
        assert caches[0].kv_spec.num_kv_heads == HEADS // 2
        run_worker(ranks[0], save_meta("only0", PREFIX[100:]))  # rank 0 alone saved it
        for worker in ranks:
            run_worker(worker, save_meta("both", PREFIX))
        for rank, worker in enumerate(ranks):
            run_worker(worker, load_meta("both", PREFIX))
            assert worker.get_block_ids_with_load_errors() == set()
            for name in NAMES:
                kv = kvs[rank][name]
                assert torch.equal(kv[list(DST)], kv[list(SRC)])
        keys = [chunk_keys(c, refs_of(PREFIX[100:])) for c in caches]
        assert [c.lookup_keys(k).num_chunks for c, k in zip(caches, keys, strict=True)] == [2, 0]
        run_worker(ranks[1], load_meta("only0", PREFIX[100:]))  # not rank 1's shard
        assert ranks[1].get_block_ids_with_load_errors() == set(DST)
    finally:
        for worker in ranks:
            worker.shutdown()


def test_mla_rank_0_saves_and_every_rank_loads_the_same_latent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mla_dir = write_model_dir(tmp_path / "tiny-deepseek", MLA_MODEL)
    config = make_tp_config(mla_dir, {"config": lmtier_overrides(tmp_path)})
    latent = MLA_MODEL["kv_lora_rank"] + MLA_MODEL["qk_rope_head_dim"]
    kvs = [random_kv((NUM_BLOCKS, BLOCK, latent), seed) for seed in (0, 1)]  # [B, N, D]
    ranks = [rank_worker(config, rank, monkeypatch, kvs[rank]) for rank in (0, 1)]
    try:
        assert ranks[0].lmtier.kv_spec.layout == "LTD"
        assert ranks[0].lmtier is ranks[1].lmtier  # one copy: tp 1 / rank 0 namespace
        assert [w._work().saves for w in ranks] == [True, False]
        for worker in ranks:  # both get the save; only rank 0 writes
            run_worker(worker, save_meta("a", PREFIX))
        found = ranks[0].lmtier.lookup_keys(chunk_keys(ranks[0].lmtier, refs_of(PREFIX)))
        assert found.num_chunks == 2
        for worker in ranks:
            run_worker(worker, load_meta("a", PREFIX))
            assert worker.get_block_ids_with_load_errors() == set()
        for rank in (0, 1):
            for name in NAMES:
                assert torch.equal(kvs[rank][name][list(DST)], kvs[0][name][list(SRC)])
    finally:
        for worker in ranks:
            worker.shutdown()


def test_tp_stores_publish_at_the_last_rank_removals_at_the_first(
    model_dir: Path, tmp_path: Path
) -> None:
    config = make_tp_config(model_dir, {"config": lmtier_overrides(tmp_path)})
    layout = kv_cache_config(KVCacheLayout.BLHNC)
    scheduler = LMTierConnector(config, KVConnectorRole.SCHEDULER, layout)
    try:
        half = scheduler._sched()
        stored = BlockStored(
            block_hashes=[b"h"],
            parent_block_hash=None,
            token_ids=[1],
            block_size=BLOCK,
            lora_id=None,
            medium=MEDIUM_CPU,
            lora_name=None,
        )
        removed = BlockRemoved(block_hashes=[b"h"], medium=MEDIUM_CPU)
        half.add_worker_events([stored])  # rank 0
        assert list(half.take_events()) == []
        half.add_worker_events([stored, removed])  # rank 1 stored; rank 0 evicted
        assert list(half.take_events()) == [stored, removed]  # one shard gone: removed
        half.add_worker_events([removed])  # rank 1 evicts too: absorbed
        assert list(half.take_events()) == []
    finally:
        scheduler.shutdown()


MLA_MODEL: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": LAYERS,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
    "kv_lora_rank": 32,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": LAYERS,
}
