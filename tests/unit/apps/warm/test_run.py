"""The ``--via`` loop's bookkeeping (lmtier_apps.warm.run.warm_via) and the summary
schema, with an engine client stand-in: the HTTP side is tested in test_via.py. The
cache loop (Warm) with a CPU-only cache and a warmer stand-in: what it asks for (no
tokenizer for token ids, no model when all is cached) and how a lost SIGINT stops it."""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import pytest
import torch

from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.config import CPUTierConfig, DiskTierConfig
from lmtier_apps.warm.inputs import Prompt, PromptError
from lmtier_apps.warm.interrupt import Interrupt
from lmtier_apps.warm.progress import Progress, Tally
from lmtier_apps.warm.run import GIVE_UP_AFTER, Warm, WarmItem, warm_via
from lmtier_apps.warm.via import EngineUnavailable, ViaResult


class Engine:
    """Answers each prompt with ``answer(prompt)``: (prompt tokens, cached, error)."""

    url = "http://engine.test"

    def __init__(self, error: str | None = None, cached: int = 0) -> None:
        self.error, self.cached = error, cached

    def warm_all(self, prompts: Iterable[Prompt], concurrency: int = 4) -> Iterator[ViaResult]:
        for prompt in prompts:
            tokens = None if self.error else 100
            cached = None if self.error else self.cached
            yield ViaResult(prompt, tokens, cached, 0.01, self.error)


def run(engine: Engine, items: list[Prompt | PromptError]) -> tuple[Tally, str]:
    tally, errors = Tally("via"), io.StringIO()
    progress = Progress(tally, None, enabled=False, stream=errors)
    warm_via(engine, items, tally, progress, concurrency=2, errors=errors)  # type: ignore[arg-type]
    return tally, errors.getvalue()


def prompts(count: int) -> list[Prompt | PromptError]:
    return [Prompt(source=f"p.jsonl:{i + 1}", text=f"prompt {i}") for i in range(count)]


def test_counts_and_bad_lines() -> None:
    items = [*prompts(3), PromptError("p.jsonl:4", "invalid JSON (x)")]
    tally, errors = run(Engine(cached=40), items)
    assert (tally.prompts, tally.warmed, tally.failed) == (4, 3, 1)
    assert (tally.prompt_tokens, tally.cached_tokens, tally.computed_tokens) == (300, 120, 180)
    assert "lmtier warm: p.jsonl:4: invalid JSON (x)" in errors
    summary = tally.as_json()
    assert summary["schema"] == "lmtier.warm/1" and json.loads(json.dumps(summary)) == summary


def test_an_engine_refusing_everything_stops_the_run() -> None:
    with pytest.raises(EngineUnavailable, match=f"refused {GIVE_UP_AFTER} prompts in a row"):
        run(Engine(error="HTTP 401: invalid API key"), prompts(50))


# --- the cache loop (Warm) with an embedded CPU-only cache ---------------------------

CHUNK = 16
SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=4)


class Recorder:
    """A Warmer that stores zeros for each item: what the model would have stored."""

    batch_size = 1

    def __init__(self, cache: LMTier) -> None:
        self.cache, self.computed = cache, 0

    def warm(self, items: Sequence[WarmItem], cache_salt: str = "") -> None:
        for item in items:
            self.computed += 1
            kv = torch.zeros(SPEC.shape(len(item.keys) * CHUNK))
            item.stored_chunks = self.cache.store_keys(item.keys, kv, skip=item.cached_chunks)


@pytest.fixture
def cache() -> Iterator[LMTier]:
    config = LMTierConfig(
        chunk_size=CHUNK,
        cpu=CPUTierConfig(capacity_bytes=1 << 20, staging_bytes=8 << 20),
        disk=DiskTierConfig(enabled=False),
    )
    with LMTier.open(config, kv=SPEC, model_id="m") as opened:
        yield opened


def token_prompts(count: int) -> list[Prompt | PromptError]:
    return [
        Prompt(source=f"t.jsonl:{i + 1}", tokens=tuple(range(100 * i, 100 * i + 2 * CHUNK)))
        for i in range(count)
    ]


def run_warm(cache: LMTier, items: Iterable[Prompt | PromptError], **kwargs: Any) -> Tally:
    tally = Tally("model")
    progress = Progress(tally, None, enabled=False, stream=io.StringIO())
    Warm(cache, errors=io.StringIO(), tally=tally, progress=progress, **kwargs).run(items)
    return tally


def test_token_prompts_ask_for_no_tokenizer_and_cached_ones_for_no_model(cache: LMTier) -> None:
    def no_tokenizer() -> Any:
        raise AssertionError("token ids need no tokenizer")

    warmer = Recorder(cache)
    tally = run_warm(cache, token_prompts(3), tokenizer=no_tokenizer, warmer=warmer)
    assert (tally.warmed, warmer.computed) == (3, 3)
    again = run_warm(cache, token_prompts(3), tokenizer=no_tokenizer, warmer=warmer)
    assert (again.skipped, warmer.computed) == (3, 3), "all cached: the warmer is not asked"


def test_a_sigint_whose_exception_was_lost_stops_the_run(cache: LMTier) -> None:
    interrupt = Interrupt()

    def prompts() -> Iterator[Prompt | PromptError]:
        items = token_prompts(4)
        yield items[0]
        interrupt.received = True  # the handler ran, its KeyboardInterrupt went nowhere
        yield from items[1:]

    warmer = Recorder(cache)
    tally = run_warm(cache, prompts(), tokenizer=None, warmer=warmer, interrupt=interrupt)
    assert tally.interrupted and (tally.warmed, warmer.computed) == (1, 1)


def test_the_summary_names_tiers_in_words_and_counts_in_the_singular() -> None:
    tally = Tally("model", prompts=1, warmed=1, prompt_tokens=1)
    tally.chunks_stored, tally.pinned = {"cpu": 4, "disk": 4}, {"cpu": 4, "redis": -1}
    out = io.StringIO()
    Progress(tally, None, enabled=False, stream=out).summary(as_json=False)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("lmtier warm (model) done: 1 prompt, 1 warmed,")
    assert "1 prompt token," in lines[0]
    assert lines[1:] == ["  chunks by tier: cpu 4, disk 4", "  pinned by tier: cpu 4, redis failed"]
