"""What the router reads of a request (lmtier_apps.route.prompts): the token ids an
engine would see (text through the tokenizer, chat through its template), the keys
the engine's cache gives them (its namespace, its tenant's salt), and a 400 for what
cannot be read."""

from __future__ import annotations

import json

import pytest

from lmtier import KVSpec, LMTier
from lmtier.config import LMTierConfig
from lmtier_apps.demo.demo_tokenizer import demo_tokenizer
from lmtier_apps.engine.engine import TextCodec
from lmtier_apps.route.prompts import MAX_PROMPT_CHARS, PromptError, RouteModel

CHUNK = 16
SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8)


@pytest.fixture(scope="module")
def model() -> RouteModel:
    config = LMTierConfig(chunk_size=CHUNK)
    cache = LMTier(config, SPEC, model_id="route-test", vocab_size=1000)
    return RouteModel(config, cache, TextCodec(demo_tokenizer(), frozenset()))


def read(model: RouteModel, path: str, body: object) -> list[int]:
    return model.read(path, json.dumps(body).encode()).token_ids


def test_text_token_ids_and_chat_become_what_the_engine_sees(model: RouteModel) -> None:
    codec = TextCodec(demo_tokenizer(), frozenset())
    assert read(model, "/v1/completions", {"prompt": "hello"}) == codec.encode("hello")
    assert read(model, "/v1/completions", {"prompt": ["hello", "other"]}) == codec.encode("hello")
    assert read(model, "/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    chat = read(model, "/v1/chat/completions", {"messages": messages})
    assert chat == codec.chat_prompt([("user", "hi")])


def test_keys_are_the_engines_cache_keys_per_tenant(model: RouteModel) -> None:
    ids = list(range(3 * CHUNK + 5))
    prompt = model.read("/v1/completions", json.dumps({"prompt": ids}).encode())
    keys = model.keys(prompt)
    assert len(keys) == 3
    salted = model.read(
        "/v1/completions", json.dumps({"prompt": ids, "cache_salt": "tenant-b"}).encode()
    )
    assert model.keys(salted)[0] != keys[0], "another tenant: other keys"
    assert prompt.stream is False and salted.cache_salt == "tenant-b"


@pytest.mark.parametrize(
    ("path", "body", "problem"),
    [
        ("/v1/completions", b"{not json", "not JSON"),
        ("/v1/completions", b"[1, 2]", "not a JSON object"),
        ("/v1/completions", b"\xff\xfe", "not JSON"),
        ("/v1/completions", b'{"prompt": ""}', "empty"),
        ("/v1/completions", b'{"prompt": []}', "text or a list"),
        ("/v1/completions", b'{"prompt": [1, true]}', "non-negative"),
        ("/v1/completions", b'{"prompt": [1, -2]}', "non-negative"),
        ("/v1/completions", b'{"prompt": [1000]}', "outside the model"),
        ("/v1/completions", b'{"prompt": {"a": 1}}', "text or a list"),
        ("/v1/completions", b'{"prompt": "x", "model": 3}', "model must"),
        ("/v1/completions", b'{"prompt": "x", "cache_salt": 3}', "cache_salt"),
        ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', "stream"),
        ("/v1/chat/completions", b'{"messages": []}', "non-empty"),
        ("/v1/chat/completions", b'{"messages": ["hi"]}', "with a role"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 3}]}', "text"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            "text content only",
        ),
    ],
)
def test_what_cannot_be_read_is_refused(
    model: RouteModel, path: str, body: bytes, problem: str
) -> None:
    with pytest.raises(PromptError, match=problem):
        model.read(path, body)


def test_a_prompt_too_long_to_tokenize_is_refused(model: RouteModel) -> None:
    with pytest.raises(PromptError, match="characters"):
        read(model, "/v1/completions", {"prompt": "x" * (MAX_PROMPT_CHARS + 1)})
