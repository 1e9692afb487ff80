"""lmtier_apps.warm.model: a model's namespace from its files (as the loaded model
names it), and a tokenizer loaded only when asked, whose absence is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmtier.errors import InvalidRequestError
from lmtier_apps.demo import demo_model
from lmtier_apps.warm import model
from lmtier_apps.warm.model import LazyTokenizer, warm_model


def weights_and_config_only(directory: Path, dtype: str = "bfloat16") -> Path:
    """A model directory with no tokenizer files: config.json and a weights file."""
    directory.mkdir()
    config = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 64,
        "vocab_size": 500,
        "max_position_embeddings": 1024,
        "dtype": dtype,
    }
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(b"not read here")
    return directory


def test_a_directory_is_named_from_its_files_as_its_loaded_weights_name_it(
    tmp_path: Path,
) -> None:
    found = warm_model(str(weights_and_config_only(tmp_path / "m")))
    assert found.model_id == str((tmp_path / "m").resolve())
    assert (found.spec.num_layers, found.spec.num_kv_heads, found.spec.head_dim) == (2, 2, 16)
    assert found.spec.dtype == demo_model.WEIGHTS_DTYPE, "fp32 weights, whatever the config says"
    assert (found.vocab_size, found.context) == (500, 1024)
    assert model._WEIGHTS_DTYPE == demo_model.WEIGHTS_DTYPE


def test_no_tokenizer_is_one_line_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = weights_and_config_only(tmp_path / "m")
    tokenizer = LazyTokenizer(str(directory))
    loads: list[None] = []
    load = tokenizer._load
    monkeypatch.setattr(tokenizer, "_load", lambda: loads.append(None) or load())
    for _ in range(2):
        with pytest.raises(InvalidRequestError) as raised:
            tokenizer()
        message = str(raised.value)
        assert "\n" not in message and "no usable tokenizer" in message
        assert 'token-id prompts ({"tokens": [...]}) need none' in message
    assert len(loads) == 1, "not tried again for every prompt"


def test_the_demo_tokenizer_is_built_on_the_first_call() -> None:
    tokenizer = LazyTokenizer(None)
    assert tokenizer._tokenizer is None
    assert tokenizer()("hi")["input_ids"][0] == 1  # <s>, then bytes
