"""LMTierConnector on a hybrid model (vLLM's ``SupportsHMA``): full-attention and
sliding-window KV cache groups, under vLLM's real Scheduler with the hybrid allocator
on, a hybrid ``KVCacheConfig`` made by vLLM's own planner and real KV tensors.

Layers 0 and 2 attend fully (group 0), layers 1 and 3 within a window of 128 tokens
(group 1); the fake forward pass writes each layer's deterministic KV into the blocks
of its own group. Mamba/SSM groups are refused.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheSpec,
        MambaSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from lmtier.errors import ConfigError
    from lmtier_connector.vllm.connector import LMTierConnector
    from lmtier_connector.vllm.hybrid import HybridMetadata
    from support.vllm_helpers import (
        CHUNK,
        Engine,
        Geometry,
        SchedulerHalf,
        expected_kv,
        finish,
        lmtier_overrides,
        make_vllm_config,
        write_model_dir,
    )

GEOMETRY = Geometry(layers=4)
NAMES = GEOMETRY.names
BLOCK = GEOMETRY.block_size
WINDOW = 128
NUM_BLOCKS = 160
PROMPT = [(i * 37 + 11) % 1000 for i in range(1000)]
GROUP_OF = [0, 1, 0, 1]  # layer -> KV cache group (0: full attention, 1: sliding window)


def layer_specs() -> dict[str, KVCacheSpec]:
    shape: dict[str, Any] = {
        "block_size": BLOCK,
        "num_kv_heads": GEOMETRY.kv_heads,
        "head_size": GEOMETRY.head_dim,
        "dtype": torch.float32,
    }
    return {
        name: FullAttentionSpec(**shape)
        if GROUP_OF[index] == 0
        else SlidingWindowSpec(sliding_window=WINDOW, **shape)
        for index, name in enumerate(NAMES)
    }


class HybridEngine(Engine):
    """:class:`Engine` on the hybrid model: vLLM plans the groups and their tensors."""

    def __init__(self, vllm_config: Any) -> None:
        vllm_config.cache_config.kv_cache_layout = "BLHNC"
        groups = get_kv_cache_groups(vllm_config, layer_specs())
        page = GEOMETRY.page_bytes
        config = get_kv_cache_config_from_groups(vllm_config, groups, NUM_BLOCKS * page * 2)
        assert [len(g.layer_names) for g in config.kv_cache_groups] == [2, 2]
        SchedulerHalf.__init__(self, vllm_config, config)
        self.geometry = GEOMETRY
        self.config = config
        self.worker = LMTierConnector(vllm_config, KVConnectorRole.WORKER, config)
        self.kv = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.BLHNC)
        self.worker.register_kv_caches(self.kv)
        self.stats_seen = []

    def blocks(self, req_id: str, layer: int) -> list[int]:
        ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[GROUP_OF[layer]]
        return list(ids)

    def forward(self, out: Any, layer: int) -> None:
        """Each layer's KV into its own group's blocks, for every scheduled token."""
        for req_id, count in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            blocks = self.blocks(req_id, layer)
            stop = request.num_computed_tokens
            for pos in range(stop - count, stop):
                page = self.kv[NAMES[layer]]
                kv = expected_kv(request.all_token_ids[pos], pos, layer)
                page[blocks[pos // BLOCK], :, pos % BLOCK, :] = kv

    def run_step(self, *args: Any, **options: Any) -> Any:
        return super().run_step(*args, forward=self.forward, **options)

    def tokens(self, req_id: str, start: int, stop: int, layer: int) -> torch.Tensor:
        blocks, page = self.blocks(req_id, layer), self.kv[NAMES[layer]]
        return torch.stack([page[blocks[p // BLOCK], :, p % BLOCK, :] for p in range(start, stop)])


def expected(tokens: list[int], start: int, stop: int, layer: int) -> torch.Tensor:
    return torch.stack([expected_kv(tokens[p], p, layer) for p in range(start, stop)])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny-hybrid"), geometry=GEOMETRY)


@pytest.fixture
def engines() -> Iterator[list[HybridEngine]]:
    made: list[HybridEngine] = []
    yield made
    for engine in made:
        engine.close()


def make(model_dir: Path, tmp_path: Path, engines: list[HybridEngine]) -> HybridEngine:
    extra = {"config": lmtier_overrides(tmp_path)}
    config = make_vllm_config(model_dir, extra, num_blocks=NUM_BLOCKS, geometry=GEOMETRY)
    # The hybrid allocator stays on: the connector supports it.
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
    engine = HybridEngine(config)
    engines.append(engine)
    return engine


def store(engine: HybridEngine, req_id: str, prompt: list[int]) -> None:
    """Prefill ``prompt`` (one step), finish it, wait for its saves."""
    engine.add(req_id, prompt)
    out, meta = engine.run_step()
    assert out.num_scheduled_tokens[req_id] == len(prompt)
    assert isinstance(meta, HybridMetadata)
    finish(engine, req_id)
    done: set[str] = set()
    for _ in range(200):
        done |= engine.worker.get_finished({req_id})[0] or set()
        if done:
            break
        for half in engine.worker._work().halves:  # type: ignore[union-attr]
            half._writer.submit(lambda: None).result()
    assert done == {req_id}


def group_caches(engine: HybridEngine) -> list[Any]:
    halves = engine.connector._sched().halves  # type: ignore[union-attr]
    return [half.cache for half in halves]


def test_the_connector_supports_hma_and_keys_each_group_apart(
    model_dir: Path, tmp_path: Path, engines: list[HybridEngine]
) -> None:
    assert supports_hma(LMTierConnector)
    engine = make(model_dir, tmp_path, engines)
    full, window = group_caches(engine)
    assert full is not window
    assert full.namespace().digest != window.namespace().digest
    assert "kv-group=1/2:sliding_window:window=128" in window.namespace().model_revision
    assert (full.kv_spec.num_layers, window.kv_spec.num_layers) == (2, 2)


@pytest.mark.parametrize("length", [1000, 960])
def test_saves_then_a_fresh_scheduler_loads_what_each_group_needs_bit_exact(
    model_dir: Path, tmp_path: Path, engines: list[HybridEngine], length: int
) -> None:
    prompt = PROMPT[:length]
    store(make(model_dir, tmp_path, engines), "a", prompt)

    second = make(model_dir, tmp_path, engines)  # empty vLLM prefix cache, same tiers
    request = second.add("b", [*prompt, 5, 6, 7])  # continues the prompt
    hit = length // CHUNK * CHUNK  # 960 either way
    assert second.connector.get_num_new_matched_tokens(request, 0) == (hit, False)
    out, meta = second.run_step()
    assert isinstance(meta, HybridMetadata)
    full_load, window_load = (part.loads[0] for part in meta.groups)
    first_held = (hit - (WINDOW - 1)) // BLOCK * BLOCK  # vLLM's first real window block
    assert (full_load.start_token, full_load.end_token) == (0, hit)
    assert (window_load.start_token, window_load.end_token) == (first_held, hit)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == hit
    for layer in range(GEOMETRY.layers):
        start = 0 if GROUP_OF[layer] == 0 else first_held
        got = second.tokens("b", start, hit, layer)
        assert torch.equal(got, expected(prompt, start, hit, layer)), layer
    window_blocks = second.blocks("b", 1)
    null = second.scheduler.kv_cache_manager.block_pool.null_block.block_id
    assert set(window_blocks[: first_held // BLOCK]) == {null}  # never written
    assert second.worker.get_block_ids_with_load_errors() == set()

    # The same prompt again hits at the last chunk boundary before its last token.
    again = second.add("c", prompt)
    same = (length - 1) // CHUNK * CHUNK
    assert second.connector.get_num_new_matched_tokens(again, 0) == (same, False)


def test_the_sliding_window_group_stores_only_its_window(
    model_dir: Path, tmp_path: Path, engines: list[HybridEngine]
) -> None:
    """Measured in the groups' CPU tiers: the window group's bytes are window/length
    of what the full-attention group (the same layer geometry) stores."""
    engine = make(model_dir, tmp_path, engines)
    store(engine, "a", PROMPT)
    full, window = (cache.host_memory() for cache in group_caches(engine))
    full_bytes = full.cached_chunks * full.slab_bytes
    window_bytes = window.cached_chunks * window.slab_bytes
    stored = len(PROMPT) // CHUNK * CHUNK  # 960 tokens in 15 chunks
    assert full.cached_chunks == stored // CHUNK
    assert window.cached_chunks == WINDOW // CHUNK  # chunks 13 and 14
    assert window_bytes * stored <= full_bytes * WINDOW
    print(f"window/full bytes: {window_bytes}/{full_bytes} = {window_bytes / full_bytes:.4f}")


def test_a_hit_needs_every_group(
    model_dir: Path, tmp_path: Path, engines: list[HybridEngine]
) -> None:
    """A prompt that shares only a prefix shorter than the stored one: the full group
    holds its chunks, the window group holds no window before its boundaries: no hit."""
    store(make(model_dir, tmp_path, engines), "a", PROMPT)
    second = make(model_dir, tmp_path, engines)
    request = second.add("b", [*PROMPT[:600], 1, 2, 3])
    assert second.connector.get_num_new_matched_tokens(request, 0) == (0, False)


def test_mamba_state_groups_are_refused(model_dir: Path, tmp_path: Path) -> None:
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32)
    mamba = MambaSpec(block_size=BLOCK, shapes=((2, 16),), dtypes=(torch.float32,))
    config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(NAMES[:2], full), KVCacheGroupSpec(NAMES[2:], mamba)],
    )
    vllm_config = make_vllm_config(
        model_dir, {"config": lmtier_overrides(tmp_path)}, geometry=GEOMETRY
    )
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match=r"Mamba/SSM state groups \(1\)") as raised:
            LMTierConnector(vllm_config, role, config)
        assert "group 1: MambaSpec over 2 layers (model.layers.2" in str(raised.value)
