"""The committed stubs in lmtier/v1 are what proto/generate.py makes of the .proto files."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support import ROOT

pytestmark = pytest.mark.integration


def test_regenerating_the_stubs_changes_nothing() -> None:
    pytest.importorskip("grpc_tools")
    run = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
