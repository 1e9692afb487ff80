"""Naming and framing chunks: token ids in, chunk keys out, and the one byte format
every tier stores.

* :mod:`~lmtier.chunks.tokens`: token ids of any input type, validated, as one array.
* :mod:`~lmtier.chunks.keys`: namespaces and the chained xxh3-128 chunk keys.
* :mod:`~lmtier.chunks.vllm_hash`: keys from vLLM's own block hashes.
* :mod:`~lmtier.chunks.hashers`: choosing one of them (``make_hasher``, ``chunk_keys``).
* :mod:`~lmtier.chunks.format`: the chunk byte format (header, checksums, payload).
* :mod:`~lmtier.chunks.integrity`: the optional HMAC over a chunk.

Nothing here imports torch: storage backends and the CLI use it.
"""
