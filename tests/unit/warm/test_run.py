"""The ``--via`` loop's bookkeeping (lmtier_connector.warm.run.warm_via) and the summary
schema, with an engine client stand-in: the HTTP side is tested in test_via.py."""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator

import pytest

from lmtier_connector.warm.inputs import Prompt, PromptError
from lmtier_connector.warm.progress import Progress, Tally
from lmtier_connector.warm.run import GIVE_UP_AFTER, warm_via
from lmtier_connector.warm.via import EngineUnavailable, ViaResult


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
