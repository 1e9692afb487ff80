"""The vLLM connector's caches per process: keyed by the frozen config (no secret in
a key's repr), shared and counted within a process, never inherited across a fork."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("vllm")

from lmtier.config import LMTierConfig

with warnings.catch_warnings():  # vLLM's imports of torch's deprecated parts
    warnings.simplefilter("ignore", DeprecationWarning)
    from lmtier_connector.vllm import caches as registry
    from support.vllm_caches import PASSWORD, TOKEN, fake_registry
    from support.vllm_caches import registry_key as key


@pytest.fixture
def caches(monkeypatch: pytest.MonkeyPatch) -> registry.Caches:
    return fake_registry(monkeypatch)


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


def test_one_cache_per_key_counted(caches: registry.Caches) -> None:
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
