""".ci/run installs the test dependencies into a virtual environment of its own and
runs everything there: run in the README's environment it used to install vLLM's pins
into it (numpy and transformers downgraded under the user).

The script runs for real (bash), in a copy of its checkout, with every program it
calls replaced by a stub on PATH that records who ran it with which arguments:
``python3`` (whose ``-m venv DIR`` makes a fake environment with a recording
``bin/python``), ``apt-get``, ``redis-server`` and ``docker-compose``. Nothing is
installed anywhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from support import ROOT

pytestmark = pytest.mark.integration


STUB = """#!/bin/sh
echo "{name} $*" >> "{log}"
"""
PYTHON3 = """#!/bin/sh
echo "python3 $*" >> "{log}"
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
    mkdir -p "$3/bin" "$3/lib/site-packages"
    echo "home = /usr/bin" > "$3/pyvenv.cfg"
    printf '#!/bin/sh\\necho "venv-python $*" >> "{log}"\\n' > "$3/bin/python"
    printf 'if [ "$1" = "-c" ]; then echo "%s/lib/site-packages"; fi\\n' "$3" >> "$3/bin/python"
    chmod +x "$3/bin/python"
fi
"""


def stub(folder: Path, name: str, text: str) -> None:
    path = folder / name
    path.write_text(text)
    path.chmod(0o755)


def checkout(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    """A copy of the script and pyproject.toml, the stubs, and the environment."""
    repo, bin_dir, log = tmp_path / "repo", tmp_path / "bin", tmp_path / "calls.log"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy2(ROOT / ".ci" / "run", repo / ".ci" / "run")
    shutil.copy2(ROOT / "pyproject.toml", repo / "pyproject.toml")
    bin_dir.mkdir()
    stub(bin_dir, "python3", PYTHON3.format(log=log))
    for name in ("python", "apt-get", "redis-server", "docker-compose", "ruff", "mypy", "pip"):
        stub(bin_dir, name, STUB.format(name=name, log=log))
    # The stubs first; the rest of PATH for bash's own tools (cat, sha256sum, rm, ...).
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("LMTIER_CI_VENV", None)
    env.pop("VIRTUAL_ENV", None)
    return repo, log, env


def run(repo: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(repo / ".ci" / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard: the stubs return at once
        check=False,
    )


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_the_packages_go_into_its_own_environment_and_everything_runs_there(
    tmp_path: Path,
) -> None:
    repo, log, env = checkout(tmp_path)
    result = run(repo, env)
    assert result.returncode == 0, result.stderr
    made = calls(log)
    installs = [c for c in made if "-m pip install" in c or c.startswith("pip ")]
    assert installs, made
    # Not one install by the interpreter that ran the script, nor by a bare pip.
    assert all(c.startswith("venv-python -m pip install") for c in installs), installs
    assert f"python3 -m venv {repo / '.venv-ci'}" in made
    assert f"python3 -m venv {repo / '.venv-live'}" in made  # vLLM's CPU build: its own
    for tool in (
        "-m ruff check .",
        "-m ruff format --check .",
        "-m mypy",
        "-m pytest -q -n 2 --durations=30 -m not live",
        "-m pytest -q tests/live --durations=10",
    ):
        assert f"venv-python {tool}" in made, made
    # The live environment's metadata-only "vllm" went into its own site-packages.
    assert (repo / ".venv-live/lib/site-packages/vllm-0.32.0+cpu.dist-info/METADATA").exists()
    assert not [c for c in made if c.split()[0] in ("ruff", "mypy", "python", "apt-get")]


def test_a_rerun_reuses_the_environment_until_the_project_changes(tmp_path: Path) -> None:
    repo, log, env = checkout(tmp_path)
    assert run(repo, env).returncode == 0
    log.unlink()
    assert run(repo, env).returncode == 0
    assert not [c for c in calls(log) if "pip install" in c or "-m venv" in c], calls(log)
    assert any("-m pytest" in c for c in calls(log))
    with (repo / "pyproject.toml").open("a") as project:
        project.write("\n# a new dependency\n")
    log.unlink()
    assert run(repo, env).returncode == 0
    assert any("-m venv" in c for c in calls(log)), calls(log)


def test_a_directory_that_is_not_an_environment_is_never_replaced(tmp_path: Path) -> None:
    repo, log, env = checkout(tmp_path)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data").write_text("keep me")
    result = run(repo, {**env, "LMTIER_CI_VENV": str(precious)})
    assert result.returncode == 1
    assert "not a virtual environment" in result.stderr
    assert (precious / "data").read_text() == "keep me"
    assert not [c for c in calls(log) if "pip" in c]
