"""The ``lmtier`` command line: keys from stdin, files and the sample; clear errors."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest

from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.chunks.hashers import chunk_keys
from lmtier.chunks.keys import Namespace
from lmtier.cli import main
from lmtier.config import CPUTierConfig, DiskTierConfig
from lmtier.extras import missing_extra


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


def test_keys_of_a_paged_layout_carry_its_block_size() -> None:
    tokens = " ".join(map(str, range(32)))
    args = ["keys", "--chunk-size", "16", "--model-id", "m", "--kv-layout", "LBHSC"]
    code, out, _ = run_cli([*args, "--kv-block-size", "8"], stdin=tokens)
    assert code == 0
    namespace = Namespace(model_id="m", chunk_size=16, kv_layout="LBHSC", kv_block_size=8)
    assert out.split() == [k.hex() for k in chunk_keys(list(range(32)), namespace)]
    _, other, _ = run_cli([*args, "--kv-block-size", "16"], stdin=tokens)
    assert set(other.split()).isdisjoint(out.split())


def test_keys_of_a_paged_layout_carry_its_page_interior() -> None:
    tokens = " ".join(map(str, range(32)))
    args = ["keys", "--chunk-size", "16", "--model-id", "m", "--kv-layout", "LBHSC"]
    args += ["--kv-block-size", "8"]
    code, cpu, _ = run_cli([*args, "--kv-page-interior", "cpu_attn"], stdin=tokens)
    assert code == 0
    namespace = Namespace(
        model_id="m", chunk_size=16, kv_layout="LBHSC", kv_block_size=8, kv_page_interior="cpu_attn"
    )
    assert cpu.split() == [k.hex() for k in chunk_keys(list(range(32)), namespace)]
    _, gpu, _ = run_cli([*args, "--kv-page-interior", "flash"], stdin=tokens)
    assert set(gpu.split()).isdisjoint(cpu.split())


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


def test_chunk_size_is_checked_as_the_config_checks_it() -> None:
    for size in ("17", "0", str(2**40)):
        code, out, err = run_cli(["keys", "--sample", "--chunk-size", size])
        assert (code, out) == (2, "")
        assert "--chunk-size must be a positive multiple of 16" in err


def test_keys_for_a_geometry_are_the_keys_a_cache_of_it_uses() -> None:
    spec = KVSpec(num_layers=2, num_kv_heads=4, head_dim=8, dtype="bfloat16")
    config = LMTierConfig(  # a small CPU tier: the default 4 GiB is touched at open
        chunk_size=16,
        cpu=CPUTierConfig(capacity_bytes=1 << 20, staging_bytes=1 << 20),
        disk=DiskTierConfig(enabled=False),
    )
    tokens = list(range(50))
    args = ["keys", "--chunk-size", "16", "--model-id", "m", "--cache-salt", "t"]
    args += ["--num-layers", "2", "--num-kv-heads", "4", "--head-dim", "8"]
    code, out, _ = run_cli([*args, "--kv-dtype", "bfloat16"], stdin=" ".join(map(str, tokens)))
    assert code == 0
    with LMTier.open(config, kv=spec, model_id="m") as cache:
        assert out.split() == [key.hex() for key in cache.keys(tokens, cache_salt="t")]
    # Another geometry or dtype: other keys.
    _, other, _ = run_cli(args, stdin=" ".join(map(str, tokens)))
    assert set(other.split()).isdisjoint(out.split())


@pytest.mark.parametrize(
    ("args", "usage"),
    [
        (["keys", "--chunk-sise", "16"], "usage: lmtier keys "),
        (["serve", "--listn", "x"], "usage: lmtier serve "),
        (["demo", "serve", "--prot", "1"], "usage: lmtier demo serve "),
        (["cluster", "up", "--node", "2", "--bogus"], "usage: lmtier cluster up "),
    ],
)
def test_a_wrong_option_shows_the_usage_of_its_subcommand(
    args: list[str], usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """It showed the top-level usage (the list of commands) instead."""
    with pytest.raises(SystemExit) as caught:
        main(args)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert f"{usage.split(': ')[1].strip()}: error: unrecognized arguments: " in err


def test_a_global_option_after_the_command_says_where_it_goes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["keys", "-v", "--sample"])
    assert "before the command" in capsys.readouterr().err


class _Interrupting(io.StringIO):
    def __iter__(self) -> Any:
        raise KeyboardInterrupt

    def read(self, size: int | None = -1) -> str:
        raise KeyboardInterrupt


def test_ctrl_c_while_a_command_starts_exits_130_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A KeyboardInterrupt traceback before; 130 is what a shell reports for Ctrl-C."""
    monkeypatch.setattr(sys, "stdin", _Interrupting())
    assert main(["keys"]) == 130
    assert capsys.readouterr().err == "lmtier keys: interrupted\n"


def test_a_missing_extra_is_one_line_with_its_install_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def needs_grpc(args: Any, config: Any) -> int:
        raise ModuleNotFoundError("No module named 'grpc'", name="grpc")

    monkeypatch.setattr("lmtier.cli._cmd_keys", needs_grpc)
    assert main(["keys", "--sample"]) == 2
    err = capsys.readouterr().err
    assert err == f"lmtier keys: error: {missing_extra_message('grpc')}\n"


def missing_extra_message(module: str) -> str:
    error = missing_extra(ModuleNotFoundError(name=module))
    assert error is not None
    return str(error)


def test_a_missing_module_of_no_extra_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(args: Any, config: Any) -> int:
        raise ModuleNotFoundError("No module named 'lmtier.nothing'", name="lmtier.nothing")

    monkeypatch.setattr("lmtier.cli._cmd_keys", broken)
    with pytest.raises(ModuleNotFoundError):
        main(["keys", "--sample"])


@pytest.mark.parametrize("command", ["demo", "warm"])
def test_a_model_directory_that_is_none_is_one_line(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--model`` naming a directory without config.json: a FileNotFoundError
    traceback from the demo before."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"tokens": [1, 2, 3]}\n')
    argv = [command, "--model", str(tmp_path / "nope")] + (
        [str(prompts)] if command == "warm" else []
    )
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json" in err and "Traceback" not in err
