"""lmtier_apps.warm.inputs: every input kind, bad input as PromptError records in
order with the good prompts, laziness, tokenizing (a real transformers tokenizer built
here, with a chat template), and the resume fingerprint."""

from __future__ import annotations

import inspect
import io
import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest

from lmtier.errors import InvalidRequestError
from lmtier_apps.warm.inputs import (
    SKIP_FACTOR,
    Prompt,
    PromptError,
    _read_stream,
    check_length,
    prompt_key,
    read_prompts,
    tokenize,
)


def _jsonl(path: Path, *lines: Any) -> Path:
    path.write_text(
        "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines),
        encoding="utf-8",
    )
    return path


def _read(*paths: Any, **kwargs: Any) -> list[Prompt | PromptError]:
    return list(read_prompts([str(path) for path in paths], **kwargs))


def _errors(items: list[Prompt | PromptError]) -> list[str]:
    return [str(item) for item in items if isinstance(item, PromptError)]


# --- JSONL -------------------------------------------------------------------------


def test_jsonl_gives_each_kind_with_source_and_id(tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    path = _jsonl(
        tmp_path / "prompts.jsonl",
        {"prompt": "hello world", "id": "a"},
        "",
        "   ",
        {"messages": messages, "id": 7, "extra": "ignored"},
        {"tokens": [1, 2, 3]},
    )
    items = _read(path)
    assert items == [
        Prompt(source=f"{path}:1", id="a", text="hello world"),
        Prompt(source=f"{path}:4", id="7", messages=tuple(messages)),
        Prompt(source=f"{path}:5", tokens=(1, 2, 3)),
    ]
    assert [item.kind for item in items if isinstance(item, Prompt)] == [
        "text",
        "messages",
        "tokens",
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "a" "b"}', "invalid JSON (Expecting ',' delimiter: column 16)"),
        ('{"prompt": ', "invalid JSON (Expecting value: column 12)"),
        ('["prompt"]', "expected a JSON object, got an array"),
        ('{"id": "x"}', 'needs one of "prompt", "messages" or "tokens" (found none)'),
        (
            '{"prompt": "a", "tokens": [1]}',
            'needs one of "prompt", "messages" or "tokens" (found "prompt" and "tokens")',
        ),
        ('{"prompt": 3}', '"prompt" must be a string, not a number'),
        ('{"prompt": "  \\n"}', "empty prompt"),
        ('{"prompt": "a", "id": [1]}', '"id" must be a string or an integer, not an array'),
        ('{"prompt": "a", "id": true}', '"id" must be a string or an integer, not a boolean'),
        ('{"tokens": "1 2"}', '"tokens" must be an array of integers, not a string'),
        ('{"tokens": []}', "empty prompt (no tokens)"),
        ('{"tokens": [1, 2.5]}', '"tokens"[1] is 2.5, not a token id (an integer >= 0)'),
        ('{"tokens": [1, -4]}', '"tokens"[1] is -4, not a token id (an integer >= 0)'),
        ('{"tokens": [true]}', '"tokens"[0] is True, not a token id (an integer >= 0)'),
        ('{"tokens": [1, "2"]}', "\"tokens\"[1] is '2', not a token id (an integer >= 0)"),
        ('{"messages": {"role": "user"}}', '"messages" must be an array, not an object'),
        ('{"messages": []}', "empty prompt (no messages)"),
        ('{"messages": ["hi"]}', '"messages"[0] must be an object, not a string'),
        ('{"messages": [{"content": "hi"}]}', '"messages"[0] needs a string "role", not null'),
        ('{"messages": [{"role": "user"}]}', '"messages"[0] has no "content"'),
        (
            '{"messages": [{"role": "user", "content": 1}]}',
            '"messages"[0]: "content" must be a string, an array of parts or null, not a number',
        ),
    ],
)
def test_bad_line_is_an_error_naming_its_line_and_reading_goes_on(
    tmp_path: Path, line: str, message: str
) -> None:
    path = _jsonl(tmp_path / "p.jsonl", {"prompt": "first"}, line, {"prompt": "last"})
    items = _read(path)
    assert items == [
        Prompt(source=f"{path}:1", text="first"),
        PromptError(f"{path}:2", message),
        Prompt(source=f"{path}:3", text="last"),
    ]
    assert str(items[1]) == f"{path}:2: {message}"


def test_message_content_may_be_parts_or_null(tmp_path: Path) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    (item,) = _read(_jsonl(tmp_path / "p.jsonl", {"messages": messages}))
    assert isinstance(item, Prompt) and item.messages == tuple(messages)


def test_jsonl_with_a_bom_and_crlf_and_non_utf8_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n{"prompt": "\xff"}\r\n{"tokens": [5]}')
    items = _read(path)
    assert items[0] == Prompt(source=f"{path}:1", text="a")
    assert isinstance(items[1], PromptError) and items[1].source == f"{path}:2"
    assert "UTF-8" in items[1].message
    assert items[2] == Prompt(source=f"{path}:3", tokens=(5,))


def test_a_line_over_the_limit_is_an_error_and_the_next_line_is_read(tmp_path: Path) -> None:
    long = json.dumps({"prompt": "x" * 5000})
    path = _jsonl(tmp_path / "p.jsonl", long, {"prompt": "after"})
    items = _read(path, max_prompt_bytes=1000)
    assert items == [
        PromptError(f"{path}:1", "line longer than 1000 bytes"),
        Prompt(source=f"{path}:2", text="after"),
    ]


class _NoLineEnds(io.RawIOBase):
    """``/dev/zero`` or an endless pipe: ``fill`` bytes (no line end) for ever. It fails
    the test (rather than hang it) once far more was read than a bounded reader reads."""

    def __init__(self, give_up_after: int, fill: bytes = b"\0") -> None:
        self.served, self.give_up_after, self.fill = 0, give_up_after, fill

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.served > self.give_up_after:
            raise AssertionError(f"read {self.served} bytes of a stream with no line end")
        view = memoryview(buffer)
        view[:] = self.fill * len(view)
        self.served += len(view)
        return len(view)


def test_a_stream_without_line_ends_is_read_a_bounded_amount() -> None:
    limit = 1000
    stream = _NoLineEnds(give_up_after=100 * SKIP_FACTOR * limit)
    with io.BufferedReader(stream) as buffered:
        items = list(read_prompts(["-"], stdin=buffered, max_prompt_bytes=limit))
    assert items == [PromptError("<stdin>", f"a text prompt larger than {limit} bytes")]
    assert stream.served < 2 * limit + 2**16, "a text prompt too large: no more is read"

    stream = _NoLineEnds(give_up_after=100 * SKIP_FACTOR * limit)
    with io.BufferedReader(stream) as buffered:
        items = list(_read_stream(buffered, "zero.jsonl", "jsonl", limit))
    assert items == [
        PromptError("zero.jsonl:1", f"line longer than {limit} bytes"),
        PromptError(
            "zero.jsonl:1", f"no line end within {SKIP_FACTOR * limit} bytes: the rest is not read"
        ),
    ]


def test_endless_blank_lines_are_bounded_too() -> None:
    stream = _NoLineEnds(give_up_after=10**6, fill=b"\n")  # `yes ''`
    with io.BufferedReader(stream) as buffered:
        items = list(read_prompts(["-"], stdin=buffered, max_prompt_bytes=1000))
    assert items == [PromptError("<stdin>", "a text prompt larger than 1000 bytes")]


# --- text files, sniffing, directories ----------------------------------------------


def test_text_file_is_one_prompt_with_its_exact_text(tmp_path: Path) -> None:
    path = tmp_path / "system.txt"
    path.write_bytes(b"\xef\xbb\xbfYou are helpful.\n\n{not json}\n")
    assert _read(path) == [Prompt(source=str(path), text="You are helpful.\n\n{not json}\n")]


def test_text_file_problems(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n\n")
    binary = tmp_path / "bad.md"
    binary.write_bytes(b"ok\xff\xfe")
    big = tmp_path / "big.txt"
    big.write_text("y" * 2000)
    assert _errors(_read(empty, binary, big, max_prompt_bytes=1000)) == [
        f"{empty}: empty prompt",
        f"{binary}: not UTF-8 text (byte 2)",
        f"{big}: a text prompt larger than 1000 bytes",
    ]


def test_other_suffixes_are_sniffed_by_their_first_non_blank_line(tmp_path: Path) -> None:
    jsonl = tmp_path / "prompts.data"
    jsonl.write_text('\n  {"prompt": "a"}\n{"prompt": "b"}\n')
    text = tmp_path / "PROMPT"
    text.write_text("\nplain words\n")
    assert _read(jsonl, text) == [
        Prompt(source=f"{jsonl}:2", text="a"),
        Prompt(source=f"{jsonl}:3", text="b"),
        Prompt(source=str(text), text="\nplain words\n"),
    ]


def test_directory_is_walked_recursively_in_name_order(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    (root / "b" / "deep").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "a.txt").write_text("A")
    (root / "b" / "deep" / "c.md").write_text("C")
    _jsonl(root / "b" / "batch.jsonl", {"prompt": "B1"}, "oops", {"tokens": [9]})
    (root / "c.TXT").write_text("upper-case suffix")
    (root / "image.png").write_bytes(b"\x89PNG")
    (root / ".hidden.txt").write_text("skipped")
    (root / ".git" / "HEAD.txt").write_text("skipped")
    items = _read(root)
    assert [str(item) if isinstance(item, PromptError) else item.source for item in items] == [
        str(root / "a.txt"),
        f"{root / 'b' / 'batch.jsonl'}:1",
        f"{root / 'b' / 'batch.jsonl'}:2: invalid JSON (Expecting value: column 1)",
        f"{root / 'b' / 'batch.jsonl'}:3",
        str(root / "b" / "deep" / "c.md"),
        str(root / "c.TXT"),
    ]


def test_missing_and_unreadable_paths_are_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "nope.jsonl"
    dangling = tmp_path / "dangling.txt"
    dangling.symlink_to(tmp_path / "gone")
    locked = tmp_path / "dir" / "locked"
    locked.mkdir(parents=True)
    (tmp_path / "dir" / "ok.txt").write_text("fine")
    real_scandir = os.scandir

    def scandir(path: Any) -> Any:  # root reads a chmod 000 directory: fail it by hand
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    items = _read(missing, dangling, tmp_path / "dir")
    assert _errors(items) == [
        f"{missing}: cannot read (No such file or directory)",
        f"{dangling}: cannot read (No such file or directory)",
        f"{locked}: cannot read (Permission denied)",
    ]
    assert items[-1] == Prompt(source=str(tmp_path / "dir" / "ok.txt"), text="fine")


def test_unreadable_file_is_an_error(tmp_path: Path) -> None:
    locked = tmp_path / "locked.txt"
    locked.write_text("secret")
    locked.chmod(0)
    try:
        if os.access(locked, os.R_OK):
            pytest.skip("running as root: file permissions are not enforced")
        assert _errors(_read(locked)) == [f"{locked}: cannot read (Permission denied)"]
    finally:
        locked.chmod(0o600)


def test_a_read_that_fails_part_way_is_an_error_after_what_was_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _jsonl(tmp_path / "p.jsonl", {"prompt": "a"}, {"prompt": "b"})
    calls = 0
    real_readline = io.BufferedReader.readline

    class Failing(io.BufferedReader):
        def readline(self, size: int | None = -1) -> bytes:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise OSError(5, "Input/output error")
            return real_readline(self, size)

    real_open = Path.open
    monkeypatch.setattr(
        Path, "open", lambda self, *a, **k: Failing(real_open(self, "rb", buffering=0))
    )
    assert _read(path) == [
        Prompt(source=f"{path}:1", text="a"),
        PromptError(str(path), "cannot read (Input/output error)"),
    ]


# --- stdin ---------------------------------------------------------------------------


def test_stdin_jsonl_when_its_first_non_blank_line_is_an_object() -> None:
    stream = io.BytesIO(b'\n{"prompt": "a"}\nnot json\n{"tokens": [1]}\n')
    assert _read("-", stdin=stream) == [
        Prompt(source="<stdin>:2", text="a"),
        PromptError("<stdin>:3", "invalid JSON (Expecting value: column 1)"),
        Prompt(source="<stdin>:4", tokens=(1,)),
    ]


def test_stdin_otherwise_is_one_text_prompt_text_streams_too() -> None:
    text = '\n\nSummarise:\n{"a": 1}\n'
    assert _read("-", stdin=io.StringIO(text)) == [Prompt(source="<stdin>", text=text)]
    assert _read("-", stdin=io.BytesIO(b"")) == [PromptError("<stdin>", "empty prompt")]


def test_stdin_mixed_with_files_in_order(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_text("file")
    items = _read(path, "-", stdin=io.StringIO('{"prompt": "piped"}'))
    assert [item.source for item in items] == [str(path), "<stdin>:1"]


# --- laziness --------------------------------------------------------------------------


class _EndlessJSONL(io.RawIOBase):
    """A stream that never ends: reading all of it would never return."""

    def __init__(self) -> None:
        self.lines_read = 0

    def readable(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> bytes:
        self.lines_read += 1
        return json.dumps({"prompt": f"p{self.lines_read}"}).encode() + b"\n"


def test_reading_is_lazy_a_line_at_a_time(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "big.jsonl", *({"tokens": [i]} for i in range(100_000)))
    items = read_prompts([path])
    assert inspect.isgenerator(items)
    assert next(items) == Prompt(source=f"{path}:1", tokens=(0,))

    stream = _EndlessJSONL()
    first = list(itertools.islice(read_prompts(["-"], stdin=stream), 3))
    assert [item.text for item in first if isinstance(item, Prompt)] == ["p1", "p2", "p3"]
    assert stream.lines_read == 3


def test_nothing_is_opened_before_the_first_item(tmp_path: Path) -> None:
    items = read_prompts([tmp_path / "created-later.txt"])
    (tmp_path / "created-later.txt").write_text("now")
    assert list(items) == [Prompt(source=str(tmp_path / "created-later.txt"), text="now")]


# --- Prompt, check_length, prompt_key ------------------------------------------------


def test_prompt_needs_exactly_one_form() -> None:
    with pytest.raises(InvalidRequestError, match="exactly one of text, messages or tokens"):
        Prompt(source="x")
    with pytest.raises(InvalidRequestError, match="exactly one"):
        Prompt(source="x", text="a", tokens=(1,))
    assert Prompt(source="x", tokens=(1,)).needs_tokenizer is False
    assert Prompt(source="x", text="a").needs_tokenizer is True


def test_check_length() -> None:
    assert check_length([1] * 8, 8, "p.jsonl:3") is None
    assert check_length([1] * 9, 8, "p.jsonl:3") == PromptError(
        "p.jsonl:3", "9 tokens, longer than the model's context of 8"
    )


def test_prompt_key_is_stable_and_depends_on_content_only() -> None:
    text = Prompt(source="a:1", id="x", text="hello")
    # A fixed value: the key is stored by interrupted runs and must not drift.
    assert prompt_key(text) == "5d950b3563db14fd186b809496dfd162"
    assert prompt_key(Prompt(source="b:9", text="hello")) == prompt_key(text)
    assert prompt_key(Prompt(source="a:1", text="hello ")) != prompt_key(text)
    one = Prompt(source="s", messages=({"role": "user", "content": "hi"},))
    reordered = Prompt(source="t", messages=({"content": "hi", "role": "user"},))
    assert prompt_key(one) == prompt_key(reordered)
    assert prompt_key(Prompt(source="s", text="1,2")) != prompt_key(
        Prompt(source="s", tokens=(1, 2))
    )
    assert len({prompt_key(Prompt(source="s", tokens=(i,))) for i in range(100)}) == 100


# --- tokenize ----------------------------------------------------------------------------

_WORDS = ["hi", "there", "hello", "world", "user", "assistant", "system", ":", "be", "brief"]
_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """A real transformers tokenizer (WordLevel over a dozen words), no download."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2} | {word: i + 3 for i, word in enumerate(_WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = _TEMPLATE
    return fast


def _ids(text: str) -> list[int]:
    return [_WORDS.index(word) + 3 for word in text.split()]


def test_tokenize_each_kind(tokenizer: Any) -> None:
    assert tokenize(Prompt(source="s", tokens=(7, 8)), None) == [7, 8]
    assert tokenize(Prompt(source="s", text="hello world"), tokenizer) == [1, *_ids("hello world")]
    messages = ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"})
    # The chat template's own text, no BOS added, the generation prompt at the end.
    expected = _ids("system : be brief user : hi assistant :")
    assert tokenize(Prompt(source="s", messages=messages), tokenizer) == expected


def test_tokenize_accepts_a_list_from_apply_chat_template() -> None:
    class Old:  # transformers 4.x returned the ids themselves
        def apply_chat_template(self, messages: Any, **kwargs: Any) -> list[int]:
            assert kwargs == {"tokenize": True, "add_generation_prompt": True}
            return [4, 5]

    prompt = Prompt(source="s", messages=({"role": "user", "content": "x"},))
    assert tokenize(prompt, Old()) == [4, 5]


def test_tokenize_without_tokenizer_says_what_to_do() -> None:
    prompt = Prompt(source="p.jsonl:4", messages=({"role": "user", "content": "x"},))
    with pytest.raises(InvalidRequestError, match=r"^p.jsonl:4: a messages prompt needs a tok"):
        tokenize(prompt, None)


def test_tokenize_errors_name_the_prompt(tokenizer: Any) -> None:
    messages = ({"role": "user", "content": "hi"},)
    saved = tokenizer.chat_template
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    try:
        with pytest.raises(InvalidRequestError, match=r"^a:2: cannot tok.*roles must alternate"):
            tokenize(Prompt(source="a:2", messages=messages), tokenizer)
        tokenizer.chat_template = None
        with pytest.raises(InvalidRequestError, match=r"^a:3: cannot tokenize the messages"):
            tokenize(Prompt(source="a:3", messages=messages), tokenizer)
    finally:
        tokenizer.chat_template = saved

    class Empty:
        def __call__(self, text: str, **kwargs: Any) -> dict[str, list[int]]:
            return {"input_ids": []}

    with pytest.raises(InvalidRequestError, match=r"^a:4: the text gives no tokens"):
        tokenize(Prompt(source="a:4", text="x"), Empty())
