"""The model a command's flags name, resolved once for every operations command
(``lookup``, ``purge``, ``unpin``): its KV geometry, id, revision and the config's
chunk size and hash, as an engine serving it keys its chunks.

``--model DIR`` (a local transformers model directory) gives the geometry and dtype
(``config.json``, :func:`model_settings`) and the id and revision
(:func:`lmtier.model_dir.model_identity`, what ``lmtier warm --model`` and ``lmtier
demo serve --model`` use). Any flag overrides what the directory says; without
``--model``, the flags and the config name the model.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from lmtier.chunks.format import DTYPE_ITEMSIZE
from lmtier.config import LMTierConfig
from lmtier.errors import ConfigError
from lmtier.model_dir import model_identity

if TYPE_CHECKING:
    from lmtier.kv_spec import KVSpec

__all__ = ["ResolvedModel", "context_length", "model_settings", "resolve_model"]


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """What names a model's chunks; :meth:`cache_kwargs` are ``LMTier.open``'s."""

    config: LMTierConfig
    spec: KVSpec
    model_id: str
    revision: str
    vocab_size: int | None
    directory: Path | None

    def cache_kwargs(self) -> dict[str, Any]:
        return {
            "model_id": self.model_id,
            "model_revision": self.revision,
            "vocab_size": self.vocab_size,
        }


def resolve_model(args: argparse.Namespace, config: LMTierConfig) -> ResolvedModel:
    """The model of ``args`` (``--model``, the namespace flags of
    :func:`lmtier.cli.add_namespace_arguments`) over ``config``."""
    from lmtier.kv_spec import KVSpec  # noqa: PLC0415 - torch, only when a command runs

    directory = Path(args.model).expanduser() if getattr(args, "model", None) else None
    fields: dict[str, Any] = {}
    vocab = None
    model_id, revision = "", ""
    if directory is not None:
        fields, vocab = model_settings(directory)
        model_id, revision = model_identity(directory)
    for name in ("num_layers", "num_kv_heads", "head_dim"):
        if getattr(args, name, 0):  # 0: not given
            fields[name] = getattr(args, name)
    if getattr(args, "kv_dtype", None) is not None:
        fields["dtype"] = args.kv_dtype
    if any(name not in fields for name in ("num_layers", "num_kv_heads", "head_dim")):
        raise ConfigError(
            "give --model DIR, or the KV geometry: --num-layers, --num-kv-heads and --head-dim"
        )
    try:
        layout = getattr(args, "kv_layout", None) or "LKTHD"
        spec = KVSpec(
            **fields,
            layout=layout,
            block_size=getattr(args, "kv_block_size", 0),
            page_interior=getattr(args, "kv_page_interior", ""),
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    changes: dict[str, Any] = {}
    if getattr(args, "chunk_size", None) is not None:
        changes["chunk_size"] = args.chunk_size
    if getattr(args, "hash", None) is not None:
        changes["hash_algorithm"] = args.hash
    config = config.replace(**changes) if changes else config
    model_id = args.model_id or model_id or config.model_id
    if args.model_revision is not None:
        revision = args.model_revision
    elif directory is None:
        revision = config.model_revision
    if not model_id.strip() and not revision.strip():
        raise ConfigError("name the model: --model-id (or --model DIR, or model_id in the config)")
    return ResolvedModel(
        config, spec, model_id, revision, getattr(args, "vocab_size", None) or vocab, directory
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path.parent} has no config.json: not a model directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(found, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return found


def _text_fields(directory: Path) -> dict[str, Any]:
    """``config.json``'s settings, those of its ``text_config`` (a multimodal model's
    language model) over the top level's."""
    found = _read_json(directory / "config.json")
    text = found.get("text_config")
    return {**found, **text} if isinstance(text, dict) else found


def context_length(directory: Path) -> int | None:
    """The model's context (``max_position_embeddings``), or None where it says none."""
    length = _text_fields(directory).get("max_position_embeddings")
    return length if isinstance(length, int) and not isinstance(length, bool) else None


def model_settings(directory: Path) -> tuple[dict[str, Any], int | None]:
    """KVSpec fields (``num_layers``, ``num_kv_heads``, ``head_dim``, ``dtype``) and the
    vocabulary size of the transformers model in ``directory`` (module docstring)."""
    from lmtier.kv_spec import KVSpec  # noqa: PLC0415 - torch

    fields = _text_fields(directory)
    dtype = fields.get("dtype") or fields.get("torch_dtype") or "float32"
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in DTYPE_ITEMSIZE:
        raise ConfigError(
            f"{directory}/config.json: dtype {dtype!r} is no KV dtype lmtier stores; "
            f"pass --kv-dtype ({', '.join(sorted(DTYPE_ITEMSIZE))})"
        )
    try:
        spec = KVSpec.from_hf_config(SimpleNamespace(**fields), dtype=dtype)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ConfigError(
            f"{directory}/config.json does not give the KV geometry ({exc}); pass "
            "--num-layers, --num-kv-heads and --head-dim"
        ) from None
    geometry = {
        "num_layers": spec.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "dtype": spec.dtype,
    }
    vocab = fields.get("vocab_size")
    return geometry, vocab if isinstance(vocab, int) and vocab > 0 else None
