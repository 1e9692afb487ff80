"""lmtier: a multi-tier KV cache for LLM inference.

Prefix KV is computed once and served to every later request from the fastest tier
that holds it: GPU prefix cache, pinned CPU memory, local NVMe, Redis, S3. Chunks
are keyed by chained hashes of fixed-size token chunks (:mod:`lmtier.chunks.keys`) and
stored in one byte format in every tier (:mod:`lmtier.chunks.format`).

Start from :class:`LMTier` (see :mod:`lmtier.api`), or :func:`connect` for a cache
whose chunks live in a sidecar (``lmtier serve``; the ``grpc`` extra). Everything an engine needs is
exported here (the facade, its results, the chunk and slab types it hands out);
engines never reach into :mod:`lmtier.storage`. Names are imported lazily, so
processes that only move bytes (storage backends, the CLI's ``keys``) never load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmtier.api import LMTier
    from lmtier.chunks.format import ChunkMeta, DecodedChunk
    from lmtier.chunks.hashers import chunk_keys, make_hasher
    from lmtier.chunks.keys import ChunkKey, ExtraKeys, MultimodalSpan, Namespace
    from lmtier.config import LMTierConfig, load_config
    from lmtier.errors import LMTierError
    from lmtier.kv_spec import KVSpec
    from lmtier.remote.client import connect
    from lmtier.results import CacheLookup, HostMemory, LoadResult
    from lmtier.storage.host_pool import SlabHandle
    from lmtier.storage.lookup import LoadedChunk, Lookup, TierSpan

_EXPORTS = {
    "CacheLookup": "lmtier.results",
    "HostMemory": "lmtier.results",
    "LMTier": "lmtier.api",
    "LoadResult": "lmtier.results",
    "LMTierConfig": "lmtier.config",
    "load_config": "lmtier.config",
    "LMTierError": "lmtier.errors",
    "ChunkKey": "lmtier.chunks.keys",
    "ExtraKeys": "lmtier.chunks.keys",
    "MultimodalSpan": "lmtier.chunks.keys",
    "Namespace": "lmtier.chunks.keys",
    "chunk_keys": "lmtier.chunks.hashers",
    "make_hasher": "lmtier.chunks.hashers",
    "ChunkMeta": "lmtier.chunks.format",
    "DecodedChunk": "lmtier.chunks.format",
    "KVSpec": "lmtier.kv_spec",
    "connect": "lmtier.remote.client",
    "LoadedChunk": "lmtier.storage.lookup",
    "Lookup": "lmtier.storage.lookup",
    "TierSpan": "lmtier.storage.lookup",
    "SlabHandle": "lmtier.storage.host_pool",
}

__all__ = [
    "chunk_keys",
    "connect",
    "load_config",
    "make_hasher",
    "CacheLookup",
    "ChunkKey",
    "ChunkMeta",
    "DecodedChunk",
    "ExtraKeys",
    "HostMemory",
    "KVSpec",
    "LMTier",
    "LMTierConfig",
    "LMTierError",
    "LoadResult",
    "LoadedChunk",
    "Lookup",
    "MultimodalSpan",
    "Namespace",
    "SlabHandle",
    "TierSpan",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lmtier' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
