"""After the README's first install a module of another extra may be missing: each
``lmtier`` subcommand then says in one line which extra to install, as a real process
in which the modules are hidden (a meta-path finder installed by a ``sitecustomize``
on PYTHONPATH refuses them, as an environment without them would), and a local
cluster that fails to start leaves no ``cluster.json`` behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmtier.extras import install_command

pytestmark = pytest.mark.integration

BLOCKER = '''
import os, sys

HIDDEN = set(os.environ["HIDE_MODULES_FOR_TEST"].split(","))


class Hide:
    """Refuse the hidden top-level modules (and everything under them)."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Hide())
'''


def lmtier(tmp_path: Path, hide: str, *args: str) -> subprocess.CompletedProcess[str]:
    site = tmp_path / "hide"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join(filter(None, (str(site), os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "PYTHONPATH": path, "HIDE_MODULES_FOR_TEST": hide}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    env["XDG_RUNTIME_DIR"] = str(tmp_path / "run")
    return subprocess.run(
        [sys.executable, "-m", "lmtier.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard: each exits before starting anything
        check=False,
        cwd=tmp_path,
    )


@pytest.mark.parametrize(
    ("hide", "args", "command", "extra"),
    [
        ("grpc", ["serve"], "lmtier serve", "grpc"),
        ("uvicorn", ["demo", "serve", "--port", "0"], "lmtier demo serve", "serve"),
        ("redis", ["cluster", "up", "--dir", "cluster"], "lmtier cluster up", "redis"),
        ("grpc", ["stats", "--sidecar", "unix:///nowhere.sock"], "lmtier stats", "grpc"),
    ],
)
def test_a_subcommand_without_its_extra_says_what_to_install(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    hide: str,
    args: list[str],
    command: str,
    extra: str,
) -> None:
    result = lmtier(tmp_path, hide, *args)
    monkeypatch.chdir(tmp_path)  # the child's directory, which the command may name
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"{command}: error: "), line
    assert f"the {extra!r} extra" in line
    assert line.endswith(install_command(extra)), line
    assert not (tmp_path / "cluster").exists()  # cluster up checks before it writes


def test_the_hidden_module_is_really_missing_in_the_child(tmp_path: Path) -> None:
    """The blocker works (else the test above proves nothing)."""
    site = tmp_path / "hide"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": str(site), "HIDE_MODULES_FOR_TEST": "json"}
    result = subprocess.run(
        [sys.executable, "-c", "import json"], env=env, capture_output=True, text=True, check=False
    )
    assert "No module named 'json'" in result.stderr


def test_a_failed_start_leaves_no_cluster_json(tmp_path: Path) -> None:
    """redis-server is not on PATH: the start fails after it wrote its state, which it
    removes (a stale cluster.json made `status` and `demo` talk of dead processes)."""
    directory = tmp_path / "cluster"
    env = {**os.environ, "PATH": str(tmp_path / "empty")}
    result = subprocess.run(
        [sys.executable, "-m", "lmtier.cli", "cluster", "up", "--dir", str(directory)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "redis-server is not on PATH" in result.stderr
    assert directory.is_dir()  # it got that far
    assert not (directory / "cluster.json").exists()
    status = subprocess.run(
        [sys.executable, "-m", "lmtier.cli", "cluster", "status", "--dir", str(directory)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert status.returncode == 2
    assert "no cluster in" in status.stderr
