"""The README's Python example runs as written, twice (the second run hits disk)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # the example twice, a process each

README = ROOT / "README.md"


def test_readme_python_example_runs_twice(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert blocks, "the README has no Python example"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}

    def run() -> list[str]:
        done = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, check=True
        )
        return done.stdout.split("\n")[:2]

    assert run() == ["{}", "{'cpu': 768}"]
    assert run() == ["{'disk': 768}", "{'disk': 768}"]
