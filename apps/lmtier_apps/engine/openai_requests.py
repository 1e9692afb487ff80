"""The requests ``lmtier demo serve`` takes, and the one gate every request passes
before any work: its body read within a size limit, parsed, and each field checked.

Field names and defaults follow OpenAI's completions and chat completions API as vLLM
serves it; beyond them, vLLM's ``cache_salt`` (a tenant's own cache keys) and
``return_token_ids``. :func:`read_body` and :func:`parse_request` check, in this order
and before the prompt is tokenized or the engine's turn is taken:

* the body's size (:data:`MAX_BODY_BYTES`; HTTP 413) and that it is one JSON object;
* every field's JSON type exactly (pydantic's strict mode: ``true`` is not a token id,
  ``"yes"`` not a boolean, ``"1"`` not a number), and its range: ``temperature`` 0
  (greedy) or from :data:`MIN_TEMPERATURE` to 2 (a smaller one divides the logits
  into infinities), ``seed`` a signed 64-bit integer as in vLLM, ``max_tokens`` >= 1,
  a chat ``role`` one of :data:`ROLES`, text ``content`` parts only;
* sizes: strings such as ``model`` and ``cache_salt`` (:data:`MAX_NAME_CHARS`), and a
  prompt against :class:`RequestLimits`: no more token ids than the context holds, no
  more text than it could hold (the context times the longest token of the
  tokenizer's vocabulary), no more messages than the context has tokens;
* OpenAI's options the demo engine cannot honour (:data:`NEUTRAL_VALUES`: logprobs,
  stop sequences, ``top_p`` < 1, ``n`` > 1, penalties, tools, ...) are refused unless
  they hold their neutral value, never silently ignored. Fields it does not know at
  all are ignored, as OpenAI's SDK sends some (``user``, ``metadata``).

Each failure is an :class:`ApiError` naming the field (``param``), answered with
OpenAI's error body.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import PydanticCustomError
from starlette.requests import Request

from lmtier.errors import InvalidRequestError

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "MAX_BODY_BYTES",
    "MAX_NAME_CHARS",
    "MIN_TEMPERATURE",
    "NEUTRAL_VALUES",
    "ROLES",
    "ApiError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "RequestLimits",
    "parse_request",
    "read_body",
]

DEFAULT_MAX_TOKENS = 16
"""Tokens generated when a request gives no ``max_tokens`` (OpenAI's completions
default; the demo engine uses it for chat too, where OpenAI's is "until the context
ends", which on a CPU would be minutes)."""
MAX_BODY_BYTES = 8 * 1024**2
"""The largest request body kept (HTTP 413 beyond): a whole context of text or token
ids is far less, so this only stops a client from filling the server's memory."""
_DRAIN_BYTES = 64 * 1024**2
"""How much of a too-large body is read and dropped before the 413, so that a client
still sending it reads the answer rather than a reset connection."""
MAX_NAME_CHARS = 1024
"""The longest ``model``, ``cache_salt`` or other short string field."""
MIN_TEMPERATURE = 0.01
"""The smallest temperature above 0 (vLLM raises smaller ones to this; the demo engine
refuses them): logits divided by less overflow to infinities and NaN probabilities."""
Role = Literal["system", "developer", "user", "assistant"]
ROLES: tuple[str, ...] = get_args(Role)
"""The chat roles the demo engine renders (it has no tools, so no ``tool`` messages)."""
_INT64 = 2**63

NEUTRAL_VALUES: dict[str, tuple[object, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "top_p": (1,),
    "stop": ("", []),
    "logprobs": (False,),  # completions' is a count (0 asks for one), chat's a boolean
    "top_logprobs": (0,),
    "echo": (False,),
    "suffix": ("",),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
}
"""OpenAI's options the demo engine cannot honour, each with the values (besides
``null``) that ask for nothing it lacks; any other value is refused."""


class ApiError(InvalidRequestError):
    """A request the engine cannot serve, answered with OpenAI's error body and HTTP
    ``status`` (400 unless said); ``param`` names the request field, ``code`` is
    OpenAI's machine-readable code."""

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400
    ) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The sizes one engine accepts: ``max_model_len`` tokens of context, and
    ``max_token_chars``, the most characters one token of its tokenizer stands for, so
    a text longer than ``max_model_len * max_token_chars`` cannot fit and is refused
    without being tokenized."""

    max_model_len: int
    max_token_chars: int

    @property
    def max_prompt_chars(self) -> int:
        """The most characters of text (prompt, or all messages) worth tokenizing."""
        return self.max_model_len * self.max_token_chars


def _fail(message: str, param: str) -> PydanticCustomError:
    # ``param`` travels in the context, so that a model-level check names its field.
    return PydanticCustomError("lmtier", message, {"param": param})


def _limits(info: ValidationInfo) -> RequestLimits | None:
    context = info.context
    return context.get("limits") if isinstance(context, dict) else None


def _prompt(value: object, info: ValidationInfo) -> str | list[int]:
    """A completion's prompt: text, token ids, or a list holding one of those."""
    if isinstance(value, list) and value and type(value[0]) in (str, list):
        if len(value) != 1:
            raise _fail("one prompt per request, not a batch", "prompt")
        value = value[0]
    limits = _limits(info)
    if isinstance(value, str):
        if limits is not None and len(value) > limits.max_prompt_chars:
            raise _too_long(len(value), limits, "prompt")
        return value
    if isinstance(value, list):
        if limits is not None and len(value) >= limits.max_model_len:
            raise PydanticCustomError(
                "lmtier",
                "the prompt is {count} tokens; this model's context is {limit} tokens",
                {"param": "prompt", "code": "context_length_exceeded", "count": len(value)}
                | {"limit": limits.max_model_len},
            )
        if all(type(token) is int for token in value):  # bool is an int subclass: refused
            return value
    raise _fail("the prompt must be text or a list of integer token ids", "prompt")


def _too_long(chars: int, limits: RequestLimits, param: str) -> PydanticCustomError:
    return PydanticCustomError(
        "lmtier",
        "{chars} characters of text cannot fit this model's context of {limit} tokens "
        "(at most {most} characters)",
        {"param": param, "code": "context_length_exceeded", "chars": chars}
        | {"limit": limits.max_model_len, "most": limits.max_prompt_chars},
    )


def _content(value: object) -> str:
    """A message's content: text, null, or a list of text parts (joined)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts: list[str] = []
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise _fail(f"the demo engine takes text only, not {_json(kind)} parts", "content")
            text = part.get("text")
            if not isinstance(text, str):
                raise _fail("a text part needs a string 'text'", "content")
            texts.append(text)
        return "".join(texts)
    raise _fail("content must be text, null or a list of text parts", "content")


Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]


class _Body(BaseModel):
    # strict: JSON types exactly; unknown fields ignored (see the module docstring).
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _Request(_Body):
    """The fields completions and chat completions share."""

    model: Name | None = Field(default=None, description="None: the served model")
    temperature: float | None = Field(
        default=None, ge=0.0, le=2.0, allow_inf_nan=False, description="0: greedy"
    )
    seed: int | None = Field(
        default=None, ge=-_INT64, lt=_INT64, description="sampling seed (temperature > 0)"
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: Name | None = Field(default=None, description="vLLM's: a tenant's own keys")
    return_token_ids: bool = Field(default=False, description="vLLM's: add the token ids")

    @model_validator(mode="before")
    @classmethod
    def _only_neutral_options(cls, data: object) -> object:
        if isinstance(data, dict):
            for name, neutral in NEUTRAL_VALUES.items():
                value = data.get(name)
                if value is not None and not any(_same(value, n) for n in neutral):
                    shown = _json(value)
                    raise _fail(f"{name} {shown} is not supported by the demo engine", name)
        return data

    @model_validator(mode="after")
    def _checked(self) -> _Request:
        temperature = self.temperature
        if temperature is not None and 0 < temperature < MIN_TEMPERATURE:
            message = f"temperature must be 0 (greedy) or from {MIN_TEMPERATURE} to 2"
            raise _fail(message, "temperature")
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (non-streamed responses always have
        their usage)."""
        return self.stream_options is not None and self.stream_options.include_usage


def _json(value: object) -> str:
    """``value`` as the client wrote it, cut to a readable length."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _same(value: object, neutral: object) -> bool:
    """Equal and of the same JSON type (``false`` is not ``0``; ``1`` is ``1.0``)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(value, int | float) and isinstance(neutral, int | float):
        return value == neutral
    return type(value) is type(neutral) and value == neutral


class CompletionRequest(_Request):
    """``POST /v1/completions``: one prompt, as text or as token ids (a list holding one
    prompt is accepted too; batches of several are not)."""

    prompt: Annotated[str | list[int], BeforeValidator(_prompt)]
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, ge=1)


class ChatMessage(_Body):
    """One message; ``content`` is text, or text parts (joined here)."""

    role: Role
    content: Annotated[str, BeforeValidator(_content)] = ""

    def text(self) -> str:
        """The message's text."""
        return self.content


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is OpenAI's newer name
    for ``max_tokens`` and wins when both are given."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _fits(self, info: ValidationInfo) -> ChatCompletionRequest:
        limits = _limits(info)
        if limits is None:
            return self
        if len(self.messages) > limits.max_model_len:
            message = f"{len(self.messages)} messages cannot fit a context of "
            raise _fail(message + f"{limits.max_model_len} tokens", "messages")
        chars = sum(len(message.content) for message in self.messages)
        if chars > limits.max_prompt_chars:
            raise _too_long(chars, limits, "messages")
        return self

    def token_budget(self) -> int:
        """The most tokens to generate."""
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request's body; ApiError (HTTP 413) when it is over ``limit`` bytes, which
    is neither kept nor parsed: a declared ``Content-Length`` beyond
    :data:`_DRAIN_BYTES` is answered at once, a smaller excess read and dropped."""
    declared = request.headers.get("content-length", "")
    too_large = ApiError(
        f"the request body is over {limit} bytes", code="request_too_large", status=413
    )
    if declared.isdigit() and int(declared) > _DRAIN_BYTES:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > _DRAIN_BYTES:
            raise too_large
        if size <= limit:
            chunks.append(chunk)
    if size > limit:
        raise too_large
    return b"".join(chunks)


_R = TypeVar("_R", bound=_Request)


def parse_request(kind: type[_R], body: bytes, limits: RequestLimits | None) -> _R:
    """``body`` (JSON bytes) as a ``kind`` request, checked against ``limits``; an
    :class:`ApiError` naming the first field at fault otherwise."""
    try:
        return kind.model_validate_json(body, context={"limits": limits})
    except ValidationError as exc:
        raise _api_error(exc) from None


def _api_error(exc: ValidationError) -> ApiError:
    """One line for the first error: ``field: what is wrong``."""
    first = exc.errors(include_url=False, include_input=False)[0]
    kind = first["type"]
    if kind == "json_invalid":
        return ApiError("the request body is not valid JSON")
    context: dict[str, Any] = first.get("ctx") or {}
    location = [str(part) for part in first["loc"]]
    if kind == "lmtier":
        field = str(context["param"])
        # A message's check names its place: messages.2.content.
        where = location[:-1] if location and location[-1] == field else location
        field = ".".join([*where, field]) if where[:1] == ["messages"] else field
        # These messages name their field themselves.
        return ApiError(str(first["msg"]), param=field, code=context.get("code"))
    if kind == "model_type" and not location:
        return ApiError("the request body must be a JSON object")
    param = ".".join(location) or None
    if kind == "literal_error" and location[-1:] == ["role"]:
        return ApiError(f"{param}: the role must be one of {', '.join(ROLES)}", param=param)
    text = f"{param}: {first['msg']}" if param else str(first["msg"])
    return ApiError(text, param=param)
