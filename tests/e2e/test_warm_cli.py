"""`lmtier warm` as a user runs it, a process each: input without line ends ends in an
error instead of spinning; a model directory without tokenizer files warms token-id
prompts; a directory named two ways is one namespace; a warm with nothing to do loads
no model, and ``--via`` no torch; transformers' progress bars stay out of the output;
and a SIGINT whose KeyboardInterrupt Python dropped still ends the run with 130."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_hf_cache import tiny_llama

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHUNK = 16
LIMIT_S = 300
"""Per process: long enough for any loaded machine, short of the hang it catches."""

REPORT = """
import json, sys
from lmtier.cli import main
code = main(sys.argv[1:])
watched = ("torch", "transformers", "transformers.models.llama.modeling_llama")
print(json.dumps({"loaded": [m for m in watched if m in sys.modules]}), file=sys.stderr)
sys.exit(code)
"""
"""``lmtier ARGS``, then which heavy modules the run imported (the last stderr line)."""

LOSES_THE_SIGINT = """
import signal, sys
from lmtier.cli import main
from lmtier_apps.warm import command

class Swallows:
    # CPython prints a KeyboardInterrupt raised in a finaliser as "Exception ignored"
    # and drops it: as when SIGINT lands while the collector finalises an object.
    def __del__(self):
        signal.raise_signal(signal.SIGINT)
        for _ in range(100):  # the handler runs at this loop's jump, inside __del__
            pass

def losing(paths, **kwargs):
    for number, item in enumerate(read(paths, **kwargs)):
        if number == 1:
            Swallows()
        yield item

read, command.read_prompts = command.read_prompts, losing
sys.exit(main(sys.argv[1:]))
"""
"""``lmtier ARGS`` where a SIGINT arrives as the second prompt is read and its
KeyboardInterrupt is lost."""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local Llama directory with weights and config.json but no tokenizer files."""
    directory = tmp_path_factory.mktemp("models") / "tiny"
    tiny_llama().save_pretrained(directory)
    assert not list(directory.glob("tokenizer*"))
    return directory


def write_config(directory: Path) -> Path:
    settings = {
        "chunk_size": CHUNK,
        "cpu": {"capacity_bytes": "16MiB", "staging_bytes": "4MiB"},
        "disk": {"path": str(directory / "chunks"), "capacity_bytes": "256MiB"},
    }
    path = directory / "lmtier.yaml"
    path.write_text(json.dumps(settings))
    return path


def lmtier(
    *args: str,
    cwd: Path | None = None,
    stdin: str | None = None,
    stdin_file: str | None = None,
    script: str | None = None,
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", script] if script else [sys.executable, "-m", "lmtier.cli"]
    source = open(stdin_file, "rb") if stdin_file else None  # noqa: SIM115 - closed below
    try:
        return subprocess.run(
            [*command, *args],
            cwd=cwd,
            input=stdin,
            stdin=source,
            capture_output=True,
            text=True,
            timeout=LIMIT_S,
            check=False,
        )
    finally:
        if source is not None:
            source.close()


def summary_of(done: subprocess.CompletedProcess[str]) -> Any:
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["schema"] == "lmtier.warm/1"
    return summary


def loaded_by(done: subprocess.CompletedProcess[str]) -> list[str]:
    loaded: list[str] = json.loads(done.stderr.strip().splitlines()[-1])["loaded"]
    return loaded


def token_lines(*starts: int, length: int = 3 * CHUNK) -> str:
    return "".join(json.dumps({"tokens": list(range(s, s + length))}) + "\n" for s in starts)


def test_input_without_line_ends_is_an_error_not_a_spin(tmp_path: Path, tiny_model: Path) -> None:
    config = write_config(tmp_path)
    named = tmp_path / "zero.jsonl"
    named.symlink_to("/dev/zero")
    base = ("--config", str(config), "warm", "--json", "--model", str(tiny_model))
    done = lmtier(*base, stdin_file="/dev/zero")
    assert done.returncode == 1, done.stderr[-2000:]
    assert summary_of(done)["errors"] == ["<stdin>: a text prompt larger than 16777216 bytes"]
    done = lmtier(*base, "/dev/zero")  # a name that says nothing: sniffed like stdin
    assert done.returncode == 1 and summary_of(done)["failed"] == 1
    done = lmtier(*base, str(named))  # JSONL by its name: a line that never ends
    assert done.returncode == 1, done.stderr[-2000:]
    errors = summary_of(done)["errors"]
    assert errors[0] == f"{named}:1: line longer than 16777216 bytes"
    assert errors[1].startswith(f"{named}:1: no line end within") and len(errors) == 2
    assert "Traceback" not in done.stderr


def test_a_model_directory_without_tokenizer_files_warms_token_ids(
    tmp_path: Path, tiny_model: Path
) -> None:
    # Warmed with a relative spelling of the directory, looked up with its absolute
    # path: one namespace. Text needs the tokenizer the directory lacks: one line.
    config = write_config(tmp_path)
    relative = Path("..") / tiny_model.parent.name / tiny_model.name  # from its own folder
    prompts = token_lines(10, 200) + json.dumps({"prompt": "some text"}) + "\n"
    args = ("--config", str(config), "warm", "--json", "--model", str(relative), "-")
    done = lmtier(*args, cwd=tiny_model.parent, stdin=prompts)
    assert done.returncode == 1, done.stderr[-2000:]
    summary = summary_of(done)
    assert (summary["warmed"], summary["failed"]) == (2, 1)
    problems = [line for line in done.stderr.splitlines() if line.startswith("lmtier warm:")]
    assert len(problems) == 1 and problems[0].startswith("lmtier warm: <stdin>:3: ")
    assert "no usable tokenizer" in problems[0]
    assert "Loading weights" not in done.stderr and "it/s" not in done.stderr, "no bars"

    tokens = " ".join(map(str, range(10, 10 + 3 * CHUNK)))
    looked = lmtier(
        *("--config", str(config), "lookup", "--model", str(tiny_model), "--json"),
        *("--tokens", tokens),
    )
    assert looked.returncode == 0, looked.stderr[-2000:]
    assert json.loads(looked.stdout)["cached_tokens"] == 3 * CHUNK


def test_nothing_to_do_loads_no_model_and_via_imports_no_torch(
    tmp_path: Path, tiny_model: Path
) -> None:
    config = write_config(tmp_path)
    prompts = token_lines(10, 200)
    args = ("--config", str(config), "warm", "--json")
    first = lmtier(*args, "--model", str(tiny_model), "-", stdin=prompts, script=REPORT)
    assert first.returncode == 0, first.stderr[-2000:]
    assert summary_of(first)["warmed"] == 2 and "transformers" in loaded_by(first)
    again = lmtier(*args, "--model", str(tiny_model), "-", stdin=prompts, script=REPORT)
    assert again.returncode == 0, again.stderr[-2000:]
    assert summary_of(again)["skipped"] == 2
    assert loaded_by(again) == ["torch"], "the cache's lookups; no transformers, no weights"

    # The random demo model is built either way: its revision hashes the weights drawn
    # (hf.demo_model.demo_revision), so that another transformers' initialisation is
    # another model; then nothing is computed.
    demo = lmtier(*args, "-", stdin=prompts, script=REPORT)
    assert demo.returncode == 0 and summary_of(demo)["warmed"] == 2
    demo = lmtier(*args, "-", stdin=prompts, script=REPORT)
    assert demo.returncode == 0 and summary_of(demo)["skipped"] == 2

    via = lmtier(*args, "--via", "http://127.0.0.1:9", "-", stdin=prompts, script=REPORT)
    assert via.returncode == 1 and "127.0.0.1:9" in via.stderr
    assert loaded_by(via) == [], "an HTTP client needs neither torch nor transformers"


def test_a_sigint_whose_keyboard_interrupt_was_lost_still_exits_130(
    tmp_path: Path, tiny_model: Path
) -> None:
    config = write_config(tmp_path)
    prompts = token_lines(10, 100, 200, 300)
    args = ("--config", str(config), "warm", "--json", "--model", str(tiny_model), "-")
    done = lmtier(*args, stdin=prompts, script=LOSES_THE_SIGINT)
    assert done.returncode == 130, done.stderr[-2000:]
    summary = summary_of(done)
    assert summary["interrupted"] and 1 <= summary["warmed"] <= 2
    resumed = lmtier(*args, stdin=prompts)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    again = summary_of(resumed)
    assert again["skipped"] == summary["warmed"] and again["warmed"] == 4 - summary["warmed"]
