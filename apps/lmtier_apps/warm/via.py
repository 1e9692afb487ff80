"""``lmtier warm --via URL``: have a running OpenAI-compatible engine (vLLM with the
lmtier connector, ``lmtier demo serve``) compute and save its own KV, by sending each
prompt with ``max_tokens=1``. Text and token prompts go to ``/v1/completions`` (tokens
as a list of ints), messages to ``/v1/chat/completions``; the engine's usage block
gives the prompt tokens and, where it reports them, the cached ones
(``prompt_tokens_details.cached_tokens``).

Standard library only (urllib, a thread pool): the requests are few and each is a
prefill, so a connection per request costs nothing measurable and an HTTP client
dependency would buy nothing. Loopback engines are never reached through a proxy
from the environment (``http_proxy`` without ``no_proxy`` would send them away).

Failures, and why each is treated so:

* connection refused, reset or dropped, HTTP 5xx and 429: retried ``retries`` times
  with doubling, jittered backoff (429's ``Retry-After`` honoured, at most 30 s);
  these pass. After the last try a connection failure raises :class:`EngineUnavailable`
  (no later prompt can succeed), a 5xx or 429 becomes this prompt's error (the engine
  is up; this prompt may be what it fails on).
* any other HTTP 4xx: this prompt's error at once, with the OpenAI-style error body's
  message (a prompt over the context length, an unknown model).
* no answer within ``timeout_s``: this prompt's error, not retried: the engine may
  still be computing it, and a resend would double the work.

The API key goes into the ``Authorization`` header only: it is never logged, and it
is masked in any error message that quotes the engine's answer.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from lmtier.config import Secret, redact_url
from lmtier.errors import InvalidRequestError, LMTierError
from lmtier_apps.warm.inputs import Prompt

__all__ = ["EngineClient", "EngineUnavailable", "ViaResult"]

logger = logging.getLogger(__name__)

_MAX_DELAY_S = 30.0
_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


class EngineUnavailable(LMTierError):
    """The engine could not be used at all: unreachable after every retry, or it
    serves no model. ``url`` is the engine's base URL, password redacted."""

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message)
        self.url = url


@dataclass(frozen=True, slots=True)
class ViaResult:
    """What the engine did with one prompt. ``prompt_tokens`` and ``cached_tokens`` are
    the engine's own counts (None where its usage block does not give them; vLLM
    gives cached tokens only with ``--enable-prompt-tokens-details``); ``seconds``
    covers retries; ``error`` is a one-line reason when the prompt was not warmed."""

    prompt: Prompt
    prompt_tokens: int | None
    cached_tokens: int | None
    seconds: float
    error: str | None = None

    @property
    def source(self) -> str:
        """Where the prompt came from (``prompts.jsonl:12``)."""
        return self.prompt.source


class _Failed(Exception):
    """This prompt's request failed for good; the message goes into ViaResult.error."""


class _Transient(Exception):
    """A failure worth another try. ``status`` is None for a connection failure."""

    def __init__(
        self, message: str, *, status: int | None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class EngineClient:
    """A client for one OpenAI-compatible engine at ``base_url`` (``http://host:8000``;
    a trailing ``/v1`` and a missing ``http://`` are accepted). Thread-safe.

    ``model``: the name sent with every request; None asks ``GET /v1/models`` once,
    on first use, and takes the first. Nothing is sent by the constructor.
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | Secret | None = None,
        timeout_s: float = 600.0,
        retries: int = 2,
        backoff_s: float = 0.5,
    ) -> None:
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise InvalidRequestError(
                "timeout_s must be > 0, retries and backoff_s >= 0; got "
                f"{timeout_s}, {retries}, {backoff_s}"
            )
        self._base, loopback = _base_url(base_url)
        self.url = redact_url(self._base)
        """The base URL as it may be shown: a password in it redacted."""
        self._model = model
        self._model_lock = threading.Lock()
        self._api_key = Secret(api_key) if isinstance(api_key, str) else api_key
        self._timeout_s = timeout_s
        self._retries = retries
        self._backoff_s = backoff_s
        handlers = [urllib.request.ProxyHandler({})] if loopback else []
        self._opener = urllib.request.build_opener(*handlers)

    def resolve_model(self) -> str:
        """The model name requests carry: the one given, or the engine's first listed
        model, asked once. Raises EngineUnavailable when the engine cannot be reached
        or lists none, so a run can call it first to fail before any prompt is read."""
        with self._model_lock:
            if self._model is None:
                try:
                    listing = self._call("GET", "/v1/models", None)
                except _Failed as exc:
                    raise EngineUnavailable(f"{self.url}/v1/models: {exc}", url=self.url) from exc
                data = listing.get("data") if isinstance(listing, dict) else None
                first = data[0] if isinstance(data, list) and data else None
                if not isinstance(first, dict) or not isinstance(first.get("id"), str):
                    raise EngineUnavailable(
                        f"{self.url}/v1/models lists no model: pass the model name", url=self.url
                    )
                self._model = first["id"]
                logger.info("engine %s serves model %s", self.url, self._model)
            return self._model

    def warm(self, prompt: Prompt) -> ViaResult:
        """Send ``prompt`` with ``max_tokens=1`` and report what the engine counted.
        A prompt the engine refuses comes back with ``error`` set; an engine that
        cannot be reached raises EngineUnavailable."""
        started = time.perf_counter()
        body: dict[str, Any] = {"model": self.resolve_model(), "max_tokens": 1, "stream": False}
        if prompt.messages is not None:
            path = "/v1/chat/completions"
            body["messages"] = list(prompt.messages)
        else:
            path = "/v1/completions"
            body["prompt"] = prompt.text if prompt.text is not None else list(prompt.tokens or ())
        try:
            answer = self._call("POST", path, body, source=prompt.source)
        except _Failed as exc:
            return ViaResult(prompt, None, None, time.perf_counter() - started, str(exc))
        usage = answer.get("usage") if isinstance(answer, dict) else None
        usage = usage if isinstance(usage, dict) else {}
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return ViaResult(
            prompt,
            _count(usage.get("prompt_tokens")),
            _count(cached),
            time.perf_counter() - started,
        )

    def warm_all(self, prompts: Iterable[Prompt], concurrency: int = 4) -> Iterator[ViaResult]:
        """Warm every prompt with at most ``concurrency`` requests in flight, yielding
        results as they complete (not in input order; each names its source).

        ``prompts`` is read as requests finish, never ahead, so it may be an endless
        generator. EngineUnavailable stops the iteration; requests in flight then are
        abandoned (their threads end with their request), queued ones never start.
        """
        if concurrency < 1:
            raise InvalidRequestError(f"concurrency must be >= 1, got {concurrency}")
        self.resolve_model()  # once, here, rather than in every worker at the same time
        remaining = iter(prompts)
        pending: set[Future[ViaResult]] = set()
        pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="lmtier-warm")
        try:
            while True:
                for prompt in remaining:
                    pending.add(pool.submit(self.warm, prompt))
                    if len(pending) >= concurrency:
                        break
                if not pending:
                    return
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    yield future.result()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _call(self, method: str, path: str, body: Any, *, source: str = "") -> Any:
        """One request with the retry policy of the module docstring: the decoded JSON
        answer, or _Failed; EngineUnavailable once a connection failure outlasts retries."""
        attempt = 0
        where = f" for {source}" if source else ""
        while True:
            try:
                return self._send(method, path, body)
            except _Transient as exc:
                if attempt >= self._retries:
                    if exc.status is not None:
                        raise _Failed(str(exc)) from exc
                    tries = attempt + 1
                    raise EngineUnavailable(
                        f"engine at {self.url} unreachable after {tries} "
                        f"{'try' if tries == 1 else 'tries'} ({method} {path}{where}): {exc}",
                        url=self.url,
                    ) from exc
                delay = self._backoff_s * 2**attempt * random.uniform(0.5, 1.0)  # noqa: S311
                if exc.retry_after is not None:
                    delay = exc.retry_after
                delay = min(delay, _MAX_DELAY_S)
                logger.debug("%s %s%s: %s; retry in %.2f s", method, path, where, exc, delay)
                time.sleep(delay)
                attempt += 1

    def _send(self, method: str, path: str, body: Any) -> Any:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key.reveal()}"
        request = urllib.request.Request(  # noqa: S310 - the scheme is checked: http(s)
            self._base + path, data=data, headers=headers, method=method
        )
        try:
            with self._opener.open(request, timeout=self._timeout_s) as response:
                payload = response.read()
        except urllib.error.HTTPError as exc:
            with exc:  # its socket, closed now rather than by the garbage collector
                message = self._masked(_error_message(exc))
            if exc.code == 429 or exc.code >= 500:
                raise _Transient(message, status=exc.code, retry_after=_retry_after(exc)) from exc
            raise _Failed(message) from exc
        except urllib.error.URLError as exc:  # raised while connecting or sending
            raise _Transient(f"cannot connect: {_reason(exc.reason)}", status=None) from exc
        except TimeoutError as exc:  # the request went out; no answer came in time
            raise _Failed(f"no answer within {self._timeout_s:g} s") from exc
        except (http.client.HTTPException, OSError) as exc:  # closed without (a whole) answer
            raise _Transient(f"connection dropped: {_reason(exc)}", status=None) from exc
        try:
            return json.loads(payload)
        except ValueError as exc:
            raise _Failed(f"the answer is not JSON: {_one_line(repr(payload[:80]))}") from exc

    def _masked(self, text: str) -> str:
        if self._api_key is not None and self._api_key.reveal():
            return text.replace(self._api_key.reveal(), "***")
        return text


def _base_url(base_url: str) -> tuple[str, bool]:
    """The URL paths are appended to (no trailing ``/`` or ``/v1``); whether it is loopback."""
    url = base_url.strip()
    if "://" not in url:
        url = f"http://{url}"
    url = url.rstrip("/").removesuffix("/v1")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as exc:
        raise InvalidRequestError(f"not a URL: {redact_url(base_url)!r} ({exc})") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequestError(
            f"the engine URL must be http(s)://host[:port], got {redact_url(base_url)!r}"
        )
    return url, parts.hostname in _LOOPBACK


def _error_message(exc: urllib.error.HTTPError) -> str:
    """``HTTP 400: <message>``, the message taken from an OpenAI-style body
    (``{"error": {"message": ...}}``), vLLM's older flat one, or FastAPI's ``detail``."""
    try:
        raw = exc.read(65536)
    except (OSError, http.client.HTTPException):
        raw = b""
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    detail: Any = None
    if isinstance(data, dict):
        error = data.get("error")
        detail = error.get("message") if isinstance(error, dict) else error
        detail = detail or data.get("message") or data.get("detail")
        if isinstance(detail, list) and detail and isinstance(detail[0], dict):
            detail = detail[0].get("msg")  # FastAPI's validation errors: the first one
    if not isinstance(detail, str) or not detail.strip():
        detail = raw.decode("utf-8", "replace").strip() or exc.reason
    return f"HTTP {exc.code}: {_one_line(str(detail))}"


def _retry_after(exc: urllib.error.HTTPError) -> float | None:
    value = exc.headers.get("Retry-After") if exc.headers is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:  # an HTTP date: rare enough to fall back to the backoff
        return None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _reason(reason: object) -> str:
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return _one_line(str(reason)) or type(reason).__name__


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 200 else text[:197] + "..."
