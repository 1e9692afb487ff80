"""Chunk keys: prefix, locality and namespace properties, incremental use, determinism."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from lmtier.chunks.hashers import chunk_keys, make_hasher
from lmtier.chunks.keys import ExtraKeys, MultimodalSpan, Namespace
from lmtier.errors import ConfigError, InvalidTokensError

CHUNK = 16
NS = Namespace(model_id="tiny-llama", chunk_size=CHUNK)

token_lists = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=6 * CHUNK)
wide_token_lists = st.lists(st.integers(min_value=0, max_value=2**63 - 1), max_size=4 * CHUNK)


@given(tokens=token_lists, cut=st.integers(min_value=0, max_value=6 * CHUNK))
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(tokens: list[int], cut: int) -> None:
    full = chunk_keys(tokens, NS)
    prefix = chunk_keys(tokens[:cut], NS)
    assert full[: len(prefix)] == prefix
    assert len(full) == len(tokens) // CHUNK
    assert len(prefix) == min(cut, len(tokens)) // CHUNK


@given(tokens=st.one_of(token_lists, wide_token_lists), data=st.data())
def test_changing_token_j_changes_exactly_the_keys_from_its_chunk_on(
    tokens: list[int], data: st.DataObject
) -> None:
    if not tokens:
        return
    j = data.draw(st.integers(min_value=0, max_value=len(tokens) - 1))
    replacement = data.draw(
        st.integers(min_value=0, max_value=2**63 - 1).filter(lambda v: v != tokens[j])
    )
    changed = [*tokens[:j], replacement, *tokens[j + 1 :]]
    before, after = chunk_keys(tokens, NS), chunk_keys(changed, NS)
    first_changed = j // CHUNK
    assert before[:first_changed] == after[:first_changed]
    assert all(b != a for b, a in zip(before[first_changed:], after[first_changed:], strict=True))


NAMESPACE_CHANGES = {
    "model_id": "other-model",
    "model_revision": "sha-1234",
    "kv_dtype": "bfloat16",
    "kv_layout": "KLTHD",
    "chunk_size": CHUNK,  # replaced below by a different size with the same full chunks
    "tp_size": 2,
    "tp_rank": 1,
    "format_version": 99,
    "cache_salt": "tenant-b",
}


@pytest.mark.parametrize("field", sorted(NAMESPACE_CHANGES))
@settings(max_examples=25)
@given(tokens=st.lists(st.integers(0, 50_000), min_size=4 * CHUNK, max_size=4 * CHUNK))
def test_changing_any_namespace_field_changes_every_key(field: str, tokens: list[int]) -> None:
    if field == "chunk_size":
        # Same tokens at half the chunk size: no key of one may equal a key of the other.
        other = dataclasses.replace(NS, chunk_size=CHUNK // 2)
    elif field == "tp_rank":
        other = dataclasses.replace(NS, tp_size=2, tp_rank=1)
    else:
        other = dataclasses.replace(NS, **{field: NAMESPACE_CHANGES[field]})
    assert other.digest != NS.digest
    base = set(chunk_keys(tokens, NS))
    assert base.isdisjoint(chunk_keys(tokens, other))


@given(tokens=st.one_of(token_lists, wide_token_lists), data=st.data())
def test_incremental_equals_one_shot(tokens: list[int], data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(tokens)), max_size=6)))
    hasher = make_hasher(NS)
    emitted = []
    previous = 0
    for cut in [*cuts, len(tokens)]:
        emitted.extend(hasher.extend(tokens[previous:cut]))
        previous = cut
    assert emitted == chunk_keys(tokens, NS)
    assert list(hasher.keys) == emitted
    assert hasher.num_tokens == len(tokens)


def test_decode_one_token_at_a_time() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32_000, size=5 * CHUNK + 3).tolist()
    hasher = make_hasher(NS)
    completed = [len(hasher.extend([t])) for t in tokens]
    assert sum(completed) == 5
    assert [i for i, n in enumerate(completed) if n] == [CHUNK * k - 1 for k in range(1, 6)]
    assert list(hasher.keys) == chunk_keys(tokens, NS)


def test_input_types_give_equal_keys() -> None:
    ids = np.random.default_rng(1).integers(0, 128_000, size=3 * CHUNK)
    expected = chunk_keys(ids.tolist(), NS)
    assert len(expected) == 3
    for variant in (
        tuple(ids.tolist()),
        ids.astype(np.int32),
        ids.astype(np.uint32),
        ids.astype(np.int64),
        torch.from_numpy(ids),
        torch.from_numpy(ids).to(torch.int32),
        list(ids),  # numpy scalars in a list
    ):
        assert chunk_keys(variant, NS) == expected


def test_lists_of_wide_ids_hash_as_their_arrays_do() -> None:
    # A list goes through array("Q"), an array through numpy: same canonical ids.
    ids = [0, 1, 2**31, 2**40, 2**63 - 1, *range(CHUNK)]
    assert chunk_keys(ids, NS) == chunk_keys(np.array(ids, dtype=np.int64), NS)


def test_keys_are_namespace_plus_full_128_bit_chain() -> None:
    keys = chunk_keys(list(range(2 * CHUNK)), NS)
    assert all(isinstance(k, bytes) and len(k) == 32 for k in keys)
    assert all(k[:16] == NS.digest for k in keys)


def test_wide_token_ids_are_hashed_per_chunk() -> None:
    narrow = list(range(CHUNK))
    wide = [2**40, *range(1, CHUNK)]
    keys = chunk_keys(narrow + wide + narrow, NS)
    # The first chunk's key does not depend on the wide ids after it.
    assert keys[0] == chunk_keys(narrow, NS)[0]
    assert len(set(keys)) == 3


def test_extra_keys_change_only_the_chunks_they_touch() -> None:
    tokens = [7] * (4 * CHUNK)
    plain = chunk_keys(tokens, NS)
    image = ExtraKeys(mm_spans=(MultimodalSpan("img-sha", offset=2 * CHUNK + 3, length=4),))
    with_image = chunk_keys(tokens, NS, extras=image)
    assert with_image[:2] == plain[:2]
    assert all(a != b for a, b in zip(with_image[2:], plain[2:], strict=True))
    moved = ExtraKeys(mm_spans=(MultimodalSpan("img-sha", offset=2 * CHUNK + 4, length=4),))
    assert chunk_keys(tokens, NS, extras=moved)[2] != with_image[2]
    lora = chunk_keys(tokens, NS, extras=ExtraKeys(lora_name="sql", lora_path="/a"))
    assert set(lora).isdisjoint(plain)
    other_path = chunk_keys(tokens, NS, extras=ExtraKeys(lora_name="sql", lora_path="/b"))
    assert set(other_path).isdisjoint(lora)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([1, -2, 3], "must be >= 0"),
        ([1, 2.5, 3], "integers"),
        ([True, False], "integers"),
        ([1, 2**64], "int64"),
        ([1, 2**63], "int64"),
        ([0, 1, np.True_], "integers"),
        ([[1, 2], [3, 4]], "1-D"),
        ("1 2 3", "not str"),
        (np.array([1.0, 2.0]), "integers"),
        (np.array([1, 2**63], dtype=np.uint64), "int64"),
        (torch.tensor([1.0, 2.0]), "integers"),
        (torch.tensor([True]), "integers"),
        ({1, 2}, "list, tuple"),
    ],
)
def test_bad_token_ids_are_a_clear_error(bad: object, message: str) -> None:
    with pytest.raises(InvalidTokensError, match=message):
        chunk_keys(bad, NS)


def test_vocab_size_bounds_token_ids() -> None:
    with pytest.raises(InvalidTokensError, match="out of range for vocab_size 100"):
        chunk_keys([5] * CHUNK + [100], NS, vocab_size=100)
    assert len(chunk_keys([99] * CHUNK, NS, vocab_size=100)) == 1


def test_bad_namespace_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        Namespace(model_id="m", chunk_size=0)
    with pytest.raises(ConfigError):
        Namespace(model_id="m", tp_size=2, tp_rank=2)
    with pytest.raises(ConfigError, match="unknown hash algorithm"):
        make_hasher(NS, algorithm="md5")  # type: ignore[arg-type]


def test_namespace_repr_hides_the_cache_salt() -> None:
    ns = Namespace(model_id="m", cache_salt="very-secret-salt")
    assert "very-secret-salt" not in repr(ns)
    assert "cache_salt=set" in repr(ns)


# Golden vectors: a silent change of the key scheme must fail here. If the scheme is
# changed on purpose, bump the namespace scheme version and update these together.
GOLDEN_NAMESPACE = Namespace(
    model_id="golden-model",
    model_revision="r1",
    num_layers=2,
    num_kv_heads=4,
    head_dim=8,
    chunk_size=4,
)
GOLDEN_TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 2**33, 0]
GOLDEN = {
    "namespace": "03fc042fbe962af96ac3fab601021005",  # format version 3
    "xxh3": [
        "289b95108c01342ba54b5cd2b2bd16c5",
        "998b0c04f5219929901dea812643e01f",
        "656c7c07411b437f23f76b64a84b898f",
    ],
    "vllm": ["3e6a3bb86bc2ee46171ce5bb515329bc", "c996546a8c86aa8f330fe921d859b1fe"],
}


def test_namespace_digest_is_the_documented_encoding() -> None:
    # The scheme of lmtier.chunks.keys' docstring, computed independently of Namespace.
    fields = ["lmtier.namespace", 2, "golden-model", "r1", "float32", "LKTHD"]
    fields += [2, 4, 8, 4, 1, 0, 3, ""]  # geometry, chunk size, TP, format version, salt
    expected = xxhash.xxh3_128_digest(msgpack.packb(fields, use_bin_type=True))
    assert GOLDEN_NAMESPACE.digest == expected


def test_kv_geometry_separates_namespaces() -> None:
    base = dataclasses.replace(GOLDEN_NAMESPACE)
    for change in (
        {"num_layers": 3},
        {"num_kv_heads": 2},
        {"head_dim": 16},
        {"kv_dtype": "bfloat16"},
    ):
        assert dataclasses.replace(base, **change).digest != base.digest  # type: ignore[arg-type]


def test_the_page_block_size_keys_only_when_set() -> None:
    """kv_block_size 0 leaves the digest of every namespace from before it as it was;
    a paged layout's block sizes separate namespaces, appended as the last field."""
    unset = dataclasses.replace(GOLDEN_NAMESPACE, kv_block_size=0)
    assert unset.digest.hex() == GOLDEN["namespace"]
    paged = {"kv_layout": "LBHSC", "kv_dtype": "float16"}
    small = dataclasses.replace(GOLDEN_NAMESPACE, kv_block_size=16, **paged)  # type: ignore[arg-type]
    large = dataclasses.replace(small, kv_block_size=32)
    assert len({small.digest, large.digest, unset.digest}) == 3
    fields = ["lmtier.namespace", 2, "golden-model", "r1", "float16", "LBHSC"]
    fields += [2, 4, 8, 4, 1, 0, 3, "", 16]  # ..., salt, then the block size
    assert small.digest == xxhash.xxh3_128_digest(msgpack.packb(fields, use_bin_type=True))
    assert "kv_block_size=16" in repr(small) and "kv_block_size=0" in repr(unset)
    with pytest.raises(ConfigError, match="kv_block_size"):
        Namespace(model_id="m", kv_block_size=-16)


def test_the_page_interior_keys_paged_namespaces_only_when_set() -> None:
    """A CPU page and a GPU page of one model, equal in shape, order and block size,
    have different namespaces; unset, the digest is the one from before it (so every
    non-paged golden above holds); it needs a paged layout's block size."""
    paged = dataclasses.replace(GOLDEN_NAMESPACE, kv_layout="LBHSC", kv_block_size=32)
    cpu = dataclasses.replace(paged, kv_page_interior="cpu_attn")
    gpu = dataclasses.replace(paged, kv_page_interior="flash")
    assert len({paged.digest, cpu.digest, gpu.digest}) == 3
    fields = ["lmtier.namespace", 2, "golden-model", "r1", "float32", "LBHSC"]
    fields += [2, 4, 8, 4, 1, 0, 3, "", 32, "cpu_attn"]  # ..., block size, then interior
    assert cpu.digest == xxhash.xxh3_128_digest(msgpack.packb(fields, use_bin_type=True))
    assert "kv_page_interior='cpu_attn'" in repr(cpu)
    with pytest.raises(ConfigError, match="kv_page_interior"):
        Namespace(model_id="m", kv_page_interior="flash")  # no paged layout
    with pytest.raises(ConfigError, match="kv_page_interior"):
        Namespace(model_id="m", kv_block_size=16, kv_page_interior=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        {"model_id": 123},
        {"cache_salt": 1},
        {"num_layers": -1},
        {"head_dim": True},
        {"tp_rank": 0.5},
    ],
)
def test_namespace_fields_of_the_wrong_type_are_config_errors(bad: dict[str, object]) -> None:
    fields: dict[str, object] = {"model_id": "m", **bad}
    with pytest.raises(ConfigError, match=next(iter(bad))):
        Namespace(**fields)  # type: ignore[arg-type]


def test_golden_vectors() -> None:
    assert GOLDEN_NAMESPACE.digest.hex() == GOLDEN["namespace"]
    keys = chunk_keys(GOLDEN_TOKENS, GOLDEN_NAMESPACE)
    assert [k.hex() for k in keys] == [GOLDEN["namespace"] + chain for chain in GOLDEN["xxh3"]]
    ns16 = dataclasses.replace(GOLDEN_NAMESPACE, chunk_size=16)
    vllm_keys = chunk_keys(list(range(40)), ns16, algorithm="vllm")
    assert [k.hex()[32:] for k in vllm_keys] == GOLDEN["vllm"]
    assert {k.hex()[:32] for k in vllm_keys} == {ns16.digest.hex()}
