"""lmtier_apps.warm.via against a real HTTP server in a thread that answers like an
OpenAI-compatible engine (and, on cue, with 4xx/5xx bodies, a dropped connection or no
answer): request bodies and endpoints, model discovery, retries, usage parsing,
per-prompt errors vs EngineUnavailable, concurrency, and the API key kept out of logs."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from lmtier.errors import InvalidRequestError
from lmtier_apps.warm.inputs import Prompt
from lmtier_apps.warm.via import EngineClient, EngineUnavailable, ViaResult

API_KEY = "sk-test-0123456789abcdef"
DROP = "drop"  # a scripted reply: close the connection without answering


@dataclass
class Reply:
    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


@dataclass
class Request:
    method: str
    path: str
    body: Any
    headers: dict[str, str]


class FakeEngine:
    """The server's behaviour: scripted replies first (in order), then normal answers."""

    def __init__(self) -> None:
        self.models = ["tiny-model"]
        self.cached_tokens: int | None = 16
        self.script: list[Reply | str] = []
        self.requests: list[Request] = []
        self.delay_s = 0.0
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()

    def posts(self) -> list[Request]:
        return [request for request in self.requests if request.method == "POST"]

    def answer(self, request: Request) -> Reply | str:
        with self.lock:
            self.requests.append(request)
            if self.script:
                return self.script.pop(0)
        if request.path == "/v1/models":
            return Reply(200, {"object": "list", "data": [{"id": m} for m in self.models]})
        if request.path == "/v1/completions":
            prompt = request.body["prompt"]
            count = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        elif request.path == "/v1/chat/completions":
            count = sum(len(m["content"].split()) for m in request.body["messages"])
        else:
            return Reply(404, {"detail": "Not Found"})
        usage: dict[str, Any] = {"prompt_tokens": count, "completion_tokens": 1}
        usage["prompt_tokens_details"] = (
            None if self.cached_tokens is None else {"cached_tokens": self.cached_tokens}
        )
        return Reply(200, {"id": "cmpl-1", "choices": [{"text": "x"}], "usage": usage})


def _handler(engine: FakeEngine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._serve()

        def do_POST(self) -> None:
            self._serve()

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            request = Request(
                self.command, self.path, json.loads(raw) if raw else None, dict(self.headers)
            )
            with engine.lock:
                engine.in_flight += 1
                engine.max_in_flight = max(engine.max_in_flight, engine.in_flight)
            try:
                reply = engine.answer(request)
                time.sleep(engine.delay_s)
            finally:
                with engine.lock:
                    engine.in_flight -= 1
            if reply == DROP:
                return  # HTTP/1.0: the connection closes with nothing written
            assert isinstance(reply, Reply)
            time.sleep(reply.delay_s)
            data = reply.body if isinstance(reply.body, bytes) else json.dumps(reply.body).encode()
            self.send_response(reply.status)
            for name, value in {"Content-Type": "application/json", **reply.headers}.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            with contextlib.suppress(OSError):  # the client gave up (timeout test)
                self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@pytest.fixture
def engine() -> Iterator[tuple[FakeEngine, str]]:
    fake = FakeEngine()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield fake, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _client(url: str, **kwargs: Any) -> EngineClient:
    return EngineClient(url, **{"backoff_s": 0.0, "timeout_s": 10.0, **kwargs})


TEXT = Prompt(source="p.jsonl:1", id="a", text="you are a helpful assistant")
TOKENS = Prompt(source="p.jsonl:2", tokens=(5, 6, 7))
CHAT = Prompt(source="p.jsonl:3", messages=({"role": "user", "content": "hello there"},))


def test_each_kind_goes_to_its_endpoint_with_max_tokens_1(engine: tuple[FakeEngine, str]) -> None:
    fake, url = engine
    client = _client(url)
    results = [client.warm(prompt) for prompt in (TEXT, TOKENS, CHAT)]
    assert [request.path for request in fake.requests] == [
        "/v1/models",  # asked once, on first use
        "/v1/completions",
        "/v1/completions",
        "/v1/chat/completions",
    ]
    base = {"model": "tiny-model", "max_tokens": 1, "stream": False}
    assert [request.body for request in fake.posts()] == [
        {**base, "prompt": "you are a helpful assistant"},
        {**base, "prompt": [5, 6, 7]},
        {**base, "messages": [{"role": "user", "content": "hello there"}]},
    ]
    assert [(r.prompt_tokens, r.cached_tokens, r.error) for r in results] == [
        (5, 16, None),
        (3, 16, None),
        (2, 16, None),
    ]
    assert results[0].source == "p.jsonl:1" and results[0].prompt is TEXT
    assert all(r.seconds > 0 for r in results)


def test_given_model_and_url_forms(engine: tuple[FakeEngine, str]) -> None:
    fake, url = engine
    for form in (f"{url}/v1/", url.removeprefix("http://")):
        assert _client(form, model="mine").warm(TEXT).error is None
    assert [request.path for request in fake.requests] == ["/v1/completions"] * 2
    assert fake.requests[0].body["model"] == "mine"
    assert "Authorization" not in fake.requests[0].headers


def test_usage_without_cached_tokens_or_without_usage(engine: tuple[FakeEngine, str]) -> None:
    fake, url = engine
    client = _client(url, model="m")
    fake.cached_tokens = None  # vLLM without --enable-prompt-tokens-details
    result = client.warm(TEXT)
    assert (result.prompt_tokens, result.cached_tokens, result.error) == (5, None, None)
    fake.script.append(Reply(200, {"choices": []}))
    fake.script.append(Reply(200, {"usage": {"prompt_tokens": "5", "prompt_tokens_details": 3}}))
    for _ in range(2):
        result = client.warm(TEXT)
        assert (result.prompt_tokens, result.cached_tokens, result.error) == (None, None, None)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"error": {"message": "maximum context length is 8 tokens", "type": "invalid"}},
            "HTTP 400: maximum context length is 8 tokens",
        ),
        ({"object": "error", "message": "model 'x' does not exist"}, "HTTP 400: model 'x' does"),
        ({"detail": [{"loc": ["body"], "msg": "Field required"}]}, "HTTP 400: Field required"),
        (b"<html>bad\nrequest</html>", "HTTP 400: <html>bad request</html>"),
        (b"", "HTTP 400: Bad Request"),
    ],
)
def test_a_4xx_is_this_prompts_error_not_retried(
    engine: tuple[FakeEngine, str], body: Any, message: str
) -> None:
    fake, url = engine
    fake.script.append(Reply(400, body))
    result = _client(url, model="m").warm(TEXT)
    assert result.error is not None and result.error.startswith(message)
    assert (result.prompt_tokens, result.cached_tokens) == (None, None)
    assert len(fake.posts()) == 1


def test_5xx_and_429_are_retried(engine: tuple[FakeEngine, str]) -> None:
    fake, url = engine
    fake.script += [
        Reply(500, {"error": {"message": "boom"}}),
        Reply(429, {"error": {"message": "busy"}}, {"Retry-After": "0"}),
    ]
    result = _client(url, model="m", retries=2).warm(TEXT)
    assert result.error is None and result.prompt_tokens == 5
    assert len(fake.posts()) == 3


def test_retry_after_is_honoured(engine: tuple[FakeEngine, str]) -> None:
    fake, url = engine
    fake.script.append(Reply(429, {}, {"Retry-After": "0.3"}))
    result = _client(url, model="m").warm(TEXT)
    assert result.error is None and result.seconds >= 0.3


def test_a_5xx_outlasting_retries_is_this_prompts_error(engine: tuple[FakeEngine, str]) -> None:
    fake, url = engine
    fake.script += [Reply(503, {"error": {"message": "overloaded"}})] * 3
    client = _client(url, model="m", retries=2)
    assert client.warm(TEXT).error == "HTTP 503: overloaded"
    assert len(fake.posts()) == 3
    assert client.warm(TOKENS).error is None  # the engine is up: the next prompt goes on


def test_a_dropped_connection_is_retried(engine: tuple[FakeEngine, str]) -> None:
    fake, url = engine
    fake.script.append(DROP)
    result = _client(url, model="m").warm(CHAT)
    assert result.error is None and len(fake.posts()) == 2


def test_an_engine_that_keeps_dropping_is_unavailable(engine: tuple[FakeEngine, str]) -> None:
    fake, url = engine
    fake.script += [DROP] * 3
    with pytest.raises(EngineUnavailable, match=r"unreachable after 3 tries") as caught:
        _client(url, model="m", retries=2).warm(TEXT)
    assert url in str(caught.value) and "p.jsonl:1" in str(caught.value)
    assert caught.value.url == url


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_an_unreachable_engine_raises_with_its_url() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(EngineUnavailable, match=r"unreachable after 2 tries.*refused") as caught:
        _client(url, retries=1).resolve_model()
    assert caught.value.url == url and url in str(caught.value)
    with pytest.raises(EngineUnavailable, match="cannot connect"):
        _client(url, model="m", retries=0).warm(TEXT)


def test_no_answer_in_time_is_this_prompts_error_not_resent(
    engine: tuple[FakeEngine, str],
) -> None:
    fake, url = engine
    fake.script.append(Reply(200, {}, delay_s=1.0))
    result = _client(url, model="m", timeout_s=0.2).warm(TEXT)
    assert result.error == "no answer within 0.2 s"
    assert len(fake.posts()) == 1


def test_model_discovery_problems(engine: tuple[FakeEngine, str]) -> None:
    fake, url = engine
    fake.models = []
    with pytest.raises(EngineUnavailable, match="lists no model: pass the model name"):
        _client(url).warm(TEXT)
    fake.script.append(Reply(401, {"error": {"message": "bad key"}}))
    with pytest.raises(EngineUnavailable, match=r"/v1/models: HTTP 401: bad key"):
        _client(url).resolve_model()


def test_bad_arguments() -> None:
    for url in ("ftp://host/x", "http://host:port", "http://"):
        with pytest.raises(InvalidRequestError):
            EngineClient(url)
    with pytest.raises(InvalidRequestError):
        EngineClient("http://h", retries=-1)
    with pytest.raises(InvalidRequestError, match="concurrency must be >= 1"):
        next(EngineClient("http://h", model="m").warm_all([TEXT], concurrency=0))


def test_api_key_is_sent_and_never_logged(
    engine: tuple[FakeEngine, str], caplog: pytest.LogCaptureFixture
) -> None:
    fake, url = engine
    caplog.set_level(logging.DEBUG)
    client = _client(url, api_key=API_KEY, retries=2)
    assert client.resolve_model() == "tiny-model"
    fake.script += [
        Reply(500, {"error": {"message": f"boom for {API_KEY}"}}),
        DROP,
        Reply(400, {"error": {"message": f"key {API_KEY} may not do this"}}),
    ]
    result = client.warm(TEXT)
    assert result.error == "HTTP 400: key *** may not do this"
    assert all(r.headers["Authorization"] == f"Bearer {API_KEY}" for r in fake.requests)
    assert caplog.records, "the retries were logged"
    assert API_KEY not in caplog.text
    assert API_KEY not in repr(vars(client)) and API_KEY not in repr(result)
    fake.script += [DROP] * 3
    with pytest.raises(EngineUnavailable) as caught:
        client.warm(TEXT)
    assert API_KEY not in str(caught.value)
    assert API_KEY not in caplog.text


def test_password_in_the_url_is_redacted(engine: tuple[FakeEngine, str]) -> None:
    _fake, url = engine
    client = EngineClient(url.replace("127.0.0.1", "user:hunter2@127.0.0.1"))
    assert "hunter2" not in client.url and "***" in client.url


def test_warm_all_keeps_concurrency_and_reads_prompts_as_it_goes(
    engine: tuple[FakeEngine, str],
) -> None:
    fake, url = engine
    fake.delay_s = 0.05
    consumed = 0

    def prompts() -> Iterator[Prompt]:
        nonlocal consumed
        for index in itertools.count():
            consumed += 1
            yield Prompt(source=f"gen:{index}", text=f"prompt number {index}")

    results: list[ViaResult] = []
    for result in _client(url).warm_all(prompts(), concurrency=3):
        results.append(result)
        assert consumed <= len(results) + 3  # never read far ahead of the requests
        if len(results) == 12:
            break
    assert all(r.error is None and r.prompt_tokens == 3 for r in results)
    assert len({r.source for r in results}) == 12
    assert fake.max_in_flight == 3


def test_warm_all_returns_every_result_and_errors_in_place(engine: tuple[FakeEngine, str]) -> None:
    fake, url = engine
    fake.script += [Reply(200, {"object": "list", "data": [{"id": "m"}]})]
    fake.script += [Reply(400, {"error": {"message": "too long"}})]
    prompts = [Prompt(source=f"p:{i}", tokens=(i, i + 1)) for i in range(10)]
    results = list(_client(url).warm_all(prompts, concurrency=4))
    assert sorted(r.source for r in results) == sorted(p.source for p in prompts)
    assert [r.error for r in results].count("HTTP 400: too long") == 1
    assert len(fake.posts()) == 10


def test_warm_all_stops_on_an_unreachable_engine() -> None:
    client = _client(f"http://127.0.0.1:{_closed_port()}", retries=0)
    with pytest.raises(EngineUnavailable):
        list(client.warm_all([TEXT, TOKENS], concurrency=2))
