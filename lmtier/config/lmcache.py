"""LMCache's configuration keys, for users who move a config file over.

An LMCache file (``LMCACHE_CONFIG_FILE``, or keys pasted into an lmtier file) works
as far as lmtier has the same feature. The keys users paste most map to ours, and
are logged at DEBUG when used::

    chunk_size            chunk_size (the same key)
    local_cpu             cpu.enabled
    max_local_cpu_size    cpu.capacity_bytes = value * 1024**3 (LMCache's "GB")
    local_disk            disk.enabled + disk.path ("file:///p/" or "/p/"); null/false: off
    max_local_disk_size   disk.capacity_bytes = value * 1024**3
    remote_url            redis://, rediss://, unix:// -> redis.url;
                          s3://bucket/prefix -> s3.bucket + s3.prefix ("prefix/")

LMCache keys lmtier has no use for (:data:`UNSUPPORTED`) are errors that say so and
what to do instead, rather than an "unknown key" with a misleading suggestion.
Each translator returns (dotted key, raw value) pairs, or raises ValueError with the
problem; values are converted and checked later, like any other.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

from lmtier.config.secrets import redact_url
from lmtier.config.types import MAX_BYTES
from lmtier.errors import brief

__all__ = ["KEYS", "UNSUPPORTED", "unsupported_reason"]

_GIB = 1024**3
_REDIS_SCHEMES = ("redis", "rediss", "unix")


def _lmcache_gb(target: str) -> Callable[[Any], list[tuple[str, Any]]]:
    """LMCache sizes are numbers of "GB" that it multiplies by 1024**3."""

    def translate(value: Any) -> list[tuple[str, Any]]:
        number = value
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                raise ValueError(f"must be a number of GB, got {brief(value)}") from None
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ValueError(f"must be a number of GB, got {brief(value)}")
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"must be a non-negative number of GB, got {brief(value)}")
        if number * _GIB > MAX_BYTES:  # round() of it could be infinite: OverflowError
            raise ValueError(f"must be at most {MAX_BYTES // _GIB} GB, got {brief(value)}")
        return [(target, round(number * _GIB))]

    return translate


def _lmcache_local_disk(value: Any) -> list[tuple[str, Any]]:
    if value is None or value is False:
        return [("disk.enabled", False)]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"must be a path, a file:// URL, or null, got {brief(value)}")
    if value.startswith("file:"):
        parts = urlsplit(value)
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise ValueError(f"must be a file:///absolute/path URL, got {brief(value)}")
        value = unquote(parts.path)
    return [("disk.enabled", True), ("disk.path", value)]


def _lmcache_remote_url(value: Any) -> list[tuple[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, str):
        raise ValueError(f"must be a URL string, got {type(value).__name__}")
    scheme = value.partition("://")[0].lower() if "://" in value else ""
    if scheme in _REDIS_SCHEMES:
        return [("redis.url", value)]
    if scheme == "s3":
        parts = urlsplit(value)
        bucket = parts.netloc.rpartition("@")[2]
        if not bucket:
            raise ValueError(f"an s3:// URL needs a bucket, got {brief(redact_url(value))}")
        prefix = parts.path.strip("/")
        # Only an explicit prefix replaces ours; a bare s3://bucket keeps "lmtier/".
        return [("s3.bucket", bucket)] + ([("s3.prefix", prefix + "/")] if prefix else [])
    supported = ", ".join(f"{s}://" for s in (*_REDIS_SCHEMES, "s3"))
    raise ValueError(f"scheme {scheme!r} is not supported by lmtier (use {supported})")


KEYS: dict[str, Callable[[Any], list[tuple[str, Any]]]] = {
    "chunk_size": lambda value: [("chunk_size", value)],
    "local_cpu": lambda value: [("cpu.enabled", value)],
    "max_local_cpu_size": _lmcache_gb("cpu.capacity_bytes"),
    "local_disk": _lmcache_local_disk,
    "max_local_disk_size": _lmcache_gb("disk.capacity_bytes"),
    "remote_url": _lmcache_remote_url,
}
"""LMCache key -> translator to (dotted key, raw value) pairs."""

_NO_FEATURE = "lmtier has no such feature; remove the key"
_PEER_TIER = (
    "lmtier shares CPU tiers between nodes with its own peer tier, found through a "
    "directory in Redis: set peer.enabled and peer.listen (docs/cluster.md)"
)
UNSUPPORTED: dict[str, str] = {
    "remote_serde": "lmtier stores one chunk format in every tier (no serializer to choose)",
    "save_decode_cache": "set save_decode_tokens in the vLLM connector's "
    "kv_connector_extra_config instead",
    "use_layerwise": "the vLLM connector always loads layer by layer",
    "save_unfull_chunk": "lmtier stores full chunks only",
    "enable_blending": "CacheBlend (non-prefix reuse) is not supported",
    "blend_recompute_ratios": "CacheBlend (non-prefix reuse) is not supported",
    "blend_min_tokens": "CacheBlend (non-prefix reuse) is not supported",
    "blend_special_str": "CacheBlend (non-prefix reuse) is not supported",
    "enable_p2p": _PEER_TIER,
    "lookup_url": _PEER_TIER,
    "distributed_url": _PEER_TIER,
    "enable_controller": _NO_FEATURE,
    "controller_url": _NO_FEATURE,
    "lmcache_worker_port": _NO_FEATURE,
    "lmcache_instance_id": _NO_FEATURE,
    "pipelined_backend": "loads and stores are always asynchronous below the CPU tier",
    "extra_config": "set the matching lmtier key instead (see the README's config section)",
    "gds_path": "GPU Direct Storage is not supported; use disk.path",
    "cufile_buffer_size": "GPU Direct Storage is not supported",
    "enable_nixl": "NIXL transfers are not supported",
    "nixl_role": "NIXL transfers are not supported",
    "nixl_receiver_host": "NIXL transfers are not supported",
    "nixl_receiver_port": "NIXL transfers are not supported",
    "nixl_buffer_size": "NIXL transfers are not supported",
    "nixl_buffer_device": "NIXL transfers are not supported",
    "error_handling": "a failing tier is always a miss in lmtier, never an error",
    "cache_policy": "every tier evicts least recently used chunks",
    "numa_mode": _NO_FEATURE,
    "priority_limit": _NO_FEATURE,
    "min_retrieve_tokens": _NO_FEATURE,
    "internal_api_server_enabled": _NO_FEATURE,
    "internal_api_server_port_start": _NO_FEATURE,
}
"""LMCache keys with no lmtier counterpart -> why, and what to do instead."""


def unsupported_reason(key: str) -> str | None:
    """Why LMCache's ``key`` has no lmtier counterpart, or None if it is not one."""
    return UNSUPPORTED.get(key)
