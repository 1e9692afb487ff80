"""A request's prompt as the engines' caches key it: its token ids (text through the
model's tokenizer and chat template, as the engine turns it into tokens) and the
chunk keys of those ids in the engines' namespace.

The router never runs the model: it needs the namespace (the model's id, revision
and KV geometry, the chunk size and hash, ``cache_salt``) and the tokenizer. With
``--model DIR`` they come from the directory's ``config.json`` and tokenizer and the
namespace flags ``lmtier lookup`` takes (a vLLM engine's paged layout:
``--kv-layout``, ``--kv-block-size``); without it, from the random demo model that
``lmtier demo serve`` runs (``--seed``), built once at start.

A request whose prompt cannot be read (not JSON, no prompt, a token id that is no
token of the model, content that is not text) is refused with HTTP 400 before any
engine sees it: :class:`PromptError`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmtier.api import LMTier
from lmtier.chunks.keys import ChunkKey
from lmtier.config import LMTierConfig
from lmtier.errors import InvalidRequestError
from lmtier.ops.model_args import resolve_model
from lmtier_apps.engine.engine import TextCodec, load_codec
from lmtier_backends.fleet.index import MAX_QUERY_KEYS

__all__ = ["MAX_PROMPT_CHARS", "Prompt", "PromptError", "RouteModel", "load_route_model"]

MAX_PROMPT_CHARS = 4_000_000
"""Most characters of text the router tokenizes for one request (about a million
tokens); a longer prompt is refused rather than tokenized."""


class PromptError(InvalidRequestError):
    """A request the router cannot read the prompt of (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """What the router keeps of a request: its model name, its tenant, whether it
    streams, and its token ids."""

    model: str | None
    cache_salt: str
    stream: bool
    token_ids: list[int]


class RouteModel:
    """The engines' model as far as routing needs it (module docstring)."""

    def __init__(self, config: LMTierConfig, cache: LMTier, codec: TextCodec) -> None:
        self.config = config
        self.chunk_size = config.chunk_size
        self._cache = cache  # never started: only its namespaces and hashers are used
        self._codec = codec
        self.vocab_size = cache.vocab_size

    def keys(self, prompt: Prompt) -> list[ChunkKey]:
        """The chunk keys of the prompt's leading full chunks (at most the index's
        query limit: the rest cannot change the choice)."""
        ids = prompt.token_ids[: MAX_QUERY_KEYS * self.chunk_size]
        return self._cache.keys(ids, cache_salt=prompt.cache_salt)

    def read(self, path: str, body: bytes) -> Prompt:
        """The prompt of an OpenAI request to ``path`` (``/v1/completions`` or
        ``/v1/chat/completions``); PromptError if it cannot be read."""
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PromptError(f"the body is not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise PromptError("the body is not a JSON object")
        model, salt = data.get("model"), data.get("cache_salt") or ""
        if model is not None and not isinstance(model, str):
            raise PromptError("model must be a string")
        if not isinstance(salt, str):
            raise PromptError("cache_salt must be a string")
        stream = data.get("stream", False)
        if not isinstance(stream, bool):
            raise PromptError("stream must be true or false")
        if path.endswith("/chat/completions"):
            ids = self._chat(data.get("messages"))
        else:
            ids = self._completion(data.get("prompt"))
        return Prompt(model, salt, stream, ids)

    def _completion(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: routed by its first prompt
        if isinstance(prompt, str):
            return self._encode(prompt)
        if isinstance(prompt, list) and prompt:
            return self._ids(prompt)
        raise PromptError("prompt must be text or a list of token ids")

    def _chat(self, messages: Any) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise PromptError("messages must be a non-empty list")
        pairs: list[tuple[str, str]] = []
        size = 0
        for at, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise PromptError(f"messages[{at}] must be an object with a role")
            text = _text(message.get("content"), at)
            size += len(text)
            pairs.append((message["role"], text))
        if size > MAX_PROMPT_CHARS:
            raise PromptError(f"the messages hold over {MAX_PROMPT_CHARS} characters")
        try:
            return self._codec.chat_prompt(pairs)
        except InvalidRequestError as exc:
            raise PromptError(str(exc)) from None

    def _encode(self, text: str) -> list[int]:
        if len(text) > MAX_PROMPT_CHARS:
            raise PromptError(f"the prompt holds over {MAX_PROMPT_CHARS} characters")
        if not text:
            raise PromptError("the prompt is empty")
        return self._codec.encode(text)

    def _ids(self, ids: Sequence[Any]) -> list[int]:
        limit = self.vocab_size
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise PromptError("prompt token ids must be non-negative integers")
            if limit is not None and token >= limit:
                raise PromptError(f"token id {token} is outside the model's {limit} tokens")
        return list(ids)


def _text(content: Any, at: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise PromptError(f"messages[{at}]: the router routes text content only")
            text = part.get("text")
            if not isinstance(text, str):
                raise PromptError(f"messages[{at}]: a text part needs its text")
            parts.append(text)
        return "".join(parts)
    raise PromptError(f"messages[{at}].content must be text")


def load_route_model(args: argparse.Namespace, config: LMTierConfig) -> RouteModel:
    """The model ``args`` name: ``--model DIR`` and the namespace flags, else the demo
    model of ``--seed`` (module docstring)."""
    if args.model:
        model = resolve_model(args, config)
        cache = LMTier(model.config, model.spec, tp_size=args.tp_size, **model.cache_kwargs())
        return RouteModel(model.config, cache, load_codec(None, model.directory))
    from lmtier_apps.demo.demo_model import build_demo_model  # noqa: PLC0415 - torch
    from lmtier_connector.hf.adapter import kv_spec_of  # noqa: PLC0415

    demo = build_demo_model(args.seed)
    if args.chunk_size is not None:
        config = config.replace(chunk_size=args.chunk_size)
    cache = LMTier(
        config,
        kv_spec_of(demo.model),
        model_id=demo.model_id,
        model_revision=demo.revision,
        vocab_size=demo.vocab_size,
        tp_size=args.tp_size,
    )
    return RouteModel(config, cache, load_codec(demo.model, None))
