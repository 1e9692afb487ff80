"""The ``lmtier`` command line as a process: help, no password in verbose logs, and a
start that imports neither torch nor transformers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration


def test_help_describes_the_keys_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lmtier.cli", "keys", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for option in ("--chunk-size", "--model-id", "--cache-salt", "--hash", "--sample"):
        assert option in result.stdout


@pytest.mark.parametrize("password", ["p@ss#w/rd?1", "x%23y"])
def test_verbose_output_never_shows_a_redis_password(password: str) -> None:
    env = {**os.environ, "LMTIER_REDIS__URL": f"redis://default:{password}@cache:6379/0"}
    result = subprocess.run(
        [sys.executable, "-m", "lmtier.cli", "-vv", "keys", "--sample"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert password not in result.stdout + result.stderr
    if result.returncode:  # an unencoded delimiter: one clear line, naming the setting
        assert "redis.url" in result.stderr and "percent-encode" in result.stderr


@pytest.mark.parametrize("args", [["keys", "--sample"], ["--help"], ["keys", "--help"]])
def test_the_cli_starts_without_torch_or_transformers(args: list[str]) -> None:
    # In a fresh process: which modules did building the CLI and running it load?
    script = textwrap.dedent(
        f"""
        import contextlib, io, sys
        from lmtier.cli import main
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            main({args!r})
        loaded = [m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")]
        print(sorted(loaded), "lmtier_apps.demo.cli" in sys.modules)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[] True"  # the demo is registered, not imported
