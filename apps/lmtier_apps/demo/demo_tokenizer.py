"""The demo model's tokenizer: bytes as tokens, a real ``transformers`` tokenizer.

The built-in demo model (:mod:`.demo_model`) is random and comes with no vocabulary,
yet ``lmtier demo serve`` takes text and chat messages, and ``lmtier warm`` must turn
the same text into the same token ids as the engine, or its keys would never match.
So the demo's tokenizer is fixed and built here, with no download: byte-level (each
UTF-8 byte is one token, ids ``BYTE_OFFSET + byte``), ``<s>`` prepended, and a simple
chat template. It is a :class:`transformers.PreTrainedTokenizerFast`, so every caller
treats the demo model and a real model directory the same way (``__call__``,
``decode``, ``apply_chat_template``).
"""

from __future__ import annotations

import functools
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

__all__ = ["BYTE_OFFSET", "CHAT_TEMPLATE", "demo_tokenizer"]

_SPECIALS = ("<unk>", "<s>", "</s>")
BYTE_OFFSET = len(_SPECIALS)
"""Token id of byte 0; ids below it are the special tokens."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Each message as ``<|role|>``, a newline, its content and a newline; then the
assistant's turn when a reply is to be generated."""


@functools.lru_cache(maxsize=1)
def demo_tokenizer() -> Any:
    """The demo model's tokenizer (built once per process; see the module docstring)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=_byte_of)
    vocab = {token: index for index, token in enumerate(_SPECIALS)}
    vocab.update({char: BYTE_OFFSET + index for index, char in enumerate(byte_chars)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # noqa: S106
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast: Any = PreTrainedTokenizerFast  # transformers' classes are partly unannotated
    specials = dict(zip(("unk_token", "bos_token", "eos_token"), _SPECIALS, strict=True))
    tokenizer = fast(tokenizer_object=core, **specials)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@functools.cache
def _byte_table() -> dict[str, int]:
    # GPT-2's byte-to-unicode map, which the ByteLevel pre-tokenizer applies: printable
    # bytes map to themselves, the others to characters from U+0100 on, in byte order.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


def _byte_of(char: str) -> int:
    return _byte_table()[char]
