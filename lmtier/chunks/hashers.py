"""Choosing a chunk-key algorithm: :func:`make_hasher` and :func:`chunk_keys`.

Apart from both algorithms (:mod:`lmtier.chunks.keys` and
:mod:`lmtier.chunks.vllm_hash`, which builds on the first's namespaces), so that the
import graph has no cycle and the vLLM mode's cbor2 and sha256 load only when asked
for.
"""

from __future__ import annotations

from lmtier.chunks.keys import (
    ChunkHasher,
    ChunkKey,
    ExtraKeys,
    HashAlgorithm,
    Namespace,
    Xxh3ChunkHasher,
)
from lmtier.chunks.tokens import TokenInput
from lmtier.errors import ConfigError

__all__ = ["chunk_keys", "make_hasher"]


def make_hasher(
    namespace: Namespace,
    *,
    algorithm: HashAlgorithm = "xxh3",
    extras: ExtraKeys | None = None,
    vocab_size: int | None = None,
    vllm_none_hash_seed: str | None = None,
) -> ChunkHasher:
    """A fresh incremental hasher for one sequence under ``namespace``.

    ``algorithm="vllm"`` keys chunks by vLLM's own block hashes (see
    :mod:`lmtier.chunks.vllm_hash`); ``vllm_none_hash_seed`` only applies there.
    """
    if algorithm == "xxh3":
        return Xxh3ChunkHasher(namespace, extras=extras, vocab_size=vocab_size)
    if algorithm == "vllm":
        from lmtier.chunks.vllm_hash import (  # noqa: PLC0415 - cbor2 and sha256 when asked for
            DEFAULT_NONE_HASH_SEED,
            VllmChunkHasher,
        )

        return VllmChunkHasher(
            namespace,
            extras=extras,
            vocab_size=vocab_size,
            none_hash_seed=vllm_none_hash_seed or DEFAULT_NONE_HASH_SEED,
        )
    raise ConfigError(f"unknown hash algorithm {algorithm!r}; expected 'xxh3' or 'vllm'")


def chunk_keys(
    tokens: TokenInput,
    namespace: Namespace,
    *,
    algorithm: HashAlgorithm = "xxh3",
    extras: ExtraKeys | None = None,
    vocab_size: int | None = None,
) -> list[ChunkKey]:
    """Keys of every full chunk of ``tokens`` (a partial tail gets no key)."""
    hasher = make_hasher(namespace, algorithm=algorithm, extras=extras, vocab_size=vocab_size)
    return hasher.extend(tokens)
