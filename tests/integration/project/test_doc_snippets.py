"""Every Python block of README.md and docs/*.md runs as written (the conventions are
:mod:`doc_snippets`'s).

A page runs in a process of its own, in a temporary home: ``HOME``,
``XDG_CACHE_HOME``, ``XDG_CONFIG_HOME`` and ``XDG_RUNTIME_DIR`` are fresh folders, no
``LMTIER_*`` or ``LMCACHE_*`` variable is passed, and it runs in an empty folder, so it
never touches the user's cache. It runs twice on the same home, as a reader runs it
twice: a first run on an empty cache, then a later one. A page with a block marked
``sidecar`` has no sidecar in the first run and ``lmtier serve`` on its default
socket (``$XDG_RUNTIME_DIR/lmtier/sidecar.sock``) in the second.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from lmtier.testing.sidecar import SidecarProcess
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.v1 import sidecar_pb2_grpc as pb_grpc
from lmtier.wire.address import default_listen
from support.doc_snippets import MAX_FRAGMENTS, NEEDS, ROOT, Block, blocks_of, pages
from support.sidecar_helpers import CALL_TIMEOUT_S, open_session

pytestmark = pytest.mark.integration

RUN_TIMEOUT_S = 120
"""For a hang only: a page runs in 5-10 s here (two runs fit pytest's 300 s)."""
SIDECAR = {"cpu": {"capacity_bytes": "16MiB", "staging_bytes": "16MiB"}}
"""The sidecar a page's ``lmtier serve`` stands for: the default config but a small
host memory (its default, 4 GiB, is not this test's to take)."""
RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for name, line, code in json.load(sys.stdin):
    print(f"--- {name}", flush=True)
    exec(compile("\\n" * (line - 1) + code, name.split(":")[0], "exec"), namespace)
"""
"""Runs the blocks given on stdin in one namespace; a block's traceback names its page
and the page's line."""

ALL = {page: blocks_of(page) for page in pages()}
RUNNABLE = {page: [b for b in blocks if not b.fragment] for page, blocks in ALL.items()}
PAGES = [page for page, blocks in RUNNABLE.items() if blocks]


def test_the_pages_follow_the_conventions() -> None:
    blocks = [block for page in ALL.values() for block in page]
    assert blocks, "no Python block found: is the parser broken?"
    for block in blocks:
        assert block.needs <= NEEDS, f"{block.name}: unknown need {sorted(block.needs - NEEDS)}"
    fragments = [block.name for block in blocks if block.fragment]
    assert len(fragments) <= MAX_FRAGMENTS, f"too many fragments: {fragments}"


class Home:
    """A temporary home for a page's runs (module docstring), in a short path: the
    sidecar's socket lives in it, and a socket's path is at most 107 bytes."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="lmtier-doc-"))
        self.folders = {
            name: self.root / name for name in ("home", "cache", "config", "run", "work")
        }
        for folder in self.folders.values():
            folder.mkdir(mode=0o700)

    @property
    def env(self) -> dict[str, str]:
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("LMTIER_", "LMCACHE_", "XDG_"))
        }
        env.update(
            HOME=str(self.folders["home"]),
            XDG_CACHE_HOME=str(self.folders["cache"]),
            XDG_CONFIG_HOME=str(self.folders["config"]),
            XDG_RUNTIME_DIR=str(self.folders["run"]),
        )
        return env

    def run(self, blocks: list[Block]) -> str:
        """Run ``blocks`` in one interpreter; what they printed (fails with its output
        if one raises)."""
        payload = json.dumps([(b.name, b.line, b.code) for b in blocks])
        done = subprocess.run(
            [sys.executable, "-c", RUNNER],
            input=payload,
            capture_output=True,
            text=True,
            cwd=self.folders["work"],
            env=self.env,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
        assert "Traceback" not in done.stderr, done.stderr
        return done.stdout


@pytest.fixture
def home() -> Iterator[Home]:
    made = Home()
    try:
        yield made
    finally:
        shutil.rmtree(made.root, ignore_errors=True)


def sidecar_chunks(target: str) -> int:
    """Chunks in the host memory of the sidecar at ``target`` (its Stats)."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.SidecarStub(channel)
        with open_session(stub) as session:
            reply = stub.Stats(pb.StatsRequest(session_id=session.id), timeout=CALL_TIMEOUT_S)
    return int(reply.tiers["cpu"].values["chunks"])


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_a_pages_python_runs_as_written_twice(page: Path, home: Home) -> None:
    blocks = RUNNABLE[page]
    home.run(blocks)  # the first run: an empty cache (and no sidecar)
    if not any("sidecar" in block.needs for block in blocks):
        home.run(blocks)
        return
    target = default_listen(home.env)
    with SidecarProcess(home.root / "sidecar", SIDECAR, listen=target, env=home.env):
        home.run(blocks)  # a later run, with `lmtier serve` where the page says
        assert sidecar_chunks(target) > 0, "the blocks marked sidecar stored nothing there"
