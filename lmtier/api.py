"""The facade a user starts from: :class:`LMTier`, a synchronous, thread-safe cache.

::

    from lmtier import LMTier, KVSpec

    spec = KVSpec(num_layers=8, num_kv_heads=4, head_dim=64)
    with LMTier.open(kv=spec, model_id="my-model") as cache:
        hit = cache.lookup(prompt_ids)          # tokens cached, and which tier has them
        with cache.load(prompt_ids) as loaded:  # KV of the cached prefix
            prefix_kv = loaded.kv()             # shape spec.shape(loaded.num_tokens)
        cache.store(prompt_ids, kv)             # after the prefill: new full chunks

It owns a :class:`~lmtier.runtime.Runtime` (one event loop thread) and the
StorageManager on it; every method may be called from any thread. Token ids are
hashed in the calling thread; only tier work goes through the loop.

Engine integrations that already have chunk keys (the vLLM connector keys chunks
by vLLM's block hashes) use the key-level methods: :meth:`LMTier.lookup_keys`,
:meth:`LMTier.load_keys`, :meth:`LMTier.acquire_slabs` and :meth:`LMTier.put_encoded`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

import torch

from lmtier.config import LMTierConfig, load_config
from lmtier.cpu_tier import CPUTier
from lmtier.keys import ChunkKey, ExtraKeys, Namespace, make_hasher
from lmtier.kv_spec import KVSource, KVSpec, chunk_tensor, encode_kv_into, kv_num_tokens, narrow_kv
from lmtier.memory import HostPool, SlabHandle
from lmtier.plugins import open_tiers
from lmtier.runtime import Runtime
from lmtier.storage_manager import EvictListener, LoadedChunk, Lookup, StorageManager
from lmtier.tokens import TokenInput

__all__ = ["CacheLookup", "LMTier", "LoadResult"]

STAGING_SLABS = 128
"""Slabs beyond the CPU tier's capacity, for chunks in flight (loads being copied out,
writes queued): enough for a 32k-token prompt at chunk 256 even with the CPU tier off."""

STORE_BATCH = 16
"""Chunks :meth:`LMTier.store` encodes per trip to the event loop: few trips, few slabs."""


@dataclass(frozen=True, slots=True)
class CacheLookup:
    """How much of a prompt is cached: ``num_tokens`` (whole chunks) and who holds them."""

    num_tokens: int
    keys: tuple[ChunkKey, ...]
    lookup: Lookup

    @property
    def num_chunks(self) -> int:
        """Leading chunks found in some tier."""
        return self.lookup.num_chunks

    def tokens_by_tier(self, chunk_size: int) -> dict[str, int]:
        """Cached tokens per tier name."""
        return {s.tier: (s.stop - s.start) * chunk_size for s in self.lookup.spans}


@dataclass(slots=True)
class LoadResult:
    """Loaded chunks of a prompt's cached prefix. Release it (or use ``with``) when done."""

    chunks: list[LoadedChunk]
    chunk_size: int
    token_axis: int
    _released: bool = field(default=False, repr=False)

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV was loaded."""
        return len(self.chunks) * self.chunk_size

    def tensors(self) -> list[torch.Tensor]:
        """Zero-copy tensor views of each chunk (valid until :meth:`release`)."""
        return [chunk_tensor(c.chunk) for c in self.chunks]

    def kv(self) -> torch.Tensor | None:
        """All loaded KV as one new tensor concatenated on the token axis (None if empty)."""
        views = self.tensors()
        return torch.cat(views, dim=self.token_axis) if views else None

    def tokens_by_tier(self) -> dict[str, int]:
        """Loaded tokens per tier that served them."""
        out: dict[str, int] = {}
        for chunk in self.chunks:
            out[chunk.tier] = out.get(chunk.tier, 0) + self.chunk_size
        return out

    def release(self) -> None:
        """Give every chunk's slab back. Idempotent."""
        if not self._released:
            self._released = True
            for chunk in self.chunks:
                chunk.release()

    def __enter__(self) -> LoadResult:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class LMTier:
    """A multi-tier KV cache for one model. See the module docstring."""

    def __init__(
        self,
        config: LMTierConfig,
        kv: KVSpec,
        *,
        model_id: str | None = None,
        model_revision: str | None = None,
        tp_size: int = 1,
        tp_rank: int = 0,
        vocab_size: int | None = None,
    ) -> None:
        self.config = config
        self.kv_spec = kv
        self.chunk_size = config.chunk_size
        self.vocab_size = vocab_size
        self._base_namespace = Namespace(
            model_id=model_id if model_id is not None else config.model_id,
            model_revision=model_revision if model_revision is not None else config.model_revision,
            kv_dtype=kv.dtype,
            kv_layout=kv.layout,
            chunk_size=config.chunk_size,
            tp_size=tp_size,
            tp_rank=tp_rank,
        )
        self._namespaces: dict[str, Namespace] = {"": self._base_namespace}
        self._runtime = Runtime()
        self._manager: StorageManager | None = None
        self._pool: HostPool | None = None
        self._lock = threading.Lock()

    @classmethod
    def open(cls, config: LMTierConfig | None = None, *, kv: KVSpec, **kwargs: Any) -> LMTier:
        """Build and start a cache (``config`` defaults to :func:`load_config`)."""
        cache = cls(config if config is not None else load_config(), kv, **kwargs)
        cache.start()
        return cache

    def start(self) -> LMTier:
        """Allocate the host pool, open the tiers and start background writers."""
        with self._lock:
            if self._manager is not None:
                return self
            slab_bytes = self.kv_spec.encoded_chunk_bytes(self.chunk_size)
            cpu = self.config.cpu
            cpu_slabs = cpu.capacity_bytes // slab_bytes if cpu.enabled else 0
            pool = HostPool(slab_bytes, cpu_slabs + STAGING_SLABS)
            memory = CPUTier(pool, cpu_slabs * pool.slab_bytes)
            self._runtime.start()
            try:
                tiers = self._runtime.run(open_tiers(self.config))
                manager = StorageManager(memory, tiers)
                self._runtime.run(manager.start())
            except BaseException:
                self._runtime.stop()
                pool.close()
                raise
            self._pool, self._manager = pool, manager
        return self

    @property
    def manager(self) -> StorageManager:
        """The StorageManager (RuntimeError before :meth:`start`)."""
        if self._manager is None:
            raise RuntimeError("LMTier is not started; use LMTier.open(...) or .start()")
        return self._manager

    def namespace(self, cache_salt: str = "") -> Namespace:
        """The namespace of this model for one tenant's ``cache_salt``."""
        found = self._namespaces.get(cache_salt)
        if found is None:
            found = replace(self._base_namespace, cache_salt=cache_salt)
            self._namespaces[cache_salt] = found
        return found

    def keys(
        self, tokens: TokenInput, *, cache_salt: str = "", extras: ExtraKeys | None = None
    ) -> list[ChunkKey]:
        """Chunk keys of every full chunk of ``tokens``."""
        hasher = make_hasher(
            self.namespace(cache_salt),
            algorithm=self.config.hash_algorithm,
            extras=extras,
            vocab_size=self.vocab_size,
        )
        return hasher.extend(tokens)

    def lookup(
        self,
        tokens: TokenInput,
        *,
        cache_salt: str = "",
        extras: ExtraKeys | None = None,
        max_tokens: int | None = None,
        skip_tokens: int = 0,
    ) -> CacheLookup:
        """How many leading tokens (whole chunks, at most ``max_tokens``) some tier holds.

        ``skip_tokens`` (a multiple of the chunk size) starts the walk at that chunk,
        for a caller that already has the tokens before it (a GPU prefix cache); the
        result then counts from there.
        """
        keys = self._limited_keys(tokens, cache_salt, extras, max_tokens, skip_tokens)
        found = self.lookup_keys(keys)
        return CacheLookup(found.num_chunks * self.chunk_size, tuple(keys), found)

    def lookup_keys(self, keys: Sequence[ChunkKey]) -> Lookup:
        """Waterfall lookup of chunk keys: how many leading ones some tier holds."""
        if not keys:
            return Lookup(0, ())
        # In-memory indexes answer in this thread; only tiers that need I/O cost a
        # hop to the runtime's loop (~60 us here: more than the lookup itself).
        found = self.manager.lookup_now(keys)
        if found is None:
            found = self._runtime.run(self.manager.lookup(keys))
        return found

    def load_keys(self, keys: Sequence[ChunkKey], lookup: Lookup | None = None) -> LoadResult:
        """Load the leading servable chunks of ``keys`` (release the result when done).

        Pass the ``lookup`` just made for these keys (``CacheLookup.lookup``) to skip a
        second walk of the tiers.
        """
        chunks = self._runtime.run(self.manager.get(keys, lookup)) if keys else []
        return LoadResult(chunks, self.chunk_size, self.kv_spec.token_axis)

    def acquire_slabs(self, count: int) -> list[SlabHandle]:
        """Up to ``count`` free host slabs to encode chunks into (evicting idle cached
        chunks); fewer, counted as drops, when readers and pending writes hold the rest."""
        return self._runtime.run(self._acquire(count)) if count > 0 else []

    def put_encoded(self, encoded: Sequence[tuple[ChunkKey, SlabHandle, int]]) -> None:
        """Store chunks already encoded in slabs (``(key, lease, encoded length)``); takes
        ownership of each lease. The CPU tier adopts them now, lower tiers in the background."""
        if encoded:
            self._runtime.run(self._put(encoded))

    def load(
        self,
        tokens: TokenInput,
        *,
        cache_salt: str = "",
        extras: ExtraKeys | None = None,
        max_tokens: int | None = None,
        skip_tokens: int = 0,
    ) -> LoadResult:
        """Load the KV of the longest cached prefix (whole chunks, at most ``max_tokens``).

        Engines pass ``max_tokens=len(tokens) - 1``: the last prompt token is always
        recomputed, since its logits are needed. ``skip_tokens`` as in :meth:`lookup`:
        the result then holds the chunks from there on.
        """
        return self.load_keys(
            self._limited_keys(tokens, cache_salt, extras, max_tokens, skip_tokens)
        )

    def store(
        self,
        tokens: TokenInput,
        kv: KVSource,
        *,
        cache_salt: str = "",
        extras: ExtraKeys | None = None,
    ) -> int:
        """Store the full chunks of ``tokens`` not cached yet; returns how many were stored.

        ``kv`` holds the KV of (at least) every full chunk: one tensor shaped
        ``kv_spec.shape(n)``, or one (K, V) pair per layer shaped (n, heads, dim),
        with ``n >= len(keys) * chunk_size``, on any device.
        Never blocks on storage: if every host slab is held by readers and pending
        writes, the remaining chunks are dropped and counted (``cpu.queue_drops``).
        """
        keys = self.keys(tokens, cache_salt=cache_salt, extras=extras)
        covered = kv_num_tokens(kv, self.kv_spec)
        if covered < len(keys) * self.chunk_size:
            raise ValueError(
                f"kv covers {covered} tokens; {len(keys)} full chunks need "
                f"{len(keys) * self.chunk_size}"
            )
        present = self.lookup_keys(keys).num_chunks
        stored = 0
        for first in range(present, len(keys), STORE_BATCH):
            batch = range(first, min(first + STORE_BATCH, len(keys)))
            handles = self.acquire_slabs(len(batch))
            encoded: list[tuple[ChunkKey, SlabHandle, int]] = []
            try:
                for index, handle in zip(batch, handles, strict=False):
                    meta = self.kv_spec.meta(keys[index], self.chunk_size)
                    part = narrow_kv(kv, self.kv_spec, index * self.chunk_size, self.chunk_size)
                    encoded.append((keys[index], handle, encode_kv_into(handle, meta, part)))
            except BaseException:
                for handle in handles:
                    handle.release()
                raise
            self.put_encoded(encoded)
            stored += len(encoded)
            if len(handles) < len(batch):
                break  # the pool is exhausted by readers and pending writes: drop the rest
        return stored

    async def _acquire(self, count: int) -> list[SlabHandle]:
        """Up to ``count`` slabs; fewer (counted as dropped) when every slab is busy."""
        memory = self.manager.memory
        handles: list[SlabHandle] = []
        for _ in range(count):
            handle = memory.acquire_slab()
            if handle is None:
                memory.stats.queue_drops += count - len(handles)
                break
            handles.append(handle)
        return handles

    async def _put(self, encoded: Sequence[tuple[ChunkKey, SlabHandle, int]]) -> None:
        for key, handle, size in encoded:
            self.manager.put(key, handle, size)

    def _limited_keys(
        self,
        tokens: TokenInput,
        cache_salt: str,
        extras: ExtraKeys | None,
        max_tokens: int | None,
        skip_tokens: int = 0,
    ) -> list[ChunkKey]:
        if skip_tokens < 0 or skip_tokens % self.chunk_size:
            raise ValueError(
                f"skip_tokens must be a non-negative multiple of the chunk size "
                f"{self.chunk_size}, got {skip_tokens}"
            )
        keys = self.keys(tokens, cache_salt=cache_salt, extras=extras)
        if max_tokens is not None:
            keys = keys[: max(0, max_tokens) // self.chunk_size]
        return keys[skip_tokens // self.chunk_size :]

    def add_evict_listener(self, callback: EvictListener) -> None:
        """Call ``callback(key)`` with the key of every chunk the CPU tier evicts from
        now on (the chunk may still be in a lower tier). Registration is thread-safe;
        the callback runs on the runtime's loop thread, inside the eviction, so it must
        be quick, thread-safe with respect to the caller's own state, and must not call
        back into this cache. One that raises is logged and ignored."""
        manager = self.manager
        self._runtime.run(self._add_evict_listener(manager, callback))

    def remove_evict_listener(self, callback: EvictListener) -> None:
        """Stop calling ``callback`` (a no-op once the cache is closed)."""
        manager = self._manager
        if manager is not None:
            self._runtime.run(self._remove_evict_listener(manager, callback))

    @staticmethod
    async def _add_evict_listener(manager: StorageManager, callback: EvictListener) -> None:
        manager.add_evict_listener(callback)

    @staticmethod
    async def _remove_evict_listener(manager: StorageManager, callback: EvictListener) -> None:
        manager.remove_evict_listener(callback)

    def flush(self) -> None:
        """Wait until background writes queued so far have been attempted."""
        self._runtime.run(self.manager.flush())

    def stats(self) -> dict[str, dict[str, object]]:
        """Counters of every tier (see :class:`~lmtier.stats.TierStats`)."""
        return self._runtime.run(self._stats())

    async def _stats(self) -> dict[str, dict[str, object]]:
        return self.manager.stats()

    def close(self) -> None:
        """Flush background writes, close the tiers, stop the runtime. Idempotent."""
        with self._lock:
            manager, pool = self._manager, self._pool
            self._manager = self._pool = None
        if manager is None:
            return
        try:
            self._runtime.run(manager.close())
        finally:
            self._runtime.stop()
            if pool is not None:
                pool.close()

    def __enter__(self) -> LMTier:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
