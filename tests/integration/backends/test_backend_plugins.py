"""A third party's storage backend, found by entry point: it opens from the config's
``extra_tiers``, serves in the waterfall, and passes the conformance suite."""

from __future__ import annotations

import pytest
import torch

from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.config import CPUTierConfig, DiskTierConfig, ExtraTierConfig
from lmtier.errors import ConfigError
from lmtier.storage.plugins import backend_factory
from lmtier.testing.conformance import TierConformance
from support import TESTS

PLUGINS = TESTS / "plugins"
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8)


@pytest.fixture(autouse=True)
def installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example backend, as if pip-installed: its package and .dist-info on sys.path."""
    monkeypatch.syspath_prepend(str(PLUGINS))


class TestMemoTierConformance(TierConformance):
    @pytest.fixture
    def make_tier(self):  # type: ignore[no-untyped-def]
        factory = backend_factory("memo")
        return lambda: factory(ExtraTierConfig(backend="memo", options={"max_chunks": 100_000}))


def test_an_extra_tier_serves_in_the_waterfall() -> None:
    config = LMTierConfig(
        chunk_size=32,
        cpu=CPUTierConfig(enabled=False, staging_bytes=1 << 20),
        disk=DiskTierConfig(enabled=False),
        extra_tiers=(ExtraTierConfig(backend="memo", options={"max_chunks": 8}),),
    )
    prompt, kv = list(range(96)), torch.randn(SPEC.shape(96))
    with LMTier.open(config, kv=SPEC, model_id="m") as cache:
        assert cache.store(prompt, kv) == 3
        cache.flush()
        assert cache.lookup(prompt).tokens_by_tier(32) == {"memo": 96}
        with cache.load(prompt) as hit:
            assert torch.equal(hit.kv(), kv)


def test_a_backend_nobody_installed_is_a_config_error() -> None:
    config = LMTierConfig(
        disk=DiskTierConfig(enabled=False),
        extra_tiers=({"backend": "nosuch"},),  # type: ignore[arg-type]
    )
    with pytest.raises(ConfigError, match=r"no storage backend named 'nosuch'.*memo"):
        LMTier.open(config, kv=SPEC, model_id="m")
