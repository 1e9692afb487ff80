"""The random demo model's revision (part of every key of its cache) names its weights
and architecture, not the transformers release that built them: `.ci/run` installs
another transformers than the README's command, and a user's warmed cache missed."""

from __future__ import annotations

import pytest
import torch
import transformers.configuration_utils

from lmtier_apps.demo.demo_model import build_demo_model, demo_revision


def test_another_transformers_version_with_the_same_weights_is_the_same_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The config's JSON, which the revision hashed whole, carries transformers_version."""
    before = build_demo_model(0).revision
    monkeypatch.setattr(transformers.configuration_utils, "__version__", "5.99.0")
    again = build_demo_model(0)
    assert again.model.config.to_dict()["transformers_version"] == "5.99.0"
    assert again.revision == before


def test_other_weights_or_another_seed_are_another_model() -> None:
    demo = build_demo_model(0)
    assert build_demo_model(1).revision != demo.revision
    assert demo.revision.startswith("seed0-")
    with torch.no_grad():  # what a transformers release initialising differently would do
        next(demo.model.parameters())[0, 0] += 1.0
    assert demo_revision(demo.model, 0) != demo.revision
