"""The live lane: real ``vllm serve`` engines (vLLM's CPU build) with lmtier's
connector, started and stopped by their own pids (:mod:`support.vllm_serve`).

Every test here is marked ``live``. It runs in the environment that holds vLLM's CPU
build, ``.venv-live`` (``.ci/run`` builds it and runs this lane there on its own:
``.venv-live/bin/python -m pytest tests/live``); anywhere else the tests are
skipped with the reason. They take minutes, not seconds: each engine start is
15-25 s on two cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support.vllm_serve import build_tiny_model, live_engine_missing

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = live_engine_missing()
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.live)
            if missing is not None:
                item.add_marker(pytest.mark.skip(reason=missing))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random Llama and its tokenizer, built once per run."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
