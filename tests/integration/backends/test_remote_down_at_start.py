"""A Redis that is down when lmtier starts: the cache opens, misses, then uses it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.config import CPUTierConfig, DiskTierConfig, RedisTierConfig
from lmtier.config.secrets import SecretURL
from support.redis_servers import RedisServer, free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a restart and a reopen timer

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8)


def test_cache_opens_without_redis_and_picks_it_up_later(tmp_path: Path) -> None:
    port = free_port()
    config = LMTierConfig(
        chunk_size=32,
        cpu=CPUTierConfig(capacity_bytes=0, enabled=False),
        disk=DiskTierConfig(enabled=False),
        redis=RedisTierConfig(url=SecretURL(f"redis://127.0.0.1:{port}/0"), timeout_s=0.5),
    )
    prompt = list(range(64))
    kv = torch.randn(SPEC.shape(64))
    with LMTier.open(config, kv=SPEC, model_id="m") as cache:  # Redis is down: still opens
        assert cache.lookup(prompt).num_tokens == 0
        assert cache.store(prompt, kv) == 2  # dropped below the CPU tier, never raised
        cache.flush()
        with RedisServer(tmp_path / "redis", port=port):
            deadline = time.monotonic() + 120  # a hang guard: it reopens within seconds
            while time.monotonic() < deadline:
                cache.store(prompt, kv)
                cache.flush()
                if cache.lookup(prompt).num_tokens == 64:
                    break
                time.sleep(0.2)
            found = cache.lookup(prompt)
            assert found.tokens_by_tier(32) == {"redis": 64}
            with cache.load(prompt) as loaded:
                assert torch.equal(loaded.kv(), kv)
