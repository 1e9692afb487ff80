"""The demo engine's text handling (``lmtier demo serve``): the same token ids as the
demo tokenizer gives ``lmtier warm``, every generated id visible in the text, and a
stream's pieces adding up to the whole reply."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from lmtier_apps.demo.demo_tokenizer import demo_tokenizer
from lmtier_apps.engine.engine import StreamDecoder, load_codec

TEXT = "héllo wörld ✓"


def test_text_and_chat_give_the_ids_lmtier_warm_computes() -> None:
    codec = load_codec(None, None)
    tokenizer = demo_tokenizer()
    assert codec.encode(TEXT) == list(tokenizer(TEXT, add_special_tokens=True).input_ids)
    messages = [("system", "be brief"), ("user", TEXT)]
    expected = tokenizer.apply_chat_template(
        [{"role": role, "content": text} for role, text in messages],
        tokenize=True,
        add_generation_prompt=True,
    )["input_ids"]
    assert codec.chat_prompt(messages) == list(expected)


def test_ids_the_tokenizer_does_not_know_stay_visible() -> None:
    codec = load_codec(None, None)
    ids = codec.encode("ab")[1:]  # without <s>
    assert codec.decode([*ids, 5000, *ids]) == "ab<|5000|>ab"
    assert codec.decode([31999]) == "<|31999|>"


def test_stream_pieces_add_up_to_the_reply_and_wait_for_whole_characters() -> None:
    codec = load_codec(None, None)
    ids = [*codec.encode(TEXT)[1:], 5000, *codec.encode("ü")[1:]]
    decoder = StreamDecoder(codec)
    pieces = [decoder.push(token) for token in ids]
    pieces.append(decoder.flush())
    assert "".join(pieces) == codec.decode(ids)
    assert pieces[:3] == ["h", "", "é"]  # "é" is two byte tokens: nothing after the first


def test_a_cut_character_is_flushed_at_the_end() -> None:
    codec = load_codec(None, None)
    decoder = StreamDecoder(codec)
    assert decoder.push(codec.encode("é")[1]) == ""
    assert decoder.flush() == "\ufffd"
