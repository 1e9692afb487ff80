"""lmtier: a multi-tier KV cache for LLM inference.

Prefix KV is computed once and served to every later request from the fastest tier
that holds it: GPU prefix cache, pinned CPU memory, local NVMe, Redis, S3. Chunks
are keyed by chained hashes of fixed-size token chunks (:mod:`lmtier.keys`) and
stored in one byte format in every tier (:mod:`lmtier.chunk_format`).

Start from :class:`LMTier` (see :mod:`lmtier.api`). Names are imported lazily, so
processes that only move bytes (storage backends, the CLI's ``keys``) never load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmtier.api import CacheLookup, LMTier, LoadResult
    from lmtier.config import LMTierConfig, load_config
    from lmtier.errors import LMTierError
    from lmtier.keys import ChunkKey, ExtraKeys, MultimodalSpan, Namespace, chunk_keys, make_hasher
    from lmtier.kv_spec import KVSpec

_EXPORTS = {
    "CacheLookup": "lmtier.api",
    "LMTier": "lmtier.api",
    "LoadResult": "lmtier.api",
    "LMTierConfig": "lmtier.config",
    "load_config": "lmtier.config",
    "LMTierError": "lmtier.errors",
    "ChunkKey": "lmtier.keys",
    "ExtraKeys": "lmtier.keys",
    "MultimodalSpan": "lmtier.keys",
    "Namespace": "lmtier.keys",
    "chunk_keys": "lmtier.keys",
    "make_hasher": "lmtier.keys",
    "KVSpec": "lmtier.kv_spec",
}

__all__ = [
    "CacheLookup",
    "ChunkKey",
    "ExtraKeys",
    "KVSpec",
    "LMTier",
    "LMTierConfig",
    "LMTierError",
    "LoadResult",
    "MultimodalSpan",
    "Namespace",
    "chunk_keys",
    "load_config",
    "make_hasher",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lmtier' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
