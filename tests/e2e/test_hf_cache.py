"""A real (small, random) Llama: logits with lmtier equal logits without it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lmtier import LMTier, LMTierConfig
from lmtier.config import CPUTierConfig, DiskTierConfig
from lmtier_connector.device.prefix_cache import DevicePrefixCache
from lmtier_connector.hf.adapter import CachedCausalLM, kv_spec_of

pytestmark = pytest.mark.e2e

CHUNK = 64
ATOL = 1e-5


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama()


def config(disk: Path | None, cpu_bytes: int = 64 << 20) -> LMTierConfig:
    return LMTierConfig(
        chunk_size=CHUNK,
        cpu=CPUTierConfig(capacity_bytes=cpu_bytes),
        disk=DiskTierConfig(
            enabled=disk is not None, path=disk or Path("/nonexistent"), fsync=False
        ),
    )


def prompt(length: int, seed: int) -> list[int]:
    ids: list[int] = torch.randint(
        0, 1000, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()
    return ids


def reference_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    return CachedCausalLM(model, None).prefill(ids, store=False).logits


@pytest.fixture
def cache(model: LlamaForCausalLM, tmp_path: Path) -> Iterator[LMTier]:
    with LMTier.open(config(tmp_path / "disk"), kv=kv_spec_of(model), model_id="tiny") as opened:
        yield opened


def test_cpu_tier_hit_gives_equal_logits(model: LlamaForCausalLM, cache: LMTier) -> None:
    llm = CachedCausalLM(model, cache)
    shared = prompt(300, seed=1)
    first = llm.prefill([*shared, 5, 6, 7])
    assert first.num_cached_tokens == 0
    assert first.num_stored_chunks == 4
    second_ids = [*shared, *prompt(40, seed=2)]
    second = llm.prefill(second_ids)
    assert second.num_cached_tokens == 256
    assert second.tokens_by_tier == {"cpu": 256}
    torch.testing.assert_close(
        second.logits, reference_logits(model, second_ids), atol=ATOL, rtol=0
    )


def test_whole_prompt_cached_still_recomputes_the_last_token(
    model: LlamaForCausalLM, cache: LMTier
) -> None:
    llm = CachedCausalLM(model, cache)
    ids = prompt(2 * CHUNK, seed=3)
    llm.prefill(ids)
    again = llm.prefill(ids)
    assert again.num_cached_tokens == CHUNK  # not 128: the last token is recomputed
    torch.testing.assert_close(again.logits, reference_logits(model, ids), atol=ATOL, rtol=0)


def test_disk_tier_hit_gives_equal_logits(model: LlamaForCausalLM, tmp_path: Path) -> None:
    ids = prompt(400, seed=4)
    spec = kv_spec_of(model)
    tiny_cpu = 2 * spec.encoded_chunk_bytes(CHUNK)  # 2 chunks: the rest is only on disk
    with LMTier.open(config(tmp_path / "disk", tiny_cpu), kv=spec, model_id="tiny") as cache:
        llm = CachedCausalLM(model, cache)
        llm.prefill(ids)
        cache.flush()
        again = llm.prefill([*ids, 1, 2, 3])
        assert again.num_cached_tokens == 384
        assert again.tokens_by_tier.get("disk", 0) >= 4 * CHUNK
        torch.testing.assert_close(
            again.logits, reference_logits(model, [*ids, 1, 2, 3]), atol=ATOL, rtol=0
        )


def test_conversation_reuses_earlier_turns(model: LlamaForCausalLM, cache: LMTier) -> None:
    llm = CachedCausalLM(model, cache)
    history = prompt(200, seed=5)
    for turn in range(3):
        reply, result = llm.generate(history, max_new_tokens=8)
        assert len(reply) == 8
        if turn:
            assert result.num_cached_tokens >= 192
        torch.testing.assert_close(
            result.logits, reference_logits(model, history), atol=ATOL, rtol=0
        )
        history = [*history, *reply, *prompt(70, seed=10 + turn)]


def test_cache_salt_keeps_tenants_apart(model: LlamaForCausalLM, cache: LMTier) -> None:
    llm = CachedCausalLM(model, cache)
    ids = prompt(200, seed=6)
    llm.prefill(ids, cache_salt="tenant-a")
    assert llm.prefill(ids, cache_salt="tenant-b").num_cached_tokens == 0
    assert llm.prefill(ids, cache_salt="tenant-a").num_cached_tokens == 192


def test_other_weights_never_hit(model: LlamaForCausalLM, tmp_path: Path) -> None:
    ids = prompt(200, seed=7)
    with LMTier.open(
        config(tmp_path / "d"), kv=kv_spec_of(model), model_id="tiny", model_revision="a"
    ) as a:
        CachedCausalLM(model, a).prefill(ids)
    with LMTier.open(
        config(tmp_path / "d"), kv=kv_spec_of(model), model_id="tiny", model_revision="b"
    ) as b:
        assert CachedCausalLM(model, b).prefill(ids).num_cached_tokens == 0


@pytest.mark.slow  # a topology: two processes in turn, each building the model
def test_restart_in_a_new_process_hits_disk_with_equal_logits(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import json, sys, torch
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_hf_cache import config, prompt, reference_logits, tiny_llama
        from lmtier import LMTier
        from lmtier_connector.hf.adapter import CachedCausalLM, kv_spec_of
        model = tiny_llama()
        ids = prompt(330, seed=8)
        with LMTier.open(config(Path(sys.argv[1])), kv=kv_spec_of(model), model_id="tiny") as cache:
            result = CachedCausalLM(model, cache).prefill(ids)
        diff = (result.logits - reference_logits(model, ids)).abs().max().item()
        report = {{"cached": result.num_cached_tokens, "tiers": result.tokens_by_tier}}
        print(json.dumps({{**report, "diff": diff}}))
        """
    )
    env = {**os.environ, "PYTHONHASHSEED": "random"}

    def run() -> str:
        return (
            subprocess.run(
                [sys.executable, "-c", script, str(tmp_path / "disk")],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )

    first, second = run(), run()
    assert '"cached": 0' in first
    assert '"cached": 320' in second
    assert '"tiers": {"disk": 320}' in second
    diff = float(second.rsplit(":", 1)[1].rstrip("}"))
    assert diff <= ATOL


def test_device_tier_hit_gives_equal_logits_and_falls_back_to_cpu(
    model: LlamaForCausalLM, cache: LMTier
) -> None:
    spec = kv_spec_of(model)
    device = DevicePrefixCache(spec, num_blocks=1 + 20)  # 20 usable blocks: 320 tokens
    llm = CachedCausalLM(model, cache, device_cache=device)
    shared = prompt(200, seed=20)
    llm.prefill([*shared, *prompt(30, seed=21)])
    ids = [*shared, *prompt(40, seed=22)]
    hit = llm.prefill(ids)
    assert hit.tokens_by_tier == {"device": 192}  # 12 blocks; whole chunks would give 192 too
    torch.testing.assert_close(hit.logits, reference_logits(model, ids), atol=ATOL, rtol=0)
    # Another long prompt evicts the shared blocks (LRU): storage serves them instead.
    llm.prefill(prompt(300, seed=23))
    again = llm.prefill(ids)
    assert again.tokens_by_tier == {"cpu": 192}
    torch.testing.assert_close(again.logits, reference_logits(model, ids), atol=ATOL, rtol=0)


def test_device_hit_is_extended_by_storage_chunks(model: LlamaForCausalLM, cache: LMTier) -> None:
    spec = kv_spec_of(model)
    ids = prompt(300, seed=30)
    CachedCausalLM(model, cache).prefill(ids)  # storage holds 4 chunks of 64
    device = DevicePrefixCache(spec, num_blocks=64)
    llm = CachedCausalLM(model, cache, device_cache=device)
    llm.prefill(ids[:100])  # the device tier holds 6 blocks (96 tokens)
    result = llm.prefill([*ids, 7])
    # Device serves up to the last chunk boundary it covers (64), storage the rest.
    assert result.tokens_by_tier == {"device": 64, "cpu": 192}
    torch.testing.assert_close(result.logits, reference_logits(model, [*ids, 7]), atol=ATOL, rtol=0)
