"""The demo engine behind ``lmtier demo serve``: text to token ids, a cached prefill, and
decoding, one request at a time.

:class:`Engine` turns a request into token ids, checks it against the model (an empty
prompt, a prompt or a reply past the context, token ids outside the vocabulary: an
:class:`~.openai_requests.ApiError`, answered with HTTP 400), then runs it: the prefill through
:class:`~lmtier_connector.hf.adapter.CachedCausalLM` (the cached prefix is loaded, the
prompt's new chunks stored), then greedy or temperature sampling, one token at a time,
so a stream sends each token as soon as it exists. It knows nothing of HTTP
(:mod:`.serve` does); :class:`AsyncEngine` runs it from an event loop, one request at
a time, since the CPU model is not re-entrant.

After the reply, its full chunks are stored too
(:meth:`~lmtier_connector.hf.adapter.CachedCausalLM.store_sequence`): the next turn of
a conversation, whose prompt holds this reply, finds them.

Text: the model directory's tokenizer, or, for the random demo model (which has
none, and which ``lmtier demo`` only ever feeds random token ids), the demo's byte
tokenizer (:mod:`.demo_tokenizer`), the one ``lmtier warm`` uses for it too.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio.to_thread
import torch

from lmtier.errors import brief
from lmtier_apps.demo.demo_tokenizer import CHAT_TEMPLATE, demo_tokenizer
from lmtier_apps.engine.openai_requests import ApiError, RequestLimits
from lmtier_connector.hf.adapter import CachedCausalLM
from lmtier_connector.hf.compat import call_with_cache

__all__ = [
    "AsyncEngine",
    "Engine",
    "Outcome",
    "SamplingParams",
    "StreamDecoder",
    "TextCodec",
    "load_codec",
]

_REPLACEMENT = "\ufffd"


class TextCodec:
    """A transformers tokenizer, used as ``lmtier warm`` uses it, so both turn the same
    prompt into the same token ids (and so the same chunk keys): text with the
    tokenizer's special tokens, chat through ``apply_chat_template`` with the
    generation prompt; the demo tokenizer's template when the tokenizer has none.

    Decoding shows an id the tokenizer does not know (the random demo model draws from
    32000 ids, its byte tokenizer knows 259) as ``<|id|>`` rather than dropping it, so
    every generated token is visible in the text.

    Its methods may be called from several threads (the server tokenizes prompts in
    worker threads): a lock serializes them, as a transformers tokenizer's call
    changes its own truncation state and may not be re-entered.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self._lock = threading.Lock()
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        """Tokens that end a reply (finish_reason "stop")."""
        self._known = len(tokenizer)
        self.max_token_chars = max(map(len, tokenizer.get_vocab()), default=1)
        """The longest entry of the vocabulary, in characters: no token stands for more
        text (a byte-level entry is one character per byte; a special token, which text
        may spell out, its whole name), so text longer than the context times this
        cannot fit it."""

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return _ids(self.tokenizer(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        with self._lock:
            return self._decode(ids)

    def _decode(self, ids: Sequence[int]) -> str:
        pieces: list[str] = []
        run: list[int] = []
        for token in ids:
            if 0 <= token < self._known:
                run.append(token)
                continue
            if run:
                pieces.append(self.tokenizer.decode(run, skip_special_tokens=True))
                run = []
            pieces.append(f"<|{token}|>")
        if run:
            pieces.append(self.tokenizer.decode(run, skip_special_tokens=True))
        return "".join(pieces)

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """The prompt for (role, text) messages, ending where the assistant replies."""
        conversation = [{"role": role, "content": text} for role, text in messages]
        template = None if getattr(self.tokenizer, "chat_template", None) else CHAT_TEMPLATE
        try:
            with self._lock:
                encoded = self.tokenizer.apply_chat_template(
                    conversation, chat_template=template, tokenize=True, add_generation_prompt=True
                )
        except Exception as exc:  # a template is user-supplied Jinja: whatever it raises
            message = f"the chat template refused the messages: {exc}"
            raise ApiError(message, param="messages") from exc
        return _ids(encoded)


def _ids(encoded: Any) -> list[int]:
    """Token ids from a tokenizer's answer: a BatchEncoding (transformers 5's
    ``apply_chat_template`` too) or a plain list."""
    ids = encoded["input_ids"] if not isinstance(encoded, list) else encoded
    return [int(i) for i in ids]


def load_codec(model: Any, directory: str | os.PathLike[str] | None) -> TextCodec:
    """The tokenizer of the model ``directory``; the demo's byte tokenizer for the random
    demo model (``directory`` None) or a directory without one."""
    if directory is None or not any(Path(directory).glob("tokenizer*")):
        tokenizer = demo_tokenizer()
    else:
        from transformers import AutoTokenizer  # noqa: PLC0415 - only for a model directory

        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(generation_eos, int):
        eos.add(generation_eos)
    elif isinstance(generation_eos, list):
        eos.update(generation_eos)
    return TextCodec(tokenizer, frozenset(eos))


class StreamDecoder:
    """Text of a growing reply, piece by piece: each piece is what the reply's text
    gained since the last, held back while it ends in an incomplete character. The
    whole reply is decoded each time (decoding a token alone loses spaces and splits
    characters across byte tokens); replies are short, so this stays cheap."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        """The new text after ``token`` ("" while a character is incomplete)."""
        self.ids.append(token)
        text = self.codec.decode(self.ids)
        return "" if text.endswith(_REPLACEMENT) else self._take(text)

    def flush(self) -> str:
        """What is left at the end of the reply, an incomplete character included."""
        return self._take(self.codec.decode(self.ids))

    def _take(self, text: str) -> str:
        piece = text[len(self.sent) :]
        self.sent = text
        return piece


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to generate: ``temperature`` 0 is greedy; ``seed`` None draws a fresh one."""

    max_tokens: int
    temperature: float = 1.0
    seed: int | None = None
    cache_salt: str = ""


@dataclass(slots=True)
class Outcome:
    """What one request produced, filled in while it runs."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    cached_tokens: int = 0
    tokens_by_tier: dict[str, int] = field(default_factory=dict)
    ttft_ms: float = 0.0
    max_logit_diff: float | None = None


class Engine:
    """One model, its cache and its tokenizer; requests run one at a time
    (:class:`AsyncEngine` serializes them). See the module docstring."""

    def __init__(
        self,
        llm: CachedCausalLM,
        codec: TextCodec,
        *,
        name: str,
        vocab_size: int,
        max_model_len: int,
        check_logits: bool = False,
    ) -> None:
        """``name``: the model name clients send; ``check_logits``: also run each prompt
        without lmtier and report the largest logit difference."""
        self.llm = llm
        self.codec = codec
        self.name = name
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._plain = CachedCausalLM(llm.model, None) if check_logits else None
        self._stopping = threading.Event()

    def check_model(self, name: str | None) -> None:
        """ApiError unless ``name`` is None or the served model's name."""
        if name is not None and name != self.name:
            raise ApiError(
                f"the model {brief(name)} does not exist: this server serves {self.name!r}",
                param="model",
                code="model_not_found",
            )

    @property
    def limits(self) -> RequestLimits:
        """The request sizes this engine's context and tokenizer allow."""
        return RequestLimits(self.max_model_len, self.codec.max_token_chars)

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A completion's prompt (text, or token ids) as token ids, checked against the
        vocabulary."""
        if prompt in ("", []):  # before the tokenizer, which would add a BOS to ""
            raise ApiError("the prompt is empty", param="prompt")
        ids = self.codec.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ApiError("the prompt is empty", param="prompt")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ApiError(
                f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                param="prompt",
            )
        return ids

    def chat_ids(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """A chat's prompt: the messages rendered and tokenized, checked."""
        return self.prompt_ids(self.codec.chat_prompt(messages))

    def check_budget(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """ApiError when the prompt, or the prompt and the reply, exceed the context."""
        if num_prompt_tokens >= self.max_model_len:
            raise ApiError(
                f"the prompt is {num_prompt_tokens} tokens; this model's context is "
                f"{self.max_model_len} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise ApiError(
                f"this model's context is {self.max_model_len} tokens, but "
                f"{num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in "
                f"the prompt, {max_tokens} for the completion): lower max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )

    def stop(self) -> None:
        """End the running request at its next token (finish_reason "abort"), and any
        later one at once: the server is shutting down."""
        self._stopping.set()

    def generate(self, outcome: Outcome, params: SamplingParams) -> Generator[int, None, None]:
        """Prefill ``outcome.prompt_ids`` through lmtier, then yield each new token id;
        ``outcome`` holds the cache figures after the first and the finish reason at
        the end. The caller holds the engine's turn until the iterator is done."""
        result = self.llm.prefill(outcome.prompt_ids, cache_salt=params.cache_salt)
        outcome.cached_tokens = result.num_cached_tokens
        outcome.tokens_by_tier = dict(result.tokens_by_tier)
        outcome.ttft_ms = result.ttft_s * 1e3
        if self._plain is not None:
            reference = self._plain.prefill(outcome.prompt_ids, store=False).logits
            outcome.max_logit_diff = float((result.logits - reference).abs().max())
        past, logits = result.past_key_values, result.logits
        generator = torch.Generator(device=logits.device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        try:
            for step in range(params.max_tokens):
                if self._stopping.is_set():
                    outcome.finish_reason = "abort"
                    return
                token = _sample(logits, params.temperature, generator)
                outcome.token_ids.append(token)
                yield token
                if token in self.codec.eos_token_ids:
                    outcome.finish_reason = "stop"
                    return
                if step + 1 < params.max_tokens:  # no forward pass for a token never sampled
                    ids = torch.tensor([[token]], dtype=torch.long, device=self.llm.device)
                    with torch.inference_mode():
                        out = call_with_cache(self.llm.model, ids, past, use_cache=True)
                    logits = out.logits[0, -1]
            outcome.finish_reason = "length"
        finally:  # the reply's chunks too: a conversation's next turn finds them
            sequence = [*outcome.prompt_ids, *outcome.token_ids]
            self.llm.store_sequence(sequence, past, cache_salt=params.cache_salt)


def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """Greedy at temperature 0, else a draw from softmax(logits / temperature)."""
    if temperature == 0:
        return int(logits.argmax())
    probabilities = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probabilities, 1, generator=generator))


class AsyncEngine:
    """The engine for an event loop: one request at a time (an ``asyncio.Lock``, so a
    waiting request holds no thread), the model's work in a worker thread, so the loop
    keeps accepting connections meanwhile."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._turn = asyncio.Lock()

    async def run(self, outcome: Outcome, params: SamplingParams) -> None:
        """Run a request to its end."""
        async with self._turn:
            await anyio.to_thread.run_sync(_drain, self.engine.generate(outcome, params))

    async def tokens(self, outcome: Outcome, params: SamplingParams) -> AsyncIterator[int]:
        """Run a request, yielding each token as the engine produces it. When the
        consumer is cancelled (its client left), the step in flight finishes first
        (``run_sync`` does not abandon its thread), then the request ends there."""
        async with self._turn:
            steps = self.engine.generate(outcome, params)
            try:
                while (token := await anyio.to_thread.run_sync(_next, steps)) is not None:
                    yield token
            finally:
                steps.close()


def _drain(steps: Iterator[int]) -> None:
    for _ in steps:
        pass


def _next(steps: Iterator[int]) -> int | None:
    return next(steps, None)
