"""The vLLM connector's caches per process: keyed by the frozen config (no secret in
a key's repr), shared and counted within a process, never inherited across a fork."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest

pytest.importorskip("vllm")

from lmtier.config import LMTierConfig, Secret
from lmtier.kv_spec import KVSpec

with warnings.catch_warnings():  # vLLM's imports of torch's deprecated parts
    warnings.simplefilter("ignore", DeprecationWarning)
    from lmtier_connector.vllm import connector
    from lmtier_connector.vllm.common import SidecarSettings

PASSWORD = "hunter2-in-a-url"
TOKEN = "a-sidecar-token"


class FakeCache:
    """What the registry opens instead of a cache: counts its closes, and its pid."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.closes = 0

    def close(self) -> None:
        self.closes += 1


@pytest.fixture
def caches(monkeypatch: pytest.MonkeyPatch) -> connector._Caches:
    opened: list[FakeCache] = []

    def open_cache(key: Any) -> FakeCache:
        opened.append(FakeCache())
        return opened[-1]

    monkeypatch.setattr(connector, "_open_cache", open_cache)
    return connector._Caches()


def key(config: LMTierConfig | None = None) -> connector._CacheKey:
    config = config or LMTierConfig(redis={"url": f"redis://:{PASSWORD}@h:6379/0"})
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", layout="LKTHD")
    sidecar = SidecarSettings("unix:///tmp/lmtier.sock", token=Secret(TOKEN))
    return (config, spec, "model", "rev", 1, 0, sidecar)


def test_the_key_is_the_frozen_config_and_its_repr_hides_the_secrets() -> None:
    config = LMTierConfig(
        redis={"url": f"redis://:{PASSWORD}@h:6379/0"}, integrity={"key": "k" * 32}
    )
    found = key(config)
    assert found[0] is config
    text = repr(found)
    assert PASSWORD not in text and TOKEN not in text and "k" * 32 not in text
    # Equal configs share a key; a different password is a different cache.
    assert key(config.model_copy()) == found
    other = LMTierConfig(redis={"url": "redis://:another@h:6379/0"}, integrity={"key": "k" * 32})
    assert key(other) != found
    assert hash(key(LMTierConfig(extra_tiers=[{"backend": "memo", "options": {"a": 1}}])))


def test_one_cache_per_key_counted(caches: connector._Caches) -> None:
    first = caches.acquire(key())
    assert caches.acquire(key()) is first
    assert len(caches) == 1
    caches.release(key())
    assert first.closes == 0  # type: ignore[attr-defined]
    caches.release(key())
    assert first.closes == 1  # type: ignore[attr-defined]
    assert len(caches) == 0
    caches.release(key())  # released past zero: nothing to do
    assert first.closes == 1  # type: ignore[attr-defined]
