"""``lmtier warm``'s compute step in-process (lmtier_apps.warm.compute): batched
prefills store each prompt's own KV, partly cached prompts compute only the rest."""

from __future__ import annotations

import pytest
import torch

from lmtier import LMTier, LMTierConfig
from lmtier.config import CPUTierConfig, DiskTierConfig
from lmtier_apps.demo.demo_model import build_demo_model
from lmtier_apps.warm.compute import ModelWarmer, WarmItem
from lmtier_connector.hf.adapter import kv_spec_of
from lmtier_connector.hf.compat import output_cache

pytestmark = [pytest.mark.e2e]

CHUNK = 32


def plain_kv(model: object, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)  # type: ignore[operator]
    return [(layer.keys[0], layer.values[0]) for layer in output_cache(out).layers]


def test_batched_and_partly_cached_prompts_store_their_own_kv() -> None:
    demo = build_demo_model(0)
    spec = kv_spec_of(demo.model)
    config = LMTierConfig(
        chunk_size=CHUNK,
        cpu=CPUTierConfig(capacity_bytes=64 * spec.encoded_chunk_bytes(CHUNK) + 2**20),
        disk=DiskTierConfig(enabled=False),
    )
    prompts = [list(range(10 + i, 10 + i + n)) for i, n in enumerate((100, 64, 70))]
    with LMTier.open(
        config, kv=spec, model_id=demo.model_id, model_revision=demo.revision
    ) as cache:
        # The third prompt's first chunk is cached already: it goes the adapter's way.
        third_keys = cache.keys(prompts[2])
        warmer = ModelWarmer(demo.model, cache, batch_size=3)
        warmer.warm([WarmItem(prompts[2][: CHUNK + 1], cache.keys(prompts[2][: CHUNK + 1]), 0)])
        items = [
            WarmItem(prompts[0], cache.keys(prompts[0]), 0),
            WarmItem(prompts[1], cache.keys(prompts[1]), 0),
            WarmItem(prompts[2], third_keys, cache.lookup_keys(third_keys).num_chunks),
        ]
        assert items[2].cached_chunks == 1
        warmer.warm(items)
        assert [item.stored_chunks for item in items] == [3, 2, 1]
        assert [item.computed_tokens for item in items] == [96, 64, 70 - CHUNK]
        for ids in prompts:
            full = len(ids) // CHUNK * CHUNK
            with cache.load(ids) as hit:
                assert hit.num_tokens == full
                loaded = hit.kv()
            assert loaded is not None
            reference = plain_kv(demo.model, ids[:full])
            for layer, (keys, values) in enumerate(reference):
                # (L, 2, T, H, D) chunk layout against HF's (H, T, D)
                assert torch.allclose(loaded[layer, 0], keys.transpose(0, 1), atol=1e-5)
                assert torch.allclose(loaded[layer, 1], values.transpose(0, 1), atol=1e-5)
