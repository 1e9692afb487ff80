"""lmtier.model_dir: a model directory's identity is where its files are, not how the
path was typed (relative, absolute, with ``..`` or through a symlink), so warming with
one spelling and serving with another meets in one namespace."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lmtier.model_dir import local_model_id, model_identity


@pytest.fixture
def model(tmp_path: Path) -> Path:
    directory = tmp_path / "models" / "m"
    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "model.safetensors").write_bytes(b"weights")
    return directory


def test_every_spelling_of_a_directory_is_one_identity(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    link = tmp_path / "current"
    link.symlink_to(model)
    spellings = ["models/m", "./models/m/", str(model), "models/../models/m", "current"]
    identities = {model_identity(path) for path in spellings}
    assert len(identities) == 1
    ((model_id, _),) = identities
    assert model_id == str(model.resolve()) and os.path.isabs(model_id)


def test_an_engine_name_is_resolved_only_when_it_is_a_local_directory(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path / "models")
    assert local_model_id("./m") == local_model_id(str(model)) == model_identity(model)[0]
    assert local_model_id("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
