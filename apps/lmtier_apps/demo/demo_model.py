"""The demo's model: a small Llama, randomly initialised from a config, or a local one.

No download ever happens: the default model is built from :func:`demo_config` with a
fixed seed (56.9M parameters, 8 layers, hidden 512, GQA with 2 KV heads of 64: 8 KiB
of fp32 KV per token, the model DESIGN.md's figures were measured with), and
``load_local_model`` only reads a directory already on disk.

Each model comes with an id and a revision for the cache namespace: the revision
fingerprints the weights (for the random model its seed, its config and the weights
drawn; config and weight files for a local one), so changing the model never serves
stale KV, and nothing else changes it: the random model's revision once hashed its
whole config JSON, whose ``transformers_version`` made every upgrade or downgrade of
transformers (``.ci/run`` pinned an older one) a new model with equal weights and a
cold cache. The modeling code is imported when a model is built or loaded, not with
this module.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from transformers import LlamaConfig

from lmtier.errors import ConfigError
from lmtier.model_dir import model_identity

__all__ = [
    "DEMO_MODEL_ID",
    "WEIGHTS_DTYPE",
    "DemoModel",
    "build_demo_model",
    "demo_config",
    "demo_revision",
    "load_local_model",
]

DEMO_MODEL_ID = "lmtier-demo/llama-57m-random"
WEIGHTS_DTYPE = "float32"
"""What a local model's weights are loaded in, whatever its config says: so its KV's
dtype too (what ``lmtier warm`` keys a directory's prompts with before loading it)."""


@dataclass(frozen=True, slots=True)
class DemoModel:
    """A loaded causal LM with the identity that goes into the cache namespace."""

    model: Any
    model_id: str
    revision: str
    vocab_size: int


def demo_config() -> LlamaConfig:
    """The demo model's architecture (Llama, fp32)."""
    return LlamaConfig(
        vocab_size=32_000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=16_384,
    )


def build_demo_model(seed: int = 0) -> DemoModel:
    """The demo Llama with random weights drawn from ``seed`` (same seed, same weights)."""
    config = demo_config()
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        from transformers import LlamaForCausalLM  # noqa: PLC0415 - the modeling code

        model = _untyped(LlamaForCausalLM)(config).eval()
    finally:
        torch.random.set_rng_state(generator_state)
    return DemoModel(model, DEMO_MODEL_ID, demo_revision(model, seed), config.vocab_size)


def demo_revision(model: Any, seed: int) -> str:
    """The random model's revision: ``seed<seed>-`` and an xxh3-64 of what makes its KV,
    the config without the transformers version that wrote it (the architecture, its
    defaults included, which a transformers version could change) and every weight's
    name and bytes (which its initialisation code could change): ~25 ms for 57M
    parameters."""
    settings = model.config.to_dict()
    settings.pop("transformers_version", None)
    digest = xxhash.xxh3_64(json.dumps(settings, sort_keys=True, default=str).encode())
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().data)
    return f"seed{seed}-{digest.hexdigest()}"


def load_local_model(path: str | os.PathLike[str]) -> DemoModel:
    """A causal LM from a local directory (``config.json`` and weights; no hub access),
    named as every lmtier command names that directory (:mod:`lmtier.model_dir`)."""
    directory = Path(path).expanduser()
    if not (directory / "config.json").is_file():
        raise ConfigError(f"--model {directory}: no config.json there, so no model directory")
    model_id, revision = model_identity(directory)
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - the modeling code

    model = (
        _untyped(AutoModelForCausalLM)
        .from_pretrained(directory, local_files_only=True, dtype=getattr(torch, WEIGHTS_DTYPE))
        .eval()
    )
    return DemoModel(model, model_id, revision, int(model.config.vocab_size))


def _untyped(obj: object) -> Any:
    """transformers' model classes are partly unannotated; keep mypy strict elsewhere."""
    return obj
