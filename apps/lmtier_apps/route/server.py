"""``lmtier route``'s HTTP side: the OpenAI routes in front of the engines.

``POST /v1/completions`` and ``/v1/chat/completions`` are read for their prompt
(:mod:`.prompts`), the fleet index is asked where its chunks are, an engine is
chosen (:mod:`.policy`) and the request is sent there as it came (unknown fields
included), with the engines' key instead of the client's. The answer goes back as it
comes: a stream (server-sent events) piece by piece, any other answer whole. The
response carries ``x-lmtier-route``: the engine chosen, the policy, the cached
tokens by tier that decided it, the engine's load, and whether it was a retry. A
request may name its own policy in ``x-lmtier-policy`` (to compare policies on one
router).

Failures: an engine that cannot be reached, or answers 5xx, before the first byte
of its answer reached the client, is marked down and the request goes to the next
best engine, once; then 502. A stream whose engine fails midway ends with an
``error`` event and ``data: [DONE]`` (the client never hangs: every engine call has
a connect and an idle-read deadline). The index that fails or takes longer than
``index_timeout_s`` makes that request ``least-loaded`` (counted in
``lmtier_route_index_errors_total``), never a failed request. ``GET /v1/models`` is
answered by a healthy engine; ``GET /health`` says whether one is; ``GET /metrics``
is the router's Prometheus text.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from lmtier.chunks.keys import ChunkKey
from lmtier.errors import BackendError
from lmtier_apps.route.engines import Engine, Engines
from lmtier_apps.route.policy import (
    POLICIES,
    Candidate,
    Choice,
    Holding,
    Recent,
    Turns,
    choose,
    with_recent,
)
from lmtier_apps.route.prompts import Prompt, PromptError, RouteModel
from lmtier_backends.fleet.index import FleetIndex, prefixes

__all__ = ["MAX_BODY_BYTES", "POLICY_HEADER", "ROUTE_HEADER", "Router", "RouterSettings"]

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
"""The largest request body the router reads (as ``lmtier demo serve``)."""
ROUTE_HEADER = "x-lmtier-route"
POLICY_HEADER = "x-lmtier-policy"
"""A request's own policy (another than the router's), to measure one against another
on one router."""
_HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "authorization"}
)
_ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True, slots=True)
class _Routed:
    """One request's prompt, keys, choice and the engines it was chosen among."""

    prompt: Prompt
    keys: list[ChunkKey]
    choice: Choice
    candidates: list[Candidate]
    policy: str


class RouterSettings:
    """How the router chooses and how long it waits."""

    def __init__(
        self,
        policy: str = "kv-aware",
        *,
        load_tokens: int = 512,
        index_timeout_s: float = 0.1,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
        api_key: str | None = None,
        engine_key: str | None = None,
    ) -> None:
        self.policy = policy
        self.load_tokens = load_tokens
        self.index_timeout_s = index_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.api_key = api_key
        self.engine_key = engine_key


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "lmtier_route_requests", "Requests sent, by engine and policy",
            ["engine", "policy"], registry=self.registry,
        )  # fmt: skip
        self.cached = Counter(
            "lmtier_route_cached_tokens", "Prompt tokens the chosen node held, by tier",
            ["tier"], registry=self.registry,
        )  # fmt: skip
        self.prompt = Counter(
            "lmtier_route_prompt_tokens", "Prompt tokens routed", registry=self.registry
        )
        self.retries = Counter(
            "lmtier_route_retries", "Requests sent again", registry=self.registry
        )
        self.failures = Counter(
            "lmtier_route_failures", "Requests no engine answered", registry=self.registry
        )
        self.index_errors = Counter(
            "lmtier_route_index_errors", "Index queries failed or too slow", registry=self.registry
        )
        self.overhead = Histogram(
            "lmtier_route_overhead_seconds", "Reading, keying and choosing, per request",
            registry=self.registry,
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
        )  # fmt: skip


class Router:
    """The router's state and handlers (module docstring)."""

    def __init__(
        self,
        model: RouteModel,
        engines: Engines,
        index: FleetIndex | None,
        settings: RouterSettings,
    ) -> None:
        self.model = model
        self.engines = engines
        self.index = index
        self.settings = settings
        self.recent = Recent()
        self.turns = Turns()
        self.metrics = _Metrics()
        self._session: aiohttp.ClientSession | None = None
        self._index_down = False

    # ---- the application -----------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._auth])
        for route in _ROUTES:
            app.router.add_post(route, self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        await self.engines.check(self._session)
        self.engines.start(self._session)

    async def _stop(self, app: web.Application) -> None:
        await self.engines.stop()
        if self._session is not None:
            await self._session.close()
        if self.index is not None:
            await self.index.close()

    @web.middleware
    async def _auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        key = self.settings.api_key
        if key is not None and request.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return _error(401, "a valid API key is required", "invalid_api_key")
        return await handler(request)

    # ---- the routes ----------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the request body is over {MAX_BODY_BYTES} bytes", "too_large")
        loop = asyncio.get_running_loop()
        try:
            prompt = await loop.run_in_executor(None, self.model.read, request.path, body)
            keys = await loop.run_in_executor(None, self.model.keys, prompt)
        except PromptError as exc:
            return _error(400, str(exc), "invalid_request_error")
        policy = request.headers.get(POLICY_HEADER, self.settings.policy)
        if policy not in POLICIES:
            return _error(
                400, f"{POLICY_HEADER} must be one of {list(POLICIES)}", "invalid_request_error"
            )
        candidates = await self._candidates(keys, policy)
        choice = choose(
            policy,
            candidates,
            self.turns,
            chunk_size=self.model.chunk_size,
            load_tokens=self.settings.load_tokens,
        )
        self.metrics.overhead.observe(time.perf_counter() - started)
        if choice is None:
            self.metrics.failures.inc()
            return _error(503, "no engine is healthy", "unavailable")
        return await self._send(request, body, _Routed(prompt, keys, choice, candidates, policy))

    async def _candidates(self, keys: list[ChunkKey], policy: str) -> list[Candidate]:
        """The healthy engines, each with what its node holds of ``keys``."""
        healthy = self.engines.healthy()
        found, shared = await self._holdings(keys, policy)
        return [
            Candidate(
                engine.name,
                engine.in_flight,
                engine.waiting,
                with_recent(found.get(engine.name, shared), self.recent.leading(keys, engine.name)),
            )
            for engine in healthy
        ]

    async def _holdings(
        self, keys: list[ChunkKey], policy: str
    ) -> tuple[dict[str, Holding], Holding]:
        if self.index is None or not keys or policy != "kv-aware":
            return {}, Holding()
        try:
            live, owners = await asyncio.wait_for(
                self.index.query(keys),
                self.settings.index_timeout_s,
            )
        except (BackendError, asyncio.TimeoutError) as exc:
            self.metrics.index_errors.inc()
            if not self._index_down:
                logger.warning("fleet index unavailable (%s): routing by load", exc)
                self._index_down = True
            return {}, Holding()
        if self._index_down:
            logger.warning("fleet index answers again")
            self._index_down = False
        return prefixes(live, owners)

    async def _send(self, request: web.Request, body: bytes, routed: _Routed) -> web.StreamResponse:
        prompt, keys, candidates = routed.prompt, routed.keys, routed.candidates
        tried: dict[str, bool] = {}
        retried = False
        current: Choice | None = routed.choice
        while current is not None:
            engine = self.engines.by_name[current.name]
            tried[engine.name] = True
            answer = await self._forward(request, body, engine, current, retried)
            if answer is not None:
                self.recent.remember(keys, engine.name)
                self.metrics.requests.labels(engine.name, current.policy).inc()
                self.metrics.prompt.inc(len(prompt.token_ids))
                for tier, tokens in current.cached_tokens.items():
                    self.metrics.cached.labels(tier).inc(tokens)
                return answer
            self.engines.failed(engine)
            self.recent.forget(engine.name)
            if retried:
                break
            retried = True
            self.metrics.retries.inc()
            current = choose(
                routed.policy,
                candidates,
                self.turns,
                chunk_size=self.model.chunk_size,
                load_tokens=self.settings.load_tokens,
                exclude=tried,
            )
        self.metrics.failures.inc()
        return _error(502, "the engines failed this request", "upstream_error")

    async def _forward(
        self, request: web.Request, body: bytes, engine: Engine, choice: Choice, retried: bool
    ) -> web.StreamResponse | None:
        """The engine's answer to the request, passed on; None when the engine failed
        before anything reached the client (the caller tries another)."""
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(
            sock_connect=self.settings.connect_timeout_s, sock_read=self.settings.read_timeout_s
        )
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        if self.settings.engine_key is not None:
            headers["Authorization"] = f"Bearer {self.settings.engine_key}"
        route = json.dumps(
            {
                "engine": engine.name,
                "policy": choice.policy,
                "cached_tokens": choice.cached_tokens,
                "load": choice.load,
                "retried": retried,
            },
            separators=(",", ":"),
        )
        engine.in_flight += 1
        try:
            try:
                upstream = await self._session.post(
                    engine.url + request.path, data=body, headers=headers, timeout=timeout
                )
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                logger.warning("engine %s: %s", engine.name, type(exc).__name__)
                return None
            async with upstream:
                if upstream.status >= 500:
                    return None
                out_headers = {
                    k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS
                }
                out_headers[ROUTE_HEADER] = route
                if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
                    try:
                        payload = await upstream.read()
                    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                        return None
                    engine.served += 1
                    return web.Response(status=upstream.status, body=payload, headers=out_headers)
                return await self._stream(request, upstream, out_headers, engine)
        finally:
            engine.in_flight -= 1

    async def _stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        headers: dict[str, str],
        engine: Engine,
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status, headers=headers)
        await response.prepare(request)
        try:
            async for piece in upstream.content.iter_any():
                await response.write(piece)
        except (aiohttp.ClientPayloadError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
            logger.warning("engine %s failed mid-stream: %s", engine.name, type(exc).__name__)
            self.engines.failed(engine)
            error = {"error": {"message": "the engine failed mid-stream", "type": "upstream_error"}}
            await response.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
        except (ConnectionResetError, asyncio.CancelledError):
            raise  # the client went away: leaving the block closes the engine's stream
        engine.served += 1
        await response.write_eof()
        return response

    async def models(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.settings.connect_timeout_s * 2)
        headers = {}
        if self.settings.engine_key is not None:
            headers["Authorization"] = f"Bearer {self.settings.engine_key}"
        for engine in self.engines.healthy():
            try:
                async with self._session.get(
                    f"{engine.url}/v1/models", timeout=timeout, headers=headers
                ) as answer:
                    if answer.status == 200:
                        return web.Response(
                            body=await answer.read(), content_type="application/json"
                        )
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                self.engines.failed(engine)
        return _error(503, "no engine is healthy", "unavailable")

    async def health(self, request: web.Request) -> web.StreamResponse:
        healthy = len(self.engines.healthy())
        status = 200 if healthy else 503
        return web.json_response({"healthy_engines": healthy}, status=status)

    async def metrics_text(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"content-type": "text/plain; version=0.0.4; charset=utf-8"},
        )


def _error(status: int, message: str, kind: str) -> web.Response:
    body: dict[str, Any] = {
        "error": {"message": message, "type": kind, "param": None, "code": None}
    }
    return web.json_response(body, status=status)
