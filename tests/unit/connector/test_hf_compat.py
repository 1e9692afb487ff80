"""lmtier_connector.hf.compat: the KV cache passed and read by either transformers name."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

from transformers.modeling_outputs import CausalLMOutputWithPast

from lmtier_connector.hf.compat import call_with_cache, output_cache


class OldModel:
    def forward(self, input_ids: Any, past_key_values: Any = None, use_cache: bool = False) -> Any:
        return {"past_key_values": past_key_values}

    __call__ = forward


class NewModel:
    def forward(self, input_ids: Any, cache: Any = None, use_cache: bool = False) -> Any:
        return {"cache": cache}

    __call__ = forward


def test_the_cache_goes_by_the_name_the_model_takes() -> None:
    assert call_with_cache(OldModel(), [1], "kv", use_cache=True) == {"past_key_values": "kv"}
    assert call_with_cache(NewModel(), [1], "kv", use_cache=True) == {"cache": "kv"}


def test_the_returned_cache_is_read_by_either_name() -> None:
    assert output_cache({"cache": "new"}) == "new"
    assert output_cache({"past_key_values": "old"}) == "old"
    installed = CausalLMOutputWithPast(logits=None, **{_field(): "kv"})
    assert output_cache(installed) == "kv"


def _field() -> str:
    fields = CausalLMOutputWithPast.__dataclass_fields__
    return "cache" if "cache" in fields else "past_key_values"
