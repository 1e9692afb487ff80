"""The responses of the OpenAI API subset ``lmtier demo serve`` speaks (its requests
are :mod:`.openai_requests`).

Field names, defaults and shapes follow OpenAI's completions and chat completions API
as vLLM serves it (``/v1/completions``, ``/v1/chat/completions``, streamed as
server-sent events), so OpenAI clients, vLLM's benchmarks and ``lmtier warm --via``
work against either. Beyond OpenAI's fields, the usage block carries ``lmtier``: the
cached tokens per serving tier and the engine's TTFT; errors have OpenAI's body.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, Field

__all__ = [
    "ChatCompletionChunk",
    "ChatCompletionResponse",
    "CompletionResponse",
    "ErrorResponse",
    "LMTierUsage",
    "ModelList",
    "Usage",
    "error_body",
    "sse_event",
]

SSE_DONE = "data: [DONE]\n\n"
"""The last event of every stream, as OpenAI and vLLM send it."""


def _is_none(value: object) -> bool:
    return value is None


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
