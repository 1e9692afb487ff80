"""`lmtier route` as a process in front of real `lmtier demo serve` engines whose caches
keep the fleet index in a real redis-server: each turn of a conversation goes to the
node that holds it (and is served from its cache); with the index down, requests
still succeed by load; an engine that fails is retried elsewhere once; one killed
mid-stream ends the client's stream with an error, never a hang; a request the router
cannot read gets a 400, one without the router's key a 401."""

from __future__ import annotations

import http.client
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from support.demo_server import HANG_S, LONG_TEXT, Server
from support.redis_servers import RedisServer, free_port
from support.route_process import RouterProcess


def node(tmp_path: Path, name: str, redis: RedisServer) -> Server:
    fleet = {
        "LMTIER_FLEET__ENABLED": "1",
        "LMTIER_FLEET__NODE_ID": name,
        "LMTIER_FLEET__INDEX_URL": redis.url,
        "LMTIER_FLEET__INTERVAL_S": "0.01",
    }
    return Server(tmp_path, tmp_path / f"cache-{name}", env=fleet)


@pytest.fixture(scope="module")
def nodes(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[dict[str, Server]]:
    tmp = tmp_path_factory.mktemp("route")
    started: dict[str, Server] = {}
    try:
        for name in ("a", "b"):
            started[name] = node(tmp, name, redis_server)
        yield started
    finally:
        for server in started.values():
            server.kill()


def urls(servers: dict[str, Server]) -> dict[str, str]:
    return {name: server.url for name, server in servers.items()}


def test_each_turn_goes_to_the_node_that_holds_the_conversation(
    tmp_path: Path, nodes: dict[str, Server], redis_server: RedisServer
) -> None:
    router = RouterProcess(tmp_path, urls(nodes), "--index-url", redis_server.url)
    try:
        talks = {
            "x": LONG_TEXT,
            "y": LONG_TEXT.replace("Paragraph", "Section").replace("cache", "store"),
        }
        homes: dict[str, str] = {}
        for turn in range(3):
            for name, history in list(talks.items()):
                route, answer = router.complete(
                    {"prompt": history, "max_tokens": 4, "temperature": 0}
                )
                if turn == 0:
                    homes[name] = route["engine"]
                else:
                    assert route["engine"] == homes[name], f"turn {turn} of {name}: {route}"
                    assert sum(route["cached_tokens"].values()) > 0, route
                    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                    assert cached > 0, "served from that node's cache"
                talks[name] = history + answer["choices"][0]["text"] + f" Turn {turn} of {name}."
        status, _, metrics = router.request("/metrics")
        assert status == 200 and b"lmtier_route_requests_total" in metrics
    finally:
        assert router.stop() == 0


def test_requests_succeed_with_the_index_down(tmp_path: Path, nodes: dict[str, Server]) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    router = RouterProcess(tmp_path, urls(nodes), "--index-url", dead)
    try:
        engines = set()
        for i in range(4):
            route, _ = router.complete({"prompt": f"{i}: {LONG_TEXT}", "max_tokens": 2})
            engines.add(route["engine"])
        assert engines <= {"a", "b"}
        _, _, metrics = router.request("/metrics")
        errors = [
            line
            for line in metrics.decode().splitlines()
            if line.startswith("lmtier_route_index_errors_total")
        ]
        assert errors and float(errors[0].split()[-1]) >= 1
    finally:
        router.kill()


def test_unreadable_and_unauthorised_requests_are_refused(
    tmp_path: Path, nodes: dict[str, Server]
) -> None:
    key = tmp_path / "key"
    key.write_text("router-secret\n")
    router = RouterProcess(tmp_path, urls(nodes), "--api-key-file", str(key))
    try:
        status, _, body = router.request("/v1/completions", {"prompt": "hi"})
        assert status == 401 and b"API key" in body
        good = {"Authorization": "Bearer router-secret"}
        for bad in (b"{nope", b'{"prompt": [1, "x"]}', b'{"messages": 3}'):
            status, _, body = router.request("/v1/completions", bad, good)
            assert status == 400, body
            assert json.loads(body)["error"]["type"] == "invalid_request_error"
        status, _, _ = router.request("/health")
        assert status == 200, "health needs no key"
        status, _, models = router.request("/v1/models", headers=good)
        assert status == 200 and json.loads(models)["data"]
    finally:
        router.kill()


def stream(url: str, body: dict[str, object]) -> Iterator[bytes]:
    """The lines of a streamed completion, as they arrive."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=HANG_S)
    try:
        connection.request(
            "POST", "/v1/completions", json.dumps({**body, "stream": True}),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        response = connection.getresponse()
        assert response.status == 200
        while line := response.readline():
            yield line
    finally:
        connection.close()


def test_an_engine_that_dies_is_retried_elsewhere_or_ends_the_stream_cleanly(
    tmp_path: Path, nodes: dict[str, Server], redis_server: RedisServer
) -> None:
    doomed = node(tmp_path, "c", redis_server)
    routers: list[RouterProcess] = []
    try:
        # Both routers see c healthy, and then never check again (an hour between).
        quiet = ("--health-interval", "3600")
        alone = RouterProcess(tmp_path, {"c": doomed.url}, *quiet)
        pair = RouterProcess(
            tmp_path, {"a": nodes["a"].url, "c": doomed.url}, "--policy", "round-robin", *quiet
        )
        routers += [alone, pair]
        lines = stream(alone.url, {"prompt": LONG_TEXT, "max_tokens": 2000, "temperature": 0})
        assert next(lines).startswith(b"data: ")
        doomed.process.send_signal(signal.SIGKILL)
        rest = b"".join(lines)  # it ends: the client does not hang
        assert b'"upstream_error"' in rest and rest.endswith(b"data: [DONE]\n\n")
        status, _, _ = alone.request("/v1/completions", {"prompt": "hi"})
        assert status in (502, 503), "no engine left"
        # Round-robin sends one of two requests to c: it goes to a instead, once.
        retried = []
        for i in range(2):
            route, _ = pair.complete({"prompt": f"retry {i}", "max_tokens": 2})
            assert route["engine"] == "a"
            retried.append(route["retried"])
        assert sorted(retried) == [False, True]
    finally:
        for router in routers:
            router.kill()
        doomed.kill()
