"""Helpers shared by the vLLM connector tests: a tiny model directory, vLLM configs
and KV cache configs. Import it only once vLLM is known to be installed (the test
modules skip first); ``tests/conftest.py`` sets the environment vLLM needs on a CPU
machine before any test module imports vLLM.
"""

from __future__ import annotations

import json
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
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

LAYERS, HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, CHUNK = 2, 2, 16, 16, 128, 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
PAGE = 2 * HEADS * BLOCK * HEAD_DIM * 4  # one layer's block, fp32, K and V
PREFIX = [(i * 37 + 11) % 1000 for i in range(300)]

TINY_LLAMA: dict[str, Any] = {
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


def write_model_dir(path: Path, config: dict[str, Any] | None = None) -> Path:
    """A local model directory holding only ``config.json`` (default: a tiny Llama)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA if config is None else config))
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
                kv_connector_module_path="lmtier_connector.vllm",
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
