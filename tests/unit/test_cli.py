"""The ``lmtier`` command line: keys from stdin, files and the sample; clear errors."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from lmtier.cli import main
from lmtier.keys import Namespace, chunk_keys


def run_cli(
    args: list[str], stdin: str = "", monkeypatch: pytest.MonkeyPatch | None = None
) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    mp = monkeypatch or pytest.MonkeyPatch()
    mp.setattr(sys, "stdin", io.StringIO(stdin))
    mp.setattr(sys, "stdout", out)
    mp.setattr(sys, "stderr", err)
    mp.setenv("XDG_CACHE_HOME", "/tmp/lmtier-cli-test-cache")
    try:
        code = main(args)
    finally:
        if monkeypatch is None:
            mp.undo()
    return code, out.getvalue(), err.getvalue()


def test_keys_from_stdin_match_the_library() -> None:
    tokens = list(range(40))
    code, out, _ = run_cli(
        ["keys", "--chunk-size", "16", "--model-id", "m", "--cache-salt", "s"],
        stdin=" ".join(map(str, tokens[:20])) + "\n" + " ".join(map(str, tokens[20:])),
    )
    assert code == 0
    expected = chunk_keys(tokens, Namespace(model_id="m", chunk_size=16, cache_salt="s"))
    assert out.split() == [k.hex() for k in expected]


def test_keys_from_a_file_in_vllm_mode(tmp_path: Path) -> None:
    path = tmp_path / "prompt.txt"
    path.write_text(" ".join(str(i) for i in range(64)))
    code, out, _ = run_cli(["keys", "--chunk-size", "32", "--hash", "vllm", str(path)])
    assert code == 0
    expected = chunk_keys(list(range(64)), Namespace(model_id="", chunk_size=32), algorithm="vllm")
    assert out.split() == [k.hex() for k in expected]


def test_sample_prints_three_keys() -> None:
    code, out, _ = run_cli(["keys", "--sample"])
    assert code == 0
    assert len(out.split()) == 1000 // 256
    assert all(len(line) == 64 for line in out.split())


@pytest.mark.parametrize(
    ("stdin", "message"),
    [
        ("1 2 x3", "'x3' is not an integer token id"),
        ("1 -2 3", "must be >= 0"),
        ("1 2.5", "'2.5' is not an integer"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(stdin: str, message: str) -> None:
    code, out, err = run_cli(["keys"], stdin=stdin)
    assert code == 2
    assert out == ""
    assert message in err
    assert "Traceback" not in err
    assert err.count("\n") == 1


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    code, _, err = run_cli(["keys", str(tmp_path / "nope.txt")])
    assert code == 2
    assert "cannot read token ids" in err


def test_bad_config_key_is_a_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("chunk_sise: 256\n")
    code, _, err = run_cli(["--config", str(config), "keys", "--sample"])
    assert code == 2
    assert "chunk_size" in err


def test_help_describes_the_keys_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lmtier.cli", "keys", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for option in ("--chunk-size", "--model-id", "--cache-salt", "--hash", "--sample"):
        assert option in result.stdout
