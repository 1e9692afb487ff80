"""vLLM-compatible block hashes, bit for bit, and chunk keys derived from them.

vLLM (>= 0.33, ``prefix_caching_hash_algo="sha256_cbor"``) hashes each full block of
``block_size`` tokens as::

    NONE_HASH = sha256(cbor(seed))                      seed = "vllm-none-hash"
    h[i]      = sha256(cbor((h[i-1] or NONE_HASH, tuple(tokens of block i), extra[i])))

with canonical CBOR, and ``extra[i]`` either ``None`` or a tuple of tagged keys in
this order: ``("lora", name, path)``, ``("mm", identifier, offset_in_block)`` for each
multimodal item overlapping the block, and ``("cache_salt", salt)`` on block 0 only.
Reproducing that lets our keys agree with vLLM's prefix cache and its KV events.
(vLLM takes the seed from PYTHONHASHSEED when that is set; pass the same value as
``none_hash_seed`` to match such a deployment.)

vLLM's hashes name no model, so a chunk's storage key binds the namespace to the
block hash at the chunk's end boundary::

    key(chunk j) = namespace digest || xxh3_128(b"vllm" || namespace digest || h[(j+1) * C/B - 1])

The chunk size must be a multiple of the block size. The binding is one xxh3 call
per chunk; the block hashes themselves (one CBOR encoding and one sha256 per 16
tokens) dominate the cost, as they do inside vLLM.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import cbor2
import numpy as np
import xxhash

from lmtier.chunks.keys import BLOCK_SIZE, ChunkHasher, ChunkKey, ExtraKeys, Namespace
from lmtier.chunks.tokens import TokenArray, TokenInput, as_token_array
from lmtier.errors import ConfigError

__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "VllmChunkHasher",
    "engine_names",
    "bind_block_hash",
    "none_hash",
    "vllm_block_hashes",
]

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_BIND_TAG = b"vllm"


def sha256_cbor(value: Any) -> bytes:
    """sha256 of the canonical CBOR encoding of ``value``, as vLLM's ``sha256_cbor``."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def none_hash(seed: str = DEFAULT_NONE_HASH_SEED) -> bytes:
    """vLLM's NONE_HASH: the parent of the first block."""
    return sha256_cbor(seed)


def bind_block_hash(namespace: Namespace, block_hash: bytes) -> ChunkKey:
    """The storage key of a chunk whose last block has vLLM hash ``block_hash``."""
    digest = namespace.digest
    return ChunkKey(digest + xxhash.xxh3_128_digest(_BIND_TAG + digest + block_hash))


def vllm_block_hashes(
    tokens: TokenInput,
    *,
    block_size: int = BLOCK_SIZE,
    cache_salt: str | None = None,
    extras: ExtraKeys | None = None,
    parent: bytes | None = None,
    start_token: int = 0,
    none_hash_seed: str = DEFAULT_NONE_HASH_SEED,
) -> list[bytes]:
    """vLLM's block hashes for the full blocks of ``tokens``.

    ``parent`` and ``start_token`` continue an earlier call (the hash of the last
    block already hashed and the number of tokens before ``tokens``).
    """
    array = as_token_array(tokens)
    ids: list[int] = array.tolist()
    previous = parent if parent else none_hash(none_hash_seed)
    hashes: list[bytes] = []
    for offset in range(0, len(ids) - block_size + 1, block_size):
        start = start_token + offset
        extra = _block_extra_keys(extras, cache_salt, start, start + block_size)
        previous = sha256_cbor((previous, tuple(ids[offset : offset + block_size]), extra))
        hashes.append(previous)
    return hashes


def _block_extra_keys(
    extras: ExtraKeys | None, cache_salt: str | None, start: int, end: int
) -> tuple[Any, ...] | None:
    keys: list[tuple[Any, ...]] = extras.for_range(start, end) if extras is not None else []
    if start == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


class VllmChunkHasher:
    """Incremental chunk keys from vLLM block hashes; satisfies ``keys.ChunkHasher``.

    ``block_hashes`` keeps every vLLM block hash, for callers (the vLLM connector,
    KV events) that need them alongside the chunk keys.
    """

    __slots__ = (
        "_block_hashes",
        "_keys",
        "_none_hash",
        "_pending",
        "extras",
        "namespace",
        "vocab_size",
    )

    def __init__(
        self,
        namespace: Namespace,
        *,
        extras: ExtraKeys | None = None,
        vocab_size: int | None = None,
        none_hash_seed: str = DEFAULT_NONE_HASH_SEED,
    ) -> None:
        if namespace.chunk_size % BLOCK_SIZE:
            raise ConfigError(
                f"chunk_size {namespace.chunk_size} must be a multiple of vLLM's block "
                f"size {BLOCK_SIZE} in the vllm hash mode"
            )
        self.namespace = namespace
        self.extras = extras
        self.vocab_size = vocab_size
        self._none_hash = none_hash(none_hash_seed)
        self._block_hashes: list[bytes] = []
        self._keys: list[ChunkKey] = []
        self._pending: TokenArray = np.empty(0, dtype=np.int64)

    @property
    def keys(self) -> Sequence[ChunkKey]:
        return self._keys

    @property
    def block_hashes(self) -> Sequence[bytes]:
        """vLLM's hash of every full block seen so far."""
        return self._block_hashes

    @property
    def num_tokens(self) -> int:
        return len(self._block_hashes) * BLOCK_SIZE + len(self._pending)

    def extend(self, tokens: TokenInput) -> list[ChunkKey]:
        new = as_token_array(tokens, vocab_size=self.vocab_size)
        pending = np.concatenate((self._pending, new)) if len(self._pending) else new
        num_full = len(pending) // BLOCK_SIZE
        self._pending = pending[num_full * BLOCK_SIZE :].copy()
        if num_full == 0:
            return []
        start_token = len(self._block_hashes) * BLOCK_SIZE
        parent = self._block_hashes[-1] if self._block_hashes else self._none_hash
        self._block_hashes.extend(
            vllm_block_hashes(
                pending[: num_full * BLOCK_SIZE],
                cache_salt=self.namespace.cache_salt or None,
                extras=self.extras,
                parent=parent,
                start_token=start_token,
            )
        )
        per_chunk = self.namespace.chunk_size // BLOCK_SIZE
        fresh: list[ChunkKey] = []
        for chunk in range(len(self._keys), len(self._block_hashes) // per_chunk):
            fresh.append(
                bind_block_hash(self.namespace, self._block_hashes[(chunk + 1) * per_chunk - 1])
            )
        self._keys.extend(fresh)
        return fresh


def engine_names(
    hasher: ChunkHasher, keys: Sequence[ChunkKey], chunk_size: int
) -> dict[ChunkKey, tuple[bytes | None, tuple[bytes, ...]]]:
    """What vLLM calls each of ``keys`` (the chunks ``hasher`` made, from a prompt's
    first): the hash of the block before it (None for the first) and its blocks'
    hashes; nothing for a hasher of another algorithm."""
    if not isinstance(hasher, VllmChunkHasher) or not keys:
        return {}
    per, hashes = chunk_size // BLOCK_SIZE, hasher.block_hashes
    return {
        key: (hashes[j * per - 1] if j else None, tuple(hashes[j * per : (j + 1) * per]))
        for j, key in enumerate(keys)
    }
