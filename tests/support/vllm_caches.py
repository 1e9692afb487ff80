"""The vLLM connector's per-process registry of caches without real caches: a
:class:`FakeCache` that counts its closes and remembers its pid, a registry that opens
them (:func:`fake_registry`), and a registry key whose config and sidecar token carry
secrets (:func:`registry_key`). Import it only once vLLM is known to be installed."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest

from lmtier.config import LMTierConfig, Secret
from lmtier.kv_spec import KVSpec

with warnings.catch_warnings():  # vLLM's imports of torch's deprecated parts
    warnings.simplefilter("ignore", DeprecationWarning)
    from lmtier_connector.vllm import caches as registry
    from lmtier_connector.vllm.common import SidecarSettings

__all__ = ["PASSWORD", "TOKEN", "FakeCache", "fake_registry", "registry_key"]

PASSWORD = "hunter2-in-a-url"
TOKEN = "a-sidecar-token"


class FakeCache:
    """What the registry opens instead of a cache: counts its closes, and its pid."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.closes = 0

    def close(self) -> None:
        self.closes += 1


def fake_registry(monkeypatch: pytest.MonkeyPatch) -> registry.Caches:
    """A fresh registry whose caches are :class:`FakeCache` (for a fixture)."""

    def open_cache(key: Any) -> FakeCache:
        return FakeCache()

    monkeypatch.setattr(registry, "open_cache", open_cache)
    return registry.Caches()


def registry_key(config: LMTierConfig | None = None) -> registry.CacheKey:
    """A registry key: ``config`` (default: one with a Redis password), a small KV
    geometry, and sidecar settings with a token."""
    config = config or LMTierConfig(redis={"url": f"redis://:{PASSWORD}@h:6379/0"})
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", layout="LKTHD")
    sidecar = SidecarSettings("unix:///tmp/lmtier.sock", token=Secret(TOKEN))
    return (config, spec, "model", "rev", 1, 0, sidecar)
