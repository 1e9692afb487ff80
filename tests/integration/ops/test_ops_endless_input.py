"""``lmtier lookup`` and ``lmtier keys`` given input without an end (``/dev/zero``, as
a file, as stdin, as ``--text-file``): a one-line error, soon, instead of reading it
all (it grew to 5.7 GiB and died with a MemoryError traceback). A process each, under
an address-space cap so that a regression fails fast instead of taking the machine."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

GEOMETRY = ("--model-id", "m", "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "4")
MEMORY_CAP = 8 * 2**30


def _capped() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def lmtier(
    tmp_path: Path, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "lmtier.yaml"
    config.write_text(f"disk: {{path: {tmp_path / 'chunks'}}}\ncpu: {{capacity_bytes: 1MiB}}\n")
    with open(stdin or "/dev/null", "rb") as source:
        return subprocess.run(
            [sys.executable, "-m", "lmtier.cli", "--config", str(config), *args],
            stdin=source,
            capture_output=True,
            text=True,
            timeout=300,  # a hang, not a speed check
            check=False,
            preexec_fn=_capped,
        )


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (("lookup", *GEOMETRY, "/dev/zero"), None, "/dev/zero:1: '\\x00"),
        (("lookup", *GEOMETRY), "/dev/zero", "<stdin>:1: '\\x00"),
        (("keys", "--model-id", "m", "/dev/zero"), None, "/dev/zero:1: '\\x00"),
    ],
    ids=["lookup-file", "lookup-stdin", "keys-file"],
)
def test_endless_token_ids_are_a_one_line_error(
    tmp_path: Path, args: tuple[str, ...], stdin: str | None, message: str
) -> None:
    done = lmtier(tmp_path, *args, stdin=stdin)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert message in done.stderr and "is not a token id" in done.stderr


def test_endless_text_is_a_one_line_error(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        '{"num_hidden_layers": 1, "num_attention_heads": 1, "hidden_size": 4}'
    )
    done = lmtier(tmp_path, "lookup", "--model", str(model), "--text-file", "/dev/zero")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().endswith("characters: not a prompt")
    assert done.stderr.count("\n") == 1
