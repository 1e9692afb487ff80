"""``lmtier demo serve``: the demo engine behind an OpenAI-compatible HTTP API.

FastAPI and uvicorn, like vLLM's server: ``POST /v1/completions`` and
``POST /v1/chat/completions`` (streamed as server-sent events with ``"stream": true``),
``GET /v1/models`` and ``GET /health``. Each prefill goes through lmtier
(:mod:`.engine`), and the usage block reports the prompt tokens lmtier served as
``prompt_tokens_details.cached_tokens``, as OpenAI reports its prompt cache, plus
``usage.lmtier``: the tokens per serving tier and the engine's TTFT. It is the engine
``lmtier warm --via`` and the cluster demo talk to; vLLM with the lmtier connector
answers the same requests.

One request runs at a time (:class:`~.engine.AsyncEngine`), the model's work in a
worker thread while the event loop keeps accepting connections; a stream holds the
engine until its last token, and a client that goes away ends it at the next token.
Every request passes :mod:`.openai_requests` first: its body read within a size limit
and each field's type, range and size checked before the prompt is tokenized (in a
worker thread, so that a long text holds neither the loop nor the engine). A bad
request gets HTTP 400 (413 for a body too large) with OpenAI's error body; an
unexpected failure gets a 500 with the same body (the traceback goes to the server's
log only).

Start-up prints ``lmtier demo serve: listening on http://HOST:PORT`` once the socket
accepts connections (``--port 0`` binds a free port, which that line names). SIGTERM
or SIGINT ends the running request at its next token, closes the server and the cache
(flushing its background writes), and exits 0. Depends on uvicorn's ``Server.startup``
and ``Server.shutdown`` hooks and its ``sockets=`` argument (uvicorn >= 0.30; the
pyproject extra ``serve``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator
from types import FrameType
from typing import Any

import anyio.to_thread
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from lmtier.config import LMTierConfig
from lmtier_apps.demo.demo import open_cache, set_up, sidecar_problem
from lmtier_apps.engine.engine import (
    AsyncEngine,
    Engine,
    Outcome,
    SamplingParams,
    StreamDecoder,
    load_codec,
)
from lmtier_apps.engine.openai_api import (
    SSE_DONE,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    Delta,
    LMTierUsage,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Usage,
    error_body,
    sse_event,
)
from lmtier_apps.engine.openai_requests import (
    DEFAULT_MAX_TOKENS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
    read_body,
)
from lmtier_connector.hf.adapter import CachedCausalLM

__all__ = ["build_app", "cmd_serve"]

logger = logging.getLogger(__name__)

READY = "lmtier demo serve: listening on {url}"
"""The line printed (and flushed) once the server accepts connections."""
GRACEFUL_SHUTDOWN_S = 30
"""How long a shutdown waits for open connections before cancelling them."""
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def usage_of(outcome: Outcome) -> Usage:
    """OpenAI's usage block for a finished request, with lmtier's part."""
    prompt, completion = len(outcome.prompt_ids), len(outcome.token_ids)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=outcome.cached_tokens),
        lmtier=LMTierUsage(
            cached_tokens_by_tier=outcome.tokens_by_tier,
            ttft_ms=round(outcome.ttft_ms, 3),
            max_logit_diff=outcome.max_logit_diff,
        ),
    )


def _head(prefix: str, engine: Engine) -> dict[str, Any]:
    """The fields every response and chunk of one request shares."""
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": engine.name}


def _params(
    engine: Engine,
    request: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    num_prompt_tokens: int,
) -> SamplingParams:
    engine.check_budget(num_prompt_tokens, max_tokens)
    temperature = 1.0 if request.temperature is None else request.temperature
    return SamplingParams(max_tokens, temperature, request.seed, request.cache_salt or "")


def build_app(engine: Engine) -> FastAPI:
    """The HTTP API over ``engine``; see the module docstring."""
    app = FastAPI(title="lmtier demo engine", docs_url=None, redoc_url=None)
    turns = AsyncEngine(engine)
    created = int(time.time())
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        card = ModelCard(
            id=engine.name, created=created, root=engine.name, max_model_len=engine.max_model_len
        )
        return ModelList(data=[card]).model_dump()

    @app.post("/v1/completions", response_model=None)
    async def completions(http: Request) -> Response:
        request = parse_request(CompletionRequest, await read_body(http), engine.limits)
        engine.check_model(request.model)
        outcome = Outcome(await anyio.to_thread.run_sync(engine.prompt_ids, request.prompt))
        max_tokens = request.max_tokens or DEFAULT_MAX_TOKENS
        params = _params(engine, request, max_tokens, len(outcome.prompt_ids))
        head = _head("cmpl", engine)
        prompt_ids = outcome.prompt_ids if request.return_token_ids else None
        if request.stream:
            events = _completion_events(turns, outcome, params, request, head)
            return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        await turns.run(outcome, params)
        choice = CompletionChoice(
            text=engine.codec.decode(outcome.token_ids),
            finish_reason=outcome.finish_reason,
            token_ids=outcome.token_ids if request.return_token_ids else None,
        )
        body = CompletionResponse(
            **head, choices=[choice], usage=usage_of(outcome), prompt_token_ids=prompt_ids
        )
        return JSONResponse(body.model_dump())

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(http: Request) -> Response:
        request = parse_request(ChatCompletionRequest, await read_body(http), engine.limits)
        engine.check_model(request.model)
        messages = [(message.role, message.text()) for message in request.messages]
        outcome = Outcome(await anyio.to_thread.run_sync(engine.chat_ids, messages))
        params = _params(engine, request, request.token_budget(), len(outcome.prompt_ids))
        head = _head("chatcmpl", engine)
        if request.stream:
            events = _chat_events(turns, outcome, params, request, head)
            return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        await turns.run(outcome, params)
        choice = ChatChoice(
            message=AssistantMessage(content=engine.codec.decode(outcome.token_ids)),
            finish_reason=outcome.finish_reason,
            token_ids=outcome.token_ids if request.return_token_ids else None,
        )
        prompt_ids = outcome.prompt_ids if request.return_token_ids else None
        body = ChatCompletionResponse(
            **head, choices=[choice], usage=usage_of(outcome), prompt_token_ids=prompt_ids
        )
        return JSONResponse(body.model_dump())

    return app


async def _completion_events(
    turns: AsyncEngine,
    outcome: Outcome,
    params: SamplingParams,
    request: CompletionRequest,
    head: dict[str, Any],
) -> AsyncIterator[str]:
    """A completion's SSE stream: a chunk per piece of text, the finish reason in the
    last, then (``include_usage``) a chunk with the usage and no choices, then [DONE]."""
    with_usage = request.include_usage

    def chunk(text: str, finish_reason: str | None = None) -> str:
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        return sse_event(CompletionResponse(**head, choices=[choice]), with_usage=with_usage)

    decoder = StreamDecoder(turns.engine.codec)
    try:
        async for token in turns.tokens(outcome, params):
            piece = decoder.push(token)
            if piece:
                yield chunk(piece)
        yield chunk(decoder.flush(), outcome.finish_reason)
        if with_usage:
            yield sse_event(CompletionResponse(**head, choices=[], usage=usage_of(outcome)))
    except Exception:  # headers are sent: report in the stream, as vLLM does
        logger.exception("completion stream failed")
        yield sse_event(error_body("the engine failed", kind="internal_server_error"))
    yield SSE_DONE


async def _chat_events(
    turns: AsyncEngine,
    outcome: Outcome,
    params: SamplingParams,
    request: ChatCompletionRequest,
    head: dict[str, Any],
) -> AsyncIterator[str]:
    """A chat completion's SSE stream: the assistant role first, a delta per piece of
    text, an empty delta with the finish reason, the usage (``include_usage``), [DONE]."""
    with_usage = request.include_usage

    def chunk(delta: Delta, finish_reason: str | None = None) -> str:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
        return sse_event(ChatCompletionChunk(**head, choices=[choice]), with_usage=with_usage)

    decoder = StreamDecoder(turns.engine.codec)
    try:
        yield chunk(Delta(role="assistant", content=""))
        async for token in turns.tokens(outcome, params):
            piece = decoder.push(token)
            if piece:
                yield chunk(Delta(content=piece))
        tail = decoder.flush()
        if tail:
            yield chunk(Delta(content=tail))
        yield chunk(Delta(), outcome.finish_reason)
        if with_usage:
            yield sse_event(ChatCompletionChunk(**head, choices=[], usage=usage_of(outcome)))
    except Exception:
        logger.exception("chat completion stream failed")
        yield sse_event(error_body("the engine failed", kind="internal_server_error"))
    yield SSE_DONE


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's body: 400 (or 413) for bad requests, the HTTP errors of
    routing (404, 405) with their status, 500 for anything else."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        body = error_body(str(exc), param=exc.param, code=exc.code)
        return JSONResponse(body, exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), kind="http_error"), exc.status_code)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback after this handler answers.
        body = error_body(f"internal error: {type(exc).__name__}", kind="internal_server_error")
        return JSONResponse(body, 500)


class _Server(uvicorn.Server):
    """uvicorn's server, announcing itself once it accepts connections and stopping the
    engine before it waits for open connections to finish."""

    def __init__(self, config: uvicorn.Config, engine: Engine, url: str) -> None:
        super().__init__(config)
        self.engine = engine
        self.url = url

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            print(READY.format(url=self.url), flush=True)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.engine.stop()
        await super().shutdown(sockets=sockets)


def _listen(host: str, port: int) -> tuple[socket.socket, str]:
    """A listening socket on ``host:port`` (port 0: a free one) and its URL."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=128)
    bound = sock.getsockname()[1]
    return sock, f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"


def _context_length(model_config: Any) -> int:
    """The model's context in tokens, under the names transformers configs give it."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(model_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"{type(model_config).__name__} names no context length")


def cmd_serve(args: argparse.Namespace, config: LMTierConfig) -> int:
    """Run ``lmtier demo serve`` until SIGTERM or SIGINT; see the module docstring."""
    received: list[int] = []

    def record(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    # Installed first: a signal during start-up means "do not serve" rather than a
    # traceback; uvicorn takes them over while serving, then hands the one it caught
    # back to this handler, so the process exits 0 rather than by the signal.
    previous = {sig: signal.signal(sig, record) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _serve(args, config, received)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve(args: argparse.Namespace, config: LMTierConfig, received: list[int]) -> int:
    try:
        sock, url = _listen(args.host, args.port)
    except OSError as exc:
        print(
            f"lmtier demo serve: error: cannot listen on {args.host}:{args.port}: "
            f"{exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1
    with sock:
        setup = set_up(args, config)
        demo = setup.demo
        with open_cache(args, setup, client_name="lmtier demo serve") as cache:
            problem = sidecar_problem(args, cache, command="lmtier demo serve")
            if problem is not None:
                print(problem, file=sys.stderr)
                return 1
            llm = CachedCausalLM(demo.model, cache, device_cache=setup.device_cache)
            engine = Engine(
                llm,
                load_codec(demo.model, args.model),
                name=args.served_model_name or demo.model_id,
                vocab_size=demo.vocab_size,
                max_model_len=_context_length(demo.model.config),
                check_logits=args.check_logits,
            )
            if received:
                return 0
            uvicorn_config = uvicorn.Config(
                build_app(engine),
                log_config=None,  # lmtier's logging (-v) applies to uvicorn's loggers too
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            )
            _Server(uvicorn_config, engine, url).run(sockets=[sock])
            names = [signal.Signals(signum).name for signum in received]
            logger.info("lmtier demo serve: stopped by %s", ", ".join(names) or "uvicorn")
    return 0
