"""`lmtier demo serve`, the OpenAI-compatible demo engine, as a real process over HTTP:
cached-token counts in the usage block, replies and logits equal with and without the
cache, chat, server-sent events, OpenAI-style 400s, and a clean exit on SIGTERM and
SIGINT after which a new process is served from the disk tier.

No test waits on a timer: the server announces itself with one line on stdout, and
every request blocks until its answer.
"""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.demo_server import CHUNK, HANG_S, LONG_TEXT, MAX_LOGIT_DIFF, OPENER, Server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the module, with a logit check on every request and no device
    tier, so the cached tokens come from lmtier's own CPU tier."""
    tmp_path = tmp_path_factory.mktemp("serve")
    running = Server(tmp_path, tmp_path / "cache", "--check-logits", "--device-blocks", "0")
    try:
        yield running
        assert running.stop() == 0, running.log.read_text()[-6000:]
    finally:
        running.kill()


def completion(prompt: str | list[int], **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": True, **extra}


def test_second_request_is_served_from_the_cache_with_the_same_reply(server: Server) -> None:
    first = server.post("/v1/completions", completion("first: " + LONG_TEXT))
    second = server.post("/v1/completions", completion("first: " + LONG_TEXT))
    usage = first["usage"]
    assert usage["prompt_tokens"] > 4 * CHUNK
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usage["lmtier"]["cached_tokens_by_tier"] == {}
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # Every full chunk but the one holding the last prompt token, which is recomputed.
    assert cached == (usage["prompt_tokens"] - 1) // CHUNK * CHUNK
    assert second["usage"]["lmtier"]["cached_tokens_by_tier"] == {"cpu": cached}
    assert second["usage"]["lmtier"]["max_logit_diff"] <= MAX_LOGIT_DIFF
    assert first["usage"]["lmtier"]["max_logit_diff"] == 0.0  # nothing cached: same run
    # Greedy: the reply computed over cached KV is the reply computed without it.
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert len(first["choices"][0]["token_ids"]) == usage["completion_tokens"]
    assert second["prompt_token_ids"] == first["prompt_token_ids"]


def test_a_prompt_of_token_ids_is_served_from_the_cache(server: Server) -> None:
    ids = [(7 * i) % 32_000 for i in range(3 * CHUNK + 10)]
    first = server.post("/v1/completions", completion(ids))
    second = server.post("/v1/completions", completion(ids))
    assert first["usage"]["prompt_tokens"] == len(ids)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * CHUNK
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


def test_chat_completion_and_the_next_turn_reuses_the_conversation(server: Server) -> None:
    messages = [
        {"role": "system", "content": "chat: " + LONG_TEXT},
        {"role": "user", "content": "What does the cache serve?"},
    ]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0}
    first = server.post("/v1/chat/completions", body)
    assert first["object"] == "chat.completion"
    choice = first["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("length", "stop")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    reply = {"role": "assistant", "content": choice["message"]["content"]}
    turn = [*messages, reply, {"role": "user", "content": "And then?"}]
    second = server.post("/v1/chat/completions", {**body, "messages": turn})
    assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 4 * CHUNK


def test_the_reply_is_stored_so_the_next_turn_finds_it(server: Server) -> None:
    # 250 prompt tokens have no full chunk; with 20 replied, the first chunk (256) is
    # complete, and holds 6 tokens of the reply: only storing the reply caches it.
    prompt = [(7 * i) % 30_000 + 3 for i in range(250)]
    first = server.post("/v1/completions", completion(prompt, max_tokens=20))
    reply = first["choices"][0]["token_ids"]
    assert len(reply) == 20 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    turn = [*prompt, *reply, 5, 6, 7]
    second = server.post("/v1/completions", completion(turn, max_tokens=1))
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == CHUNK
    assert second["usage"]["lmtier"]["max_logit_diff"] <= MAX_LOGIT_DIFF


def test_sampling_with_a_seed_repeats(server: Server) -> None:
    body = completion("sampling: a short prompt", temperature=0.8, seed=1234, max_tokens=8)
    first = server.post("/v1/completions", body)
    second = server.post("/v1/completions", body)
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]


def test_streamed_completion_ends_with_usage_and_done(server: Server) -> None:
    body = completion("stream: " + LONG_TEXT, stream_options={"include_usage": True})
    events = server.stream("/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    usage_chunk, text_chunks = chunks[-1], chunks[:-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 6
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert all(chunk["usage"] is None for chunk in text_chunks)  # as OpenAI streams it
    assert all(chunk["object"] == "text_completion" for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(chunk["choices"][0]["text"] for chunk in text_chunks)

    again = server.stream("/v1/completions", body)
    last = json.loads(again[-2])
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    plain = server.post("/v1/completions", body)  # not streamed: the same greedy reply
    assert plain["choices"][0]["text"] == streamed


def test_streamed_chat_without_usage(server: Server) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    events = server.stream("/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert all("usage" not in chunk for chunk in chunks)  # no include_usage: no usage key


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "model": "no-such-model"}, "model"),
        ({"prompt": [5, 10**6]}, "prompt"),
        ({"prompt": "x" * 17_000}, "prompt"),  # past the 16384-token context
        ({"prompt": "x", "max_tokens": 16_384}, "max_tokens"),  # prompt + reply past it
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"max_tokens": 3}, "prompt"),
        # Each of these got a 500 (traceback in the log) or was served as if valid; the
        # whole table of fields is tests/unit/test_demo_requests.py.
        ({"prompt": "x", "temperature": 1e-300}, "temperature"),
        ({"prompt": "x", "seed": 2**64}, "seed"),
        ({"prompt": [True, False]}, "prompt"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "logprobs": 1}, "logprobs"),
    ],
)
def test_bad_requests_get_an_openai_error_and_the_server_keeps_serving(
    server: Server, body: dict[str, Any], param: str
) -> None:
    status, raw = server.request("/v1/completions", body)
    assert status == 400, raw.decode()
    error = json.loads(raw)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"] and "Traceback" not in error["message"]
    assert server.post("/v1/completions", completion("still serving"))["choices"]


def test_bad_chat_and_bad_json(server: Server) -> None:
    status, raw = server.request("/v1/chat/completions", {"messages": []})
    assert status == 400
    assert json.loads(raw)["error"]["param"] == "messages"
    root = {"messages": [{"role": "root", "content": "x"}]}
    status, raw = server.request("/v1/chat/completions", root)
    assert status == 400, raw.decode()
    assert json.loads(raw)["error"]["param"] == "messages.0.role"
    request = urllib.request.Request(
        server.url + "/v1/completions", data=b"{not json", method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        OPENER.open(request, timeout=HANG_S)
    assert caught.value.code == 400
    assert json.loads(caught.value.read())["error"]["type"] == "invalid_request_error"


def test_an_oversized_prompt_is_refused_before_it_is_tokenized(server: Server) -> None:
    """5 MB of text held the engine for 14 s while it was tokenized, to learn it was
    past the context; now its length alone refuses it (the message counts characters,
    not tokens), and a body past the size limit is not even parsed (413)."""
    status, raw = server.request("/v1/completions", {"prompt": "x" * 5_000_000})
    assert status == 400, raw.decode()[:500]
    error = json.loads(raw)["error"]
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert error["message"].startswith("5000000 characters of text cannot fit")
    status, raw = server.request("/v1/completions", {"prompt": "x" * 9_000_000})
    assert status == 413, raw.decode()[:500]
    assert json.loads(raw)["error"]["code"] == "request_too_large"
    assert server.post("/v1/completions", completion("still serving"))["choices"]


def test_models_and_health(server: Server) -> None:
    status, raw = server.request("/health")
    assert status == 200
    status, raw = server.request("/v1/models")
    assert status == 200
    models = json.loads(raw)
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == "lmtier-demo/llama-57m-random"
    assert card["max_model_len"] == 16_384


def test_sigterm_exits_0_and_a_new_process_is_served_from_disk(tmp_path: Path) -> None:
    """SIGTERM closes the cache (its disk writes flushed) and exits 0 with nothing left
    behind; the next process, its own CPU tier empty, is served from the disk tier.
    SIGINT (Ctrl-C) ends it just as cleanly."""
    cache = tmp_path / "cache"
    body = completion("restart: " + LONG_TEXT)
    first = Server(tmp_path, cache, "--served-model-name", "demo")
    try:
        assert first.post("/v1/completions", {**body, "model": "demo"})["usage"][
            "prompt_tokens_details"
        ] == {"cached_tokens": 0}
        assert first.stop(signal.SIGTERM) == 0, first.log.read_text()[-6000:]
    finally:
        first.kill()
    second = Server(tmp_path, cache, "--served-model-name", "demo")
    try:
        usage = second.post("/v1/completions", body)["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached == (usage["prompt_tokens"] - 1) // CHUNK * CHUNK
        assert usage["lmtier"]["cached_tokens_by_tier"] == {"disk": cached}
        assert second.stop(signal.SIGINT) == 0, second.log.read_text()[-6000:]
    finally:
        second.kill()


def test_over_a_sidecar_a_new_engine_process_is_served_from_its_cpu_tier(tmp_path: Path) -> None:
    """With --sidecar the engine's cache is the sidecar's: what one engine process
    stored serves the next from the sidecar's CPU tier (no disk anywhere)."""
    pytest.importorskip("grpc")
    from lmtier.testing.sidecar import SidecarProcess

    token = tmp_path / "token"
    token.write_text("serve-token\n")
    token.chmod(0o600)
    settings = {"cpu": {"capacity_bytes": "256MiB"}, "sidecar": {"auth_token": "serve-token"}}
    body = completion("sidecar: " + LONG_TEXT)
    with SidecarProcess(tmp_path / "sidecar", settings) as sidecar:
        args = ("--sidecar", sidecar.target, "--sidecar-token-file", str(token))
        for expected_tiers in (set(), {"cpu"}):
            engine = Server(tmp_path, tmp_path / "unused", *args)
            try:
                usage = engine.post("/v1/completions", body)["usage"]
                assert set(usage["lmtier"]["cached_tokens_by_tier"]) == expected_tiers
                assert engine.stop() == 0, engine.log.read_text()[-6000:]
            finally:
                engine.kill()
        assert not (tmp_path / "unused").exists()  # --cache-dir does not apply
