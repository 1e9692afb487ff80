"""Warm-up prompts from the inputs ``lmtier warm`` accepts, read lazily, bad ones reported.

How a path is read:

* ``-`` is standard input. Its first non-blank line decides: a line that starts with
  ``{`` makes the stream JSONL, anything else makes the whole stream one text prompt.
  The first line decides, rather than "every line parses as JSON", because stdin is
  read once, as it arrives: an invalid line 10,000 must be a :class:`PromptError`, not
  a reason to reread everything as text.
* A file named ``*.jsonl``, ``*.ndjson`` or ``*.json`` is JSONL; one named like
  :data:`TEXT_SUFFIXES` is one text prompt; any other name is sniffed like stdin.
  The name wins over the content: ``notes.txt`` that starts with ``{`` is text.
* A directory is walked depth first, each directory's entries in name order, hidden
  entries (``.name``) skipped. JSONL and text files are read as above; other files
  (images, editor leftovers) are skipped: a path given on the command line is a
  prompt by the user's say-so, a file that happens to sit in a directory is not.

A JSONL line is an object with exactly one of ``"prompt"`` (a string), ``"messages"``
(``[{"role": str, "content": str | [parts] | null, ...}, ...]``, rendered later with
the tokenizer's chat template) or ``"tokens"`` (token ids, integers >= 0), and an
optional ``"id"`` (a string or an integer, kept as a string); other keys are ignored,
blank lines skipped. A text prompt is the file's exact text (UTF-8, a BOM dropped,
a final newline kept): its tokens are the file's.

Memory and time stay bounded whatever the input: JSONL is read a line at a time, and
neither a line nor a text prompt may exceed ``max_prompt_bytes`` (16 MiB by default,
far beyond any context window), so a 10 GB file is never held whole. An over-long
JSONL line is skipped to its end, but at most :data:`SKIP_FACTOR` times the limit: a
stream with no line end in sight (``/dev/zero``, a binary file, an endless pipe) is
then not read any further, with an error saying so, instead of being read for ever.

Bad input never stops the reading: invalid JSON, a missing or wrong-typed field, an
empty prompt, an over-long line, an unreadable file or directory each yield a
:class:`PromptError` in place, in order with the good prompts, and reading goes on.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from lmtier.chunks.tokens import MAX_TOKEN_ID
from lmtier.errors import InvalidRequestError, brief

__all__ = [
    "JSONL_SUFFIXES",
    "MAX_PROMPT_BYTES",
    "SKIP_FACTOR",
    "STDIN",
    "TEXT_SUFFIXES",
    "Prompt",
    "PromptError",
    "check_length",
    "one_line",
    "prompt_key",
    "read_prompts",
    "tokenize",
]

STDIN = "-"
"""The path that means standard input."""
JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson", ".json"})
TEXT_SUFFIXES = frozenset({".txt", ".text", ".md", ".markdown", ".rst", ".prompt"})
MAX_PROMPT_BYTES = 16 * 2**20
"""Default cap on one JSONL line or one text prompt, in bytes."""
SKIP_FACTOR = 16
"""An over-long line is skipped (read and dropped) for at most this many times the
line limit (256 MiB by default): past that, the source has no line ends to find."""

_BOM = b"\xef\xbb\xbf"
_SKIP_BLOCK = 1 << 20  # how much of an over-long line is read (and dropped) at a time
_FIELDS = ("prompt", "messages", "tokens")

PromptKind = Literal["text", "messages", "tokens"]
_Kind = Literal["jsonl", "text", "sniff"]


@dataclass(frozen=True, slots=True)
class Prompt:
    """One warm-up prompt: exactly one of ``text``, ``messages`` or ``tokens`` is set.

    ``source`` says where it came from (``"prompts.jsonl:12"``, ``"docs/a.md"``), for
    messages and progress; ``id`` is the input's own ``"id"``, if it had one.
    """

    source: str
    id: str | None = None
    text: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    tokens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        given = sum(value is not None for value in (self.text, self.messages, self.tokens))
        if given != 1:
            raise InvalidRequestError(
                f"{self.source}: a Prompt needs exactly one of text, messages or tokens"
            )

    @property
    def kind(self) -> PromptKind:
        """Which of the three forms this prompt has."""
        if self.text is not None:
            return "text"
        return "messages" if self.messages is not None else "tokens"

    @property
    def needs_tokenizer(self) -> bool:
        """True unless the prompt is already token ids (:func:`tokenize` needs one)."""
        return self.tokens is None


@dataclass(frozen=True, slots=True)
class PromptError:
    """A prompt that cannot be used: a record yielded in place of it, not an exception,
    so that the caller prints ``str(error)`` (``prompts.jsonl:7: invalid JSON (...)``)
    and goes on with the next prompt."""

    source: str
    message: str

    def __str__(self) -> str:
        return f"{self.source}: {self.message}"


def read_prompts(
    paths: Iterable[str | os.PathLike[str]],
    *,
    stdin: IO[bytes] | IO[str] | None = None,
    max_prompt_bytes: int = MAX_PROMPT_BYTES,
) -> Iterator[Prompt | PromptError]:
    """Yield the prompts of every path in turn (``-``: ``stdin``, by default the
    process's standard input), with a :class:`PromptError` wherever one is bad.

    A generator: nothing is opened before the first item is asked for, and only the
    current line (or text prompt) is held in memory.
    """
    for path in paths:
        if os.fspath(path) == STDIN:
            stream = stdin if stdin is not None else sys.stdin.buffer
            yield from _read_stream(stream, "<stdin>", "sniff", max_prompt_bytes)
        elif Path(path).is_dir():
            for found in _walk(Path(path)):
                if isinstance(found, PromptError):
                    yield found
                elif (kind := _kind_by_name(found)) is not None:
                    yield from _read_file(found, kind, max_prompt_bytes)
        else:
            yield from _read_file(
                Path(path), _kind_by_name(Path(path)) or "sniff", max_prompt_bytes
            )


def tokenize(prompt: Prompt, tokenizer: Any | None) -> list[int]:
    """Return ``prompt``'s token ids: as given, ``tokenizer(text, add_special_tokens=True)``,
    or the chat template applied with ``add_generation_prompt=True`` (the ids a
    server computes for the same conversation before it answers).

    ``tokenizer`` is a transformers tokenizer (4.x or 5.x; 5.x's ``apply_chat_template``
    returns a BatchEncoding, 4.x a list: both are accepted), or None where only token
    prompts are expected. Raises InvalidRequestError, its message starting with the
    prompt's source, when there is no tokenizer for a text or messages prompt, when the
    template or tokenizer rejects the prompt, or when it gives no tokens.
    """
    if prompt.tokens is not None:
        return list(prompt.tokens)
    if tokenizer is None:
        raise InvalidRequestError(
            f"{prompt.source}: a {prompt.kind} prompt needs a tokenizer to become token ids: "
            "load the model's tokenizer, or send the prompts to an engine as they are (--via)"
        )
    try:
        if prompt.text is not None:
            encoded = tokenizer(prompt.text, add_special_tokens=True)
        else:
            messages = [dict(message) for message in prompt.messages or ()]
            encoded = tokenizer.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=True
            )
    # A chat template is user-supplied Jinja: whatever it raises (TemplateError from
    # raise_exception, TypeError, ValueError for a tokenizer without a template) is
    # this prompt's problem, reported like any other bad prompt.
    except Exception as exc:
        raise InvalidRequestError(
            f"{prompt.source}: cannot tokenize the {prompt.kind}: {one_line(exc)}"
        ) from exc
    ids = _token_ids(encoded, prompt.source)
    if not ids:
        raise InvalidRequestError(f"{prompt.source}: the {prompt.kind} gives no tokens")
    return ids


def check_length(tokens: Sequence[int], max_len: int, source: str) -> PromptError | None:
    """A PromptError when ``tokens`` do not fit a model context of ``max_len`` tokens
    (a longer prompt could not be prefilled in one piece), else None."""
    if len(tokens) > max_len:
        return PromptError(
            source, f"{len(tokens)} tokens, longer than the model's context of {max_len}"
        )
    return None


def prompt_key(prompt: Prompt) -> str:
    """A stable fingerprint of what ``prompt`` asks for (32 hex digits), for resume
    bookkeeping: equal across processes and machines for equal content.

    Only the content counts, not ``source`` or ``id``: a prompt that moved to another
    line of an edited file is still the one already warmed. Messages are canonical
    JSON (sorted keys), so key order in the input does not matter. It does not cover
    the tokenizer or model: keep one record of done keys per model.
    """
    if prompt.text is not None:
        body = prompt.text
    elif prompt.messages is not None:
        body = json.dumps(
            list(prompt.messages), sort_keys=True, ensure_ascii=False, separators=(",", ":")
        )
    else:
        body = ",".join(map(str, prompt.tokens or ()))
    data = f"{prompt.kind}\n{body}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _walk(directory: Path) -> Iterator[Path | PromptError]:
    try:
        with os.scandir(directory) as scan:
            entries = sorted(scan, key=lambda entry: entry.name)
    except OSError as exc:
        yield PromptError(str(directory), _os_problem(exc))
        return
    for entry in entries:
        if entry.name.startswith("."):
            continue
        # A symlinked directory is not followed (a link loop would never end); a
        # symlinked file is read.
        if entry.is_dir(follow_symlinks=False):
            yield from _walk(Path(entry.path))
        elif entry.is_file():
            yield Path(entry.path)


def _kind_by_name(path: Path) -> _Kind | None:
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    return "text" if suffix in TEXT_SUFFIXES else None


def _read_file(path: Path, kind: _Kind, limit: int) -> Iterator[Prompt | PromptError]:
    try:
        stream = path.open("rb")
    except OSError as exc:
        yield PromptError(str(path), _os_problem(exc))
        return
    with stream:
        try:
            yield from _read_stream(stream, str(path), kind, limit)
        except OSError as exc:  # a read that fails part way (EIO, a vanished mount)
            yield PromptError(str(path), _os_problem(exc))


def _read_stream(
    stream: IO[bytes] | IO[str], name: str, kind: _Kind, limit: int
) -> Iterator[Prompt | PromptError]:
    lines = _lines(stream, limit)
    head: list[bytes | None] = []  # lines read to decide the kind, read again below
    if kind == "sniff":
        held = 0  # blank lines before the first word: bounded like a text prompt
        for line in lines:
            head.append(line)
            held += len(line or b"")
            if line is None or held > limit or line.removeprefix(_BOM).strip():
                break
        first = head[-1] if head else b""
        starts_json = first is not None and first.removeprefix(_BOM).lstrip()[:1] == b"{"
        kind = "jsonl" if starts_json else "text"
    if kind == "jsonl":
        number = 0
        try:
            for number, line in enumerate(itertools.chain(head, lines), start=1):
                item = _jsonl_item(line, f"{name}:{number}", limit)
                if item is not None:
                    yield item
        except _Endless:
            budget = SKIP_FACTOR * limit
            yield PromptError(
                f"{name}:{number}", f"no line end within {budget} bytes: the rest is not read"
            )
        return
    if None in head or sum(len(line or b"") for line in head) > limit:
        yield PromptError(name, f"a text prompt larger than {limit} bytes")
        return
    data = b"".join(line for line in head if line is not None)
    yield _text_prompt(name, data + _as_bytes(stream.read(max(0, limit + 1 - len(data)))), limit)


class _Endless(Exception):
    """An over-long line went on past its skip budget (:data:`SKIP_FACTOR`)."""


def _lines(stream: IO[bytes] | IO[str], limit: int) -> Iterator[bytes | None]:
    """The stream's lines as bytes; None for a line over ``limit``, dropped.

    The rest of a dropped line is read (to skip it) only when the next line is asked
    for: a caller that stops at the None (a text prompt found too large) reads no
    more. Skipping stops with :class:`_Endless` after ``SKIP_FACTOR * limit`` bytes."""
    while line := _as_bytes(stream.readline(limit + 1)):
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        yield None
        skipped = len(line)
        while line and not line.endswith(b"\n"):
            if skipped > SKIP_FACTOR * limit:
                raise _Endless
            line = _as_bytes(stream.readline(_SKIP_BLOCK))
            skipped += len(line)


def _as_bytes(data: bytes | str) -> bytes:
    # A text stream (sys.stdin, io.StringIO) is read as UTF-8 bytes; surrogateescape
    # gives back the bytes Python could not decode, so the check below reports them.
    return data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data


def _text_prompt(name: str, data: bytes, limit: int) -> Prompt | PromptError:
    if len(data) > limit:
        return PromptError(name, f"a text prompt larger than {limit} bytes")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        return PromptError(name, f"not UTF-8 text (byte {exc.start})")
    return Prompt(source=name, text=text) if text.strip() else PromptError(name, "empty prompt")


class _Bad(Exception):
    """One line's problem; becomes a PromptError in :func:`_jsonl_item`, which knows where."""


def _jsonl_item(line: bytes | None, source: str, limit: int) -> Prompt | PromptError | None:
    if line is not None and not line.removeprefix(_BOM).strip():
        return None
    try:
        if line is None:
            raise _Bad(f"line longer than {limit} bytes")
        return _prompt_of(_json_object(line), source)
    except _Bad as bad:
        return PromptError(source, str(bad))


def _json_object(line: bytes) -> dict[str, Any]:
    try:
        # Without the line end, an error at the end of the line is in its columns, not
        # at column 1 of a "line 2"; bytes, so that a BOM on the first line is accepted.
        value = json.loads(line.rstrip(b"\r\n"))
    except json.JSONDecodeError as exc:
        raise _Bad(f"invalid JSON ({exc.msg}: column {exc.colno})") from None
    except UnicodeDecodeError as exc:
        raise _Bad(f"not UTF-8 (byte {exc.start})") from None
    except RecursionError:
        raise _Bad("invalid JSON (nested too deeply)") from None
    if not isinstance(value, dict):
        raise _Bad(f"expected a JSON object, got {_json_type(value)}")
    return value


def _prompt_of(value: dict[str, Any], source: str) -> Prompt:
    fields = [field for field in _FIELDS if field in value]
    if len(fields) != 1:
        found = " and ".join(f'"{field}"' for field in fields) or "none"
        raise _Bad(f'needs one of "prompt", "messages" or "tokens" (found {found})')
    ident = value.get("id")
    if ident is not None and (isinstance(ident, bool) or not isinstance(ident, (str, int))):
        raise _Bad(f'"id" must be a string or an integer, not {_json_type(ident)}')
    ident = None if ident is None else str(ident)
    content = value[fields[0]]
    if fields[0] == "prompt":
        if not isinstance(content, str):
            raise _Bad(f'"prompt" must be a string, not {_json_type(content)}')
        if not content.strip():
            raise _Bad("empty prompt")
        return Prompt(source=source, id=ident, text=content)
    if fields[0] == "messages":
        return Prompt(source=source, id=ident, messages=tuple(_checked_messages(content)))
    return Prompt(source=source, id=ident, tokens=tuple(_checked_tokens(content)))


def _checked_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise _Bad(f'"messages" must be an array, not {_json_type(messages)}')
    if not messages:
        raise _Bad("empty prompt (no messages)")
    for index, message in enumerate(messages):
        where = f'"messages"[{index}]'
        if not isinstance(message, dict):
            raise _Bad(f"{where} must be an object, not {_json_type(message)}")
        if not isinstance(message.get("role"), str):
            raise _Bad(f'{where} needs a string "role", not {_json_type(message.get("role"))}')
        if "content" not in message:
            raise _Bad(f'{where} has no "content"')
        if not isinstance(message["content"], (str, list, type(None))):
            kind = _json_type(message["content"])
            raise _Bad(
                f'{where}: "content" must be a string, an array of parts or null, not {kind}'
            )
    return messages


def _checked_tokens(tokens: Any) -> list[int]:
    if not isinstance(tokens, list):
        raise _Bad(f'"tokens" must be an array of integers, not {_json_type(tokens)}')
    if not tokens:
        raise _Bad("empty prompt (no tokens)")
    for index, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_TOKEN_ID:
            raise _Bad(f'"tokens"[{index}] is {brief(token)}, not a token id (an integer >= 0)')
    return tokens


def _token_ids(encoded: Any, source: str) -> list[int]:
    if hasattr(encoded, "keys") and "input_ids" in encoded:  # BatchEncoding, dict
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):  # a tensor or array, if a caller's tokenizer made one
        encoded = encoded.tolist()
    if isinstance(encoded, list) and len(encoded) == 1 and isinstance(encoded[0], list):
        encoded = encoded[0]  # a batch of one
    if not isinstance(encoded, list) or not all(
        isinstance(token, int) and not isinstance(token, bool) for token in encoded
    ):
        raise InvalidRequestError(
            f"{source}: the tokenizer returned {brief(encoded)}, not a list of token ids"
        )
    return encoded


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return _JSON_TYPES.get(type(value), "a number")  # what json.loads makes: int or float


def _os_problem(exc: OSError) -> str:
    return f"cannot read ({exc.strerror or exc})"


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line, at most 200 characters (its type if it has none)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."
