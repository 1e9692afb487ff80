"""``lmtier purge`` asking on a terminal: an answer that is not yes deletes nothing and
says so (it exited 2 without a word), Ctrl-D too."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest

from lmtier.cli import main
from support.ops_helpers import CHUNK, GEOMETRY, MODEL_ID, chunk_file, store, write_config


class Terminal(io.StringIO):
    """Standard input as a terminal that types ``answer``."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("answer", ["n\n", "\n", "maybe\n", ""], ids=["n", "enter", "other", "eof"])
def test_not_confirmed_deletes_nothing_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], answer: str
) -> None:
    config_path = write_config(tmp_path)
    keys = store(config_path, list(range(2 * CHUNK)), model_id=MODEL_ID)
    monkeypatch.setattr(sys, "stdin", Terminal(answer))
    for name in [k for k in os.environ if k.startswith("LMTIER_")]:
        monkeypatch.delenv(name)
    code = main(["--config", str(config_path), "purge", *GEOMETRY])
    out, err = capsys.readouterr()
    assert code == 2
    assert "Delete 2 chunks" in out
    assert err.strip() == "lmtier purge: not confirmed: nothing deleted"
    assert all(chunk_file(config_path, key).exists() for key in keys)
