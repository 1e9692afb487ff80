"""``lmtier lookup``: cached tokens per tier for token ids or text, keyed as engines key."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from lmtier import cli
from lmtier.errors import InvalidTokensError
from lmtier.model_dir import model_identity
from lmtier.ops.model_args import model_settings
from support.ops_helpers import (
    CHUNK,
    GEOMETRY,
    SPEC,
    run_here,
    store,
    write_config,
)

PROMPT = list(range(100, 100 + 6 * CHUNK + 5))  # six full chunks and a tail
WORDS = 60


def make_model_dir(directory: Path) -> Path:
    """A transformers model directory as far as keys go: config.json (a Llama of
    SPEC's geometry) and a word-level tokenizer.json that adds a BOS token."""
    directory.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": SPEC.num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": SPEC.num_kv_heads,
        "hidden_size": 4 * SPEC.head_dim,
        "vocab_size": WORDS + 2,
        "dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config))
    vocab = {"[UNK]": 0, "[BOS]": 1, **{f"w{i}": i + 2 for i in range(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", 1)]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def test_human_output_and_the_other_inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_path = write_config(tmp_path)
    store(config_path, PROMPT)
    ids_file = tmp_path / "prompt.txt"
    ids_file.write_text(" ".join(map(str, PROMPT[:50])) + "\n")
    base = ["--config", str(config_path), "lookup", *GEOMETRY]
    code, out, err = run_here(monkeypatch, *base, "--tokens", " ".join(map(str, PROMPT)))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"{len(PROMPT)} tokens: 6 full chunks of {CHUNK} (+5 tail")
    assert lines[1].startswith(f"cached: {6 * CHUNK} tokens")
    assert lines[-1].split() == ["disk", str(6 * CHUNK)]
    code, out, _ = run_here(monkeypatch, *base, str(ids_file), "--json")
    assert code == 0 and json.loads(out)["tokens_by_tier"] == {"disk": 3 * CHUNK}
    code, out, _ = run_here(monkeypatch, *base, "--cache-salt", "other", "--tokens", "1 2")
    assert code == 0 and "cached: 0 tokens" in out


def test_text_with_a_model_directory_is_keyed_as_the_model_stores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model_dir(tmp_path / "model")
    geometry, vocab = model_settings(model)
    assert geometry == {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"}
    assert vocab == WORDS + 2
    text = " ".join(f"w{i % WORDS}" for i in range(3 * CHUNK + 4))
    ids = Tokenizer.from_file(str(model / "tokenizer.json")).encode(text).ids
    assert ids[0] == 1 and len(ids) == 3 * CHUNK + 5  # BOS, then one id per word
    config_path = write_config(tmp_path, model_id="")
    model_id, revision = model_identity(model)
    store(config_path, ids[: 2 * CHUNK], model_id=model_id, model_revision=revision)
    (tmp_path / "prompt.txt").write_text(text)
    for source in (["--text", text], ["--text-file", str(tmp_path / "prompt.txt")]):
        code, out, err = run_here(
            monkeypatch,
            *["--config", str(config_path), "lookup", "--model", str(model), "--json"],
            *source,
        )
        assert code == 0, err
        report = json.loads(out)
        assert (report["model_id"], report["model_revision"]) == (model_id, revision)
        assert report["tokens"] == len(ids)
        assert report["tokens_by_tier"] == {"disk": 2 * CHUNK}


def test_tensor_parallel_engines_are_looked_up_by_rank_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_path = write_config(tmp_path)
    store(config_path, PROMPT, tp_size=2, tp_rank=0)
    base = ["--config", str(config_path), "lookup", *GEOMETRY, "--json"]
    tokens = ["--tokens", " ".join(map(str, PROMPT))]
    code, out, _ = run_here(monkeypatch, *base, *tokens, "--tp-size", "2")
    assert code == 0 and json.loads(out)["cached_tokens"] == 6 * CHUNK
    code, out, _ = run_here(monkeypatch, *base, *tokens)  # another namespace
    assert code == 0 and json.loads(out)["cached_tokens"] == 0


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        ([], "1 2 3", "give --model DIR, or the KV geometry"),
        ([*GEOMETRY, "--text", "hello"], "", "text needs --model DIR"),
        (GEOMETRY, "1 2 x", "<stdin>:1: 'x' is not an integer token id"),
        ([*GEOMETRY, "--tokens", "1 -2"], "", "token"),
        (["--model", "/nonexistent/model"], "1", "not a model directory"),
    ],
)
def test_bad_input_is_a_one_line_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    stdin: str,
    message: str,
) -> None:
    config_path = write_config(tmp_path)
    code, out, err = run_here(
        monkeypatch, "--config", str(config_path), "lookup", *args, stdin=stdin
    )
    assert code == 2 and out == ""
    assert err.startswith("lmtier lookup: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_one_chunk_is_said_in_the_singular(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_path = write_config(tmp_path)
    base = ["--config", str(config_path), "lookup", *GEOMETRY]
    code, out, err = run_here(
        monkeypatch, *base, "--tokens", " ".join(map(str, PROMPT[: CHUNK + 1]))
    )
    assert code == 0, err
    assert out.splitlines()[0].startswith(
        f"{CHUNK + 1} tokens: 1 full chunk of {CHUNK} (+1 tail token,"
    )


def test_token_ids_are_read_in_blocks_with_their_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "_READ_BLOCK", 3)  # words and line ends cut across blocks
    assert cli.read_token_ids(io.StringIO("1 22 333\n4444\n\n5 6"), "f") == [1, 22, 333, 4444, 5, 6]
    with pytest.raises(InvalidTokensError, match=r"^f:4: 'x7' is not an integer token id$"):
        cli.read_token_ids(io.StringIO("1 22\n333\n\nx7 8"), "f")


def test_input_without_an_end_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "MAX_INPUT_CHARS", 1000)
    with pytest.raises(InvalidTokensError, match=r"^f: more than 1000 characters of token ids"):
        cli.read_token_ids(io.StringIO("1 " * 600), "f")
    with pytest.raises(InvalidTokensError, match=r"^f:1: '\\x00\\x00.*' is not a token id$"):
        cli.read_token_ids(io.StringIO("\0" * 900), "f")  # /dev/zero: one endless word
