"""The vLLM-compatible mode reproduces vLLM's sha256_cbor block hashes bit for bit."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import warnings
from typing import Any

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmtier.chunks.hashers import chunk_keys, make_hasher
from lmtier.chunks.keys import ExtraKeys, MultimodalSpan, Namespace
from lmtier.chunks.vllm_hash import (
    VllmChunkHasher,
    bind_block_hash,
    none_hash,
    vllm_block_hashes,
)
from lmtier.errors import ConfigError

BLOCK = 16


def reference_block_hashes(
    tokens: list[int],
    *,
    salt: str | None,
    lora: tuple[str, str] | None,
    mm: list[tuple[str, int, int]],
    seed: str = "vllm-none-hash",
) -> list[bytes]:
    """vLLM's scheme written out from its specification, with cbor2 and hashlib only."""

    def h(value: Any) -> bytes:
        return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()

    parent = h(seed)
    hashes = []
    for start in range(0, len(tokens) // BLOCK * BLOCK, BLOCK):
        end = start + BLOCK
        extra: list[tuple[Any, ...]] = []
        if lora:
            extra.append(("lora", lora[0], lora[1]))
        for identifier, offset, length in mm:
            if offset < end and offset + length > start:
                extra.append(("mm", identifier, offset - start))
        if start == 0 and salt:
            extra.append(("cache_salt", salt))
        parent = h((parent, tuple(tokens[start:end]), tuple(extra) if extra else None))
        hashes.append(parent)
    return hashes


mm_items = st.lists(
    st.tuples(st.text(min_size=1, max_size=8), st.integers(0, 80), st.integers(1, 40)),
    max_size=3,
).map(lambda items: sorted(items, key=lambda item: item[1]))


@settings(max_examples=60)
@given(
    tokens=st.lists(st.integers(0, 2**32), max_size=6 * BLOCK),
    salt=st.one_of(st.none(), st.text(max_size=10)),
    lora=st.one_of(st.none(), st.tuples(st.text(max_size=6), st.text(max_size=6))),
    mm=mm_items,
)
def test_equal_to_an_independent_computation(
    tokens: list[int],
    salt: str | None,
    lora: tuple[str, str] | None,
    mm: list[tuple[str, int, int]],
) -> None:
    extras = ExtraKeys(
        lora_name=lora[0] if lora else None,
        lora_path=lora[1] if lora else None,
        mm_spans=tuple(MultimodalSpan(i, o, n) for i, o, n in mm),
    )
    ours = vllm_block_hashes(tokens, cache_salt=salt, extras=extras)
    assert ours == reference_block_hashes(tokens, salt=salt, lora=lora, mm=mm)


def test_chunk_keys_bind_the_block_hash_at_each_chunk_end() -> None:
    ns = Namespace(model_id="m", chunk_size=64, cache_salt="t")
    tokens = list(range(1000, 1000 + 3 * 64 + 5))
    hasher = make_hasher(ns, algorithm="vllm")
    assert isinstance(hasher, VllmChunkHasher)
    keys = hasher.extend(tokens)
    blocks = reference_block_hashes(tokens, salt="t", lora=None, mm=[])
    assert list(hasher.block_hashes) == blocks
    assert keys == [bind_block_hash(ns, blocks[4 * i + 3]) for i in range(3)]
    assert keys == chunk_keys(tokens, ns, algorithm="vllm")


def test_none_hash_seed_is_configurable() -> None:
    assert none_hash() == hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()
    ns = Namespace(model_id="m", chunk_size=16)
    a = make_hasher(ns, algorithm="vllm").extend(list(range(16)))
    b = make_hasher(ns, algorithm="vllm", vllm_none_hash_seed="42").extend(list(range(16)))
    assert a != b


def test_incremental_vllm_mode_equals_one_shot() -> None:
    ns = Namespace(model_id="m", chunk_size=32)
    tokens = [(i * 31) % 997 for i in range(200)]
    hasher = make_hasher(ns, algorithm="vllm")
    keys = []
    for start in range(0, len(tokens), 7):
        keys.extend(hasher.extend(tokens[start : start + 7]))
    assert keys == chunk_keys(tokens, ns, algorithm="vllm")


def test_chunk_size_must_be_a_multiple_of_the_block_size() -> None:
    with pytest.raises(ConfigError, match="multiple of vLLM's block size"):
        make_hasher(Namespace(model_id="m", chunk_size=24), algorithm="vllm")


HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_equal_to_vllm_hash_block_tokens() -> None:
    with warnings.catch_warnings():
        # vLLM's import touches deprecated torch.jit APIs; that is vLLM's business.
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1.core import kv_cache_utils

    saved = os.environ.pop("PYTHONHASHSEED", None)
    try:
        kv_cache_utils.init_none_hash(sha256_cbor)
    finally:
        if saved is not None:
            os.environ["PYTHONHASHSEED"] = saved
    tokens = [(i * 7919) % 151_000 for i in range(5 * BLOCK + 3)]
    salt = "tenant-a"
    lora = ("sql-adapter", "/adapters/sql")
    extras = ExtraKeys(
        lora_name=lora[0],
        lora_path=lora[1],
        mm_spans=(MultimodalSpan("image-hash", offset=20, length=30),),
    )
    parent = None
    expected = []
    for start in range(0, 5 * BLOCK, BLOCK):
        extra: list[tuple[Any, ...]] = [("lora", *lora)]
        if start < 50 and start + BLOCK > 20:
            extra.append(("mm", "image-hash", 20 - start))
        if start == 0:
            extra.append(("cache_salt", salt))
        parent = kv_cache_utils.hash_block_tokens(
            sha256_cbor, parent, tokens[start : start + BLOCK], tuple(extra)
        )
        expected.append(bytes(parent))
    assert vllm_block_hashes(tokens, cache_salt=salt, extras=extras) == expected
