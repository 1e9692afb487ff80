"""Fixtures of the connector's tests under vLLM's real scheduler: the tiny model's
directory and the engines a test builds (closed after it). vLLM is imported only when
a fixture runs: a module that needs it skips first where it is missing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama's config.json (no weights: vLLM's scheduler reads the config)."""
    from support.vllm_helpers import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def engines() -> Iterator[list[Any]]:
    """Engines a test appends here are closed after it (workers, then schedulers)."""
    made: list[Any] = []
    yield made
    for engine in made:
        engine.close()
