"""The gate of `lmtier demo serve` (lmtier_apps.engine.openai_requests): every field of
a completion or chat request is checked for its JSON type, range and size before any
work, and refused with one OpenAI-style line naming the field. The same checks over
real HTTP are in tests/e2e/test_demo_serve.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from lmtier_apps.engine.openai_requests import (
    MAX_NAME_CHARS,
    NEUTRAL_VALUES,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    RequestLimits,
    parse_request,
)

LIMITS = RequestLimits(max_model_len=16_384, max_token_chars=5)
"""The demo model's context and byte tokenizer (whose longest entry is ``<unk>``)."""


def completion(body: dict[str, Any]) -> CompletionRequest:
    return parse_request(CompletionRequest, json.dumps(body).encode(), LIMITS)


def chat(body: dict[str, Any]) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, json.dumps(body).encode(), LIMITS)


def user(text: object) -> dict[str, Any]:
    return {"role": "user", "content": text}


# (body, the param the 400 names); each is a completion unless it has "messages".
REFUSED: list[tuple[dict[str, Any], str]] = [
    # ranges that reach the sampler or torch's generator as a 500
    ({"prompt": "x", "temperature": 1e-300}, "temperature"),
    ({"prompt": "x", "temperature": 0.009}, "temperature"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "seed": 2**63}, "seed"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"messages": [user("x")], "max_completion_tokens": 0}, "max_completion_tokens"),
    # JSON types exactly: no bool for an int, no string for a bool or a number
    ({"prompt": [True, False]}, "prompt"),
    ({"prompt": [[1, True]]}, "prompt"),
    ({"prompt": [1.5]}, "prompt"),
    ({"prompt": 7}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream": 1}, "stream"),
    ({"prompt": "x", "return_token_ids": "true"}, "return_token_ids"),
    ({"prompt": "x", "temperature": "0"}, "temperature"),
    ({"prompt": "x", "seed": 1.0}, "seed"),
    ({"prompt": "x", "max_tokens": 6.0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "model": 3}, "model"),
    ({"prompt": "x", "cache_salt": ["a"]}, "cache_salt"),
    (
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}},
        "stream_options.include_usage",
    ),
    # sizes, before any tokenizing
    ({"prompt": "x" * (LIMITS.max_prompt_chars + 1)}, "prompt"),
    ({"prompt": list(range(16_384))}, "prompt"),
    ({"prompt": "x", "model": "m" * (MAX_NAME_CHARS + 1)}, "model"),
    ({"prompt": "x", "cache_salt": "s" * (MAX_NAME_CHARS + 1)}, "cache_salt"),
    ({"messages": [user("x" * (LIMITS.max_prompt_chars // 2 + 1))] * 2}, "messages"),
    ({"messages": [user("")] * 16_385}, "messages"),
    # OpenAI options the demo engine cannot honour: refused, never ignored
    ({"prompt": "x", "logprobs": 1}, "logprobs"),
    ({"prompt": "x", "logprobs": 0}, "logprobs"),
    ({"messages": [user("x")], "logprobs": True}, "logprobs"),
    ({"messages": [user("x")], "top_logprobs": 2}, "top_logprobs"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "suffix": "end"}, "suffix"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "top_p": 0.9}, "top_p"),
    ({"prompt": "x", "stop": "\n"}, "stop"),
    ({"prompt": "x", "stop": ["a"]}, "stop"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -1}, "frequency_penalty"),
    ({"prompt": "x", "logit_bias": {"5": 100}}, "logit_bias"),
    ({"messages": [user("x")], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [user("x")], "tool_choice": "auto"}, "tool_choice"),
    ({"messages": [user("x")], "response_format": {"type": "json_object"}}, "response_format"),
    # chat messages
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "root", "content": "x"}]}, "messages.0.role"),
    ({"messages": [user("x"), {"role": "tool", "content": "x"}]}, "messages.1.role"),
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
    ({"messages": [user([{"type": "image_url", "image_url": {}}])]}, "messages.0.content"),
    ({"messages": [user([{"type": "text"}])]}, "messages.0.content"),
    ({"messages": [user(5)]}, "messages.0.content"),
    ({"messages": "hello"}, "messages"),
]


@pytest.mark.parametrize(("body", "param"), REFUSED, ids=lambda v: json.dumps(v)[:60])
def test_a_bad_field_is_refused_with_one_line_naming_it(body: dict[str, Any], param: str) -> None:
    parse = chat if "messages" in body else completion
    with pytest.raises(ApiError) as caught:
        parse(body)
    error = caught.value
    assert error.status == 400
    assert error.param == param
    message = str(error)
    assert message and "\n" not in message and len(message) < 300, message


def test_a_missing_prompt_and_bodies_that_are_not_one_object() -> None:
    for body, param in ((b'{"max_tokens": 3}', "prompt"), (b"[1]", None), (b"{no", None)):
        with pytest.raises(ApiError) as caught:
            parse_request(CompletionRequest, body, LIMITS)
        assert caught.value.param == param
        assert caught.value.status == 400


def test_every_unsupported_option_is_in_the_table_of_neutral_values() -> None:
    for name, neutral in NEUTRAL_VALUES.items():
        for value in (None, *neutral):  # null and the neutral values ask for nothing
            assert completion({"prompt": "x", name: value}).prompt == "x"


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "temperature": 0},
        {"prompt": "x", "temperature": 0.01, "seed": 2**63 - 1},
        {"prompt": "x", "temperature": 2, "seed": -(2**63)},
        {"prompt": "x", "temperature": 1, "top_p": 1, "n": 1, "stop": None, "logprobs": None},
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
        {"prompt": "x", "user": "u-1", "metadata": {"a": 1}},  # unknown fields: ignored
        {"prompt": "x" * LIMITS.max_prompt_chars},
        {"prompt": list(range(16_383))},
        {"prompt": [[1, 2, 3]]},
        {"prompt": ["text in a list"]},
    ],
    ids=lambda v: json.dumps(v)[:60],
)
def test_a_good_completion_is_accepted(body: dict[str, Any]) -> None:
    request = completion(body)
    assert request.prompt


def test_a_prompt_held_in_a_list_is_unwrapped() -> None:
    assert completion({"prompt": [[1, 2, 3]]}).prompt == [1, 2, 3]
    assert completion({"prompt": ["text"]}).prompt == "text"
    assert completion({"prompt": [5, 6]}).prompt == [5, 6]


def test_a_good_chat_is_accepted_with_its_text_parts_joined() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok", "name": "bot"},
    ]
    request = chat({"messages": messages, "max_completion_tokens": 3, "logprobs": False})
    assert [(m.role, m.text()) for m in request.messages] == [
        ("system", "be brief"),
        ("developer", ""),
        ("user", "ab"),
        ("assistant", "ok"),
    ]
    assert request.token_budget() == 3


def test_a_text_past_the_context_says_how_much_fits() -> None:
    with pytest.raises(ApiError) as caught:
        completion({"prompt": "y" * 100_000})
    assert caught.value.code == "context_length_exceeded"
    assert str(caught.value) == (
        "100000 characters of text cannot fit this model's context of 16384 tokens "
        "(at most 81920 characters)"
    )
