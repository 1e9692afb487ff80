"""Helpers every test may import: ``from support.redis_servers import RedisServer``.

pytest puts ``tests/`` on ``sys.path`` (``pythonpath`` in pyproject.toml), so this is
one package for the unit, integration and e2e trees alike: real servers
(:mod:`~support.redis_servers`, :mod:`~support.s3_server`), a sidecar and its raw
clients (:mod:`~support.sidecar_helpers`, :mod:`~support.sidecar_client`), files on
real disks (:mod:`~support.disk_files`), another local user (:mod:`~support.other_user`),
a rate-capped link (:mod:`~support.slow_link`), vLLM's scheduler harness
(:mod:`~support.vllm_helpers`, which ``benchmarks/vllm_step.py`` builds its engine with
too), the demo engine as a process (:mod:`~support.demo_server`) and the ops
commands' fixtures (:mod:`~support.ops_helpers`).

A helper that a test runs as a process of its own (``sidecar_client``,
``vllm_worker_process``) is started as ``python -m support.NAME`` with
:func:`child_env`, which puts ``tests/`` on that process's ``PYTHONPATH``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["ROOT", "TESTS", "child_env"]

TESTS = Path(__file__).resolve().parents[1]
"""The ``tests/`` folder (what ``pythonpath`` adds, so ``support`` imports)."""
ROOT = TESTS.parent
"""The checkout's root (README.md, pyproject.toml, docs/, benchmarks/)."""


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with ``tests/`` first on ``PYTHONPATH``, for a
    child process that imports ``support``."""
    child = dict(os.environ if env is None else env)
    paths = [str(TESTS), *filter(None, child.get("PYTHONPATH", "").split(os.pathsep))]
    child["PYTHONPATH"] = os.pathsep.join(paths)
    return child
