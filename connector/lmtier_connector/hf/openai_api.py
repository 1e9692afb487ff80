"""The OpenAI API subset ``lmtier demo serve`` speaks: request and response bodies.

Field names, defaults and shapes follow OpenAI's completions and chat completions API
as vLLM serves it (``/v1/completions``, ``/v1/chat/completions``, streamed as
server-sent events), so OpenAI clients, vLLM's benchmarks and ``lmtier warm --via``
work against either. Beyond OpenAI's fields, requests take vLLM's ``cache_salt`` (a
tenant's own cache keys) and ``return_token_ids``, and the usage block carries
``lmtier``: the cached tokens per serving tier and the engine's TTFT.

Requests ignore fields they do not know (as OpenAI's SDK sends some the demo engine
has no use for, ``user`` or ``logprobs: false``), but reject sampling options they
cannot honour (``n`` > 1, ``stop``, ``top_p`` < 1) instead of silently ignoring them.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatMessage",
    "CompletionRequest",
    "CompletionResponse",
    "ErrorResponse",
    "LMTierUsage",
    "ModelList",
    "Usage",
    "error_body",
    "sse_event",
]

DEFAULT_MAX_TOKENS = 16
"""Tokens generated when a request gives no ``max_tokens`` (OpenAI's completions
default; the demo engine uses it for chat too, where OpenAI's is "until the context
ends", which on a CPU would be minutes)."""
SSE_DONE = "data: [DONE]\n\n"
"""The last event of every stream, as OpenAI and vLLM send it."""


def _is_none(value: object) -> bool:
    return value is None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Request(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, description="None: the served model")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="0: greedy")
    seed: int | None = Field(default=None, description="sampling seed (temperature > 0)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    top_p: float | None = None
    stop: str | list[str] | None = None
    cache_salt: str | None = Field(default=None, description="vLLM's: a tenant's own keys")
    return_token_ids: bool = Field(default=False, description="vLLM's: add the token ids")

    @field_validator("top_p")
    @classmethod
    def _full_top_p(cls, value: float | None) -> float | None:
        if value is not None and value != 1.0:
            raise ValueError("the demo engine samples from the full distribution: top_p 1 only")
        return value

    @field_validator("stop")
    @classmethod
    def _no_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value:
            raise ValueError("stop sequences are not supported by the demo engine")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (non-streamed responses always have
        their usage)."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    """``POST /v1/completions``: one prompt, as text or as token ids (a list holding one
    prompt is accepted too; batches of several are not)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, ge=1)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message; ``content`` is text or a list of text parts."""

    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """The message's text (text parts joined); ValueError for any other part."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"the demo engine takes text only, not {part.type!r} parts")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is OpenAI's newer name
    for ``max_tokens`` and wins when both are given."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def token_budget(self) -> int:
        """The most tokens to generate."""
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS


class LMTierUsage(BaseModel):
    """lmtier's part of the usage block: where the cached prompt tokens came from, the
    engine's time from the request's turn to its first token's logits, and (with
    ``--check-logits``) the largest logit difference from a full prefill."""

    cached_tokens_by_tier: dict[str, int]
    ttft_ms: float
    max_logit_diff: float | None = Field(default=None, exclude_if=_is_none)


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    """OpenAI's usage block; ``cached_tokens`` counts the prompt tokens lmtier served."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    lmtier: LMTierUsage


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None
    token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)


class CompletionResponse(BaseModel):
    """A completion, or one chunk of a streamed one (OpenAI names both alike); a
    stream's last chunk has no choices and the usage, the others a null usage."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None
    token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)


class Delta(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "lmtier"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_body(
    message: str,
    *,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, object]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    detail = ErrorDetail(message=message, type=kind, param=param, code=code)
    return ErrorResponse(error=detail).model_dump()


def sse_event(body: BaseModel | dict[str, object], *, with_usage: bool = True) -> str:
    """One server-sent event, ``data: {json}`` and a blank line. ``with_usage=False``
    leaves the ``usage`` key out (a stream without ``include_usage``, as OpenAI does)."""
    if isinstance(body, BaseModel):
        data = body.model_dump(exclude=None if with_usage else {"usage"})
    else:
        data = body
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
