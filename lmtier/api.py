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
hashed in the calling thread; tier I/O goes through the loop; a store touches only
host memory, under the manager's lock, and never waits for the loop.

Bad arguments are typed lmtier errors that say what to pass (InvalidRequestError
and its InvalidTokensError and InvalidKVError, ConfigError for the cache's own
settings, CacheClosedError after close); they change nothing. A model id (or a
revision, a weights fingerprint) is required: two unnamed models would share KV.

Engine integrations that already have chunk keys (the vLLM connector keys chunks
by vLLM's block hashes) use the key-level methods: :meth:`LMTier.lookup_keys`,
:meth:`LMTier.load_keys`, :meth:`LMTier.acquire_slabs` and :meth:`LMTier.put_encoded`.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any

from lmtier import exiting
from lmtier.chunks.format import ChunkMeta
from lmtier.chunks.hashers import make_hasher
from lmtier.chunks.integrity import load_key
from lmtier.chunks.keys import ChunkHasher, ChunkKey, ExtraKeys, Namespace
from lmtier.chunks.tokens import TokenInput
from lmtier.config import LMTierConfig, load_config
from lmtier.errors import (
    CacheClosedError,
    ConfigError,
    InvalidRequestError,
    brief,
)
from lmtier.kv_spec import ChunkFramer, KVSource, KVSpec, frame_slab
from lmtier.maintenance import Maintenance, checked_keys
from lmtier.results import CacheLookup, HostMemory, LoadResult, caller
from lmtier.runtime import Runtime
from lmtier.storage.check import ChunkCheck
from lmtier.storage.cpu_tier import open_cpu_tier
from lmtier.storage.lookup import Lookup
from lmtier.storage.manager import StorageManager
from lmtier.storage.memory import HostPool, SlabHandle
from lmtier.storage.plugins import open_tiers
from lmtier.storing import Encoded, Reserved, store_chunks

__all__ = ["CacheLookup", "HostMemory", "LMTier", "LoadResult"]

logger = logging.getLogger(__name__)

STORE_BATCH = 64
"""Chunks :meth:`LMTier.store` frames per pair of trips to the event loop (one to take
slabs, one to hand them over: ~60 us each here, so ~2 us a chunk)."""
NAMESPACE_CACHE = 1024
"""Tenants (``cache_salt`` values) whose namespace is kept ready; others are rebuilt
(~3 us) when they come back. A bound: one entry per tenant forever grew without end."""
EXIT_GRACE_S = 10.0
"""At exit, how long closing may take beyond ``close_flush_s`` (tiers closing, calls
abandoned earlier finishing) before the process exits without it."""


def _require_int(name: str, value: object, *, lowest: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise InvalidRequestError(f"{name} must be an int >= {lowest}, got {brief(value)}")
    return value


class LMTier(Maintenance):
    """A multi-tier KV cache for one model. See the module docstring; its cache-wide
    operations (pins, prefetch, purge, stats) are :class:`~lmtier.maintenance.Maintenance`."""

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
        if not isinstance(config, LMTierConfig):
            raise ConfigError(f"config must be an LMTierConfig, got {type(config).__name__}")
        if not isinstance(kv, KVSpec):
            raise ConfigError(f"kv must be a KVSpec, got {type(kv).__name__}")
        model_id = config.model_id if model_id is None else model_id
        model_revision = config.model_revision if model_revision is None else model_revision
        for name, value in (("model_id", model_id), ("model_revision", model_revision)):
            if not isinstance(value, str):
                raise ConfigError(f"{name} must be a str, got {type(value).__name__}")
        if not model_id.strip() and not model_revision.strip():
            raise ConfigError(
                "model_id is required: caches of two unnamed models would share KV; pass "
                "LMTier.open(..., model_id='org/model') or set model_id in the config "
                "(model_revision, a weights fingerprint, also names the model)"
            )
        if vocab_size is not None:
            _require_int("vocab_size", vocab_size, lowest=1)
        self.config = config
        self.kv_spec = kv
        self.chunk_size = config.chunk_size
        self.vocab_size = vocab_size
        base = Namespace(
            model_id=model_id,
            model_revision=model_revision,
            kv_dtype=kv.dtype,
            kv_layout=kv.layout,
            num_layers=kv.num_layers,
            num_kv_heads=kv.num_kv_heads,
            head_dim=kv.head_dim,
            chunk_size=config.chunk_size,
            tp_size=tp_size,
            tp_rank=tp_rank,
            kv_block_size=kv.block_size,
        )
        self._base_namespace = base
        self._salted = functools.lru_cache(maxsize=NAMESPACE_CACHE)(
            lambda salt: replace(base, cache_salt=salt)
        )
        self._framer = ChunkFramer(kv, config.chunk_size)
        self._runtime = Runtime()
        self._manager: StorageManager | None = None
        self._pool: HostPool | None = None
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def open(cls, config: LMTierConfig | None = None, *, kv: KVSpec, **kwargs: Any) -> LMTier:
        """Build and start a cache (``config`` defaults to :func:`load_config`)."""
        cache = cls(config if config is not None else load_config(), kv, **kwargs)
        cache.start()
        return cache

    @classmethod
    def connect(
        cls,
        target: str | None = None,
        config: LMTierConfig | None = None,
        *,
        kv: KVSpec,
        **kwargs: Any,
    ) -> LMTier:
        """A started client of the sidecar at ``target`` (``unix:///path.sock`` or
        ``host:port``; None: where ``lmtier serve`` listens with this config, its
        ``sidecar.listen`` or else its default socket in ``$XDG_RUNTIME_DIR/lmtier``)
        with this interface: :class:`lmtier.remote.client.SidecarClient` (the ``grpc``
        extra). Keyword arguments: the model's (as :meth:`open`), and ``token``,
        ``credentials``, ``shared_memory``, ``timeout_s``, ``client_name``."""
        from lmtier.remote.client import SidecarClient, sidecar_target  # noqa: PLC0415

        config = config if config is not None else load_config()
        where = target if target is not None else sidecar_target(config)
        return SidecarClient(where, config, kv, **kwargs).start()

    def start(self) -> LMTier:
        """Allocate the host pool, open the tiers and start background writers.

        Host memory is ``cpu.capacity_bytes`` (when the CPU tier is on) plus
        ``cpu.staging_bytes``, in whole chunks, allocated now and never more.
        """
        with self._lock:
            if self._closed:
                raise CacheClosedError("this LMTier was closed; open a new one")
            if self._manager is not None:
                return self
            mac = load_key(self.config.integrity.key, self.config.integrity.key_file)
            slab_bytes = self.kv_spec.encoded_chunk_bytes(self.chunk_size)
            cpu, disk = self.config.cpu, self.config.disk
            memory = open_cpu_tier(
                slab_bytes,
                cached_bytes=cpu.capacity_bytes if cpu.enabled else 0,
                staging_bytes=cpu.staging_bytes,
                max_pinned_fraction=cpu.max_pinned_fraction,
                direct_io=disk.enabled and disk.o_direct,
            )
            pool = memory.pool
            check = ChunkCheck(self.kv_spec.geometry(self.chunk_size), mac)
            self._runtime.start()
            try:
                tiers = self._runtime.run(open_tiers(self.config))
                manager = StorageManager(memory, tiers, check=check)
                self._runtime.run(manager.start())
            except BaseException:
                self._runtime.stop()
                pool.close()
                raise
            self._pool, self._manager = pool, manager
        exiting.close_at_exit(self)  # queued writes land even if close() is never called
        return self

    def host_memory(self) -> HostMemory:
        """What this cache holds in host memory now (a snapshot; any thread)."""
        manager, pool = self._require(), self._pool
        assert pool is not None  # set together with the manager
        return HostMemory(
            total_bytes=pool.nbytes,
            slab_bytes=pool.slab_bytes,
            slabs=pool.num_slabs,
            slabs_in_use=pool.num_in_use,
            cached_chunks=len(manager.memory),
            cache_capacity_chunks=manager.memory.max_chunks,
        )

    def in_memory(self, key: ChunkKey) -> bool:
        """Whether chunk ``key`` is in the CPU tier now (no stats, no recency change)."""
        return key in self._require().memory

    def _require(self) -> StorageManager:
        """The StorageManager (CacheClosedError before :meth:`start` or after close)."""
        manager = self._manager
        if manager is None:
            state = "closed" if self._closed else "not started; use LMTier.open(...) or .start()"
            raise CacheClosedError(f"this LMTier is {state}")
        return manager

    def _check_open(self) -> None:
        """CacheClosedError unless the cache is open (a hook: a sidecar client has no
        StorageManager of its own)."""
        self._require()

    def namespace(self, cache_salt: str = "") -> Namespace:
        """The namespace of this model for one tenant's ``cache_salt``."""
        if not isinstance(cache_salt, str):
            raise InvalidRequestError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
        return self._salted(cache_salt)

    def keys(
        self, tokens: TokenInput, *, cache_salt: str = "", extras: ExtraKeys | None = None
    ) -> list[ChunkKey]:
        """Chunk keys of every full chunk of ``tokens``."""
        return self.hasher(cache_salt=cache_salt, extras=extras).extend(tokens)

    def hasher(self, *, cache_salt: str = "", extras: ExtraKeys | None = None) -> ChunkHasher:
        """An incremental hasher of this cache's keys for one growing sequence: a prompt,
        then the tokens decoded after it, each hashed once (``extend`` returns the keys
        of the chunks the new tokens complete)."""
        if extras is not None and not isinstance(extras, ExtraKeys):
            raise InvalidRequestError(f"extras must be ExtraKeys, got {type(extras).__name__}")
        return make_hasher(
            self.namespace(cache_salt),
            algorithm=self.config.hash_algorithm,
            extras=extras,
            vocab_size=self.vocab_size,
        )

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
        found = self._lookup(keys, local_only=False)
        return CacheLookup(found.num_chunks * self.chunk_size, tuple(keys), found)

    def lookup_keys(self, keys: Sequence[ChunkKey], *, local_only: bool = False) -> Lookup:
        """Waterfall lookup of chunk keys: how many leading ones some tier holds.

        ``local_only``: ask only the tiers that answer without I/O (host memory, the
        disk index), so the call never waits on a remote tier.
        """
        return self._lookup(checked_keys(keys), local_only=local_only)

    def lookup_keys_now(self, keys: Sequence[ChunkKey]) -> Lookup | None:
        """:meth:`lookup_keys` when every tier it must ask answers without I/O (host
        memory, the disk index), else None at once: for a caller that must not wait
        on a remote tier (a scheduler) and asks it elsewhere instead."""
        return self._lookup_now(checked_keys(keys))

    def _lookup_now(self, keys: Sequence[ChunkKey]) -> Lookup | None:
        if not keys:
            return Lookup(0, ())
        return self._require().lookup_now(keys)

    def _lookup(self, keys: Sequence[ChunkKey], *, local_only: bool) -> Lookup:
        manager = self._require()
        if not keys:
            return Lookup(0, ())
        if local_only:
            return manager.lookup_local(keys)
        # In-memory indexes answer in this thread; only tiers that need I/O cost a
        # hop to the runtime's loop (~60 us here: more than the lookup itself).
        found = manager.lookup_now(keys)
        if found is None:
            found = self._runtime.run(manager.lookup(keys))
        return found

    def load_keys(self, keys: Sequence[ChunkKey], lookup: Lookup | None = None) -> LoadResult:
        """Load the leading servable chunks of ``keys`` (release the result when done).

        Pass the ``lookup`` just made for these keys (``CacheLookup.lookup``) to skip a
        second walk of the tiers.
        """
        return self._load(checked_keys(keys), lookup, caller())

    def _load(self, keys: Sequence[ChunkKey], lookup: Lookup | None, origin: str) -> LoadResult:
        manager = self._require()
        chunks = self._runtime.run(manager.get(keys, lookup)) if keys else []
        return LoadResult(chunks, self.chunk_size, self.kv_spec, origin)

    def acquire_slabs(self, count: int) -> list[SlabHandle]:
        """Up to ``count`` free host slabs to encode chunks into (evicting idle cached
        chunks); fewer, counted as drops, when readers and pending writes hold the rest."""
        _require_int("count", count)
        manager = self._require()
        return manager.acquire_slabs(count, True) if count > 0 else []

    def seal_slab(self, handle: SlabHandle, meta: ChunkMeta) -> int:
        """Frame a payload already copied into ``handle``'s slab at its place
        (:func:`lmtier.kv_spec.payload_tensor`). Returns the encoded length, for
        :meth:`put_encoded`. No pass over the payload here: its checksum, and its MAC
        when an integrity key is set, are computed in the background before the chunk
        is written below host memory (:mod:`lmtier.storage.sealing`)."""
        return frame_slab(handle, meta)

    def put_encoded(self, encoded: Sequence[tuple[ChunkKey, SlabHandle, int]]) -> int:
        """Store chunks already encoded in slabs (``(key, lease, encoded length)``); takes
        ownership of each lease. The CPU tier adopts them now, lower tiers in the
        background. Returns how many every write-through tier's queue took (the rest
        were dropped there, and counted in its ``queue_drops``)."""
        manager = self._require()
        return manager.put_many(encoded) if encoded else 0

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
        keys = self._limited_keys(tokens, cache_salt, extras, max_tokens, skip_tokens)
        return self._load(keys, None, caller())

    def store(
        self,
        tokens: TokenInput,
        kv: KVSource,
        *,
        cache_salt: str = "",
        extras: ExtraKeys | None = None,
    ) -> int:
        """Store the full chunks of ``tokens`` not cached yet; returns how many were stored.

        Stored means: in the CPU tier (when it is on) and queued for every
        write-through tier; a chunk a full write queue refused is not counted (see
        ``stats()[tier]["queue_drops"]``). Writes that later fail in the background
        are counted in the tier's ``errors``; :meth:`flush` waits for them.
        ``kv`` holds the KV of (at least) every full chunk: one tensor shaped
        ``kv_spec.shape(n)``, or one (K, V) pair per layer shaped (n, heads, dim),
        with ``n >= len(keys) * chunk_size``, on any device, of the spec's dtype.
        Never blocks on storage: chunks already in a local tier are skipped (remote
        tiers are not asked), and if every host slab is held by readers and pending
        writes, the remaining chunks are dropped and counted (``cpu.queue_drops``).
        """
        self._check_open()  # fail fast when closed, before any work
        return self._store(self.keys(tokens, cache_salt=cache_salt, extras=extras), kv, None)

    def store_keys(self, keys: Sequence[ChunkKey], kv: KVSource, *, skip: int | None = None) -> int:
        """:meth:`store` for the keys of a sequence already hashed (chunk ``i`` is
        ``kv``'s tokens ``[i * chunk_size, (i + 1) * chunk_size)``).

        ``skip``: how many leading chunks the caller knows are cached (the lookup it has
        just made); None asks the local tiers.
        """
        return self._store(checked_keys(keys), kv, skip)

    def _store(self, keys: Sequence[ChunkKey], kv: KVSource, skip: int | None) -> int:
        """:meth:`store_keys` for keys this cache made (not checked again)."""
        self._check_open()
        if skip is not None:
            _require_int("skip", skip)
        return store_chunks(self, keys, kv, skip)

    store_batch = STORE_BATCH

    def _reserve(
        self, keys: Sequence[ChunkKey], skip: int | None, count: int
    ) -> tuple[int, Reserved]:
        """How many leading ``keys`` a store skips (``skip``, else the local tiers say),
        and slabs reserved for the rest (:mod:`lmtier.storing`): none here."""
        present = skip if skip is not None else self._lookup(keys, local_only=True).num_chunks
        return present, Reserved()

    def _hand_over(self, encoded: Encoded) -> Callable[[], int]:
        """Give filled slabs to the cache now (:mod:`lmtier.storing`)."""
        stored = self.put_encoded(encoded)
        return lambda: stored

    def _limited_keys(
        self,
        tokens: TokenInput,
        cache_salt: str,
        extras: ExtraKeys | None,
        max_tokens: int | None,
        skip_tokens: int = 0,
    ) -> list[ChunkKey]:
        if max_tokens is not None:
            _require_int("max_tokens", max_tokens)
        _require_int("skip_tokens", skip_tokens)
        if skip_tokens % self.chunk_size:
            raise InvalidRequestError(
                f"skip_tokens must be a multiple of the chunk size {self.chunk_size}, "
                f"got {skip_tokens}"
            )
        keys = self.keys(tokens, cache_salt=cache_salt, extras=extras)
        if max_tokens is not None:
            keys = keys[: max_tokens // self.chunk_size]
        return keys[skip_tokens // self.chunk_size :]

    def close(self) -> None:
        """Flush background writes (up to ``close_flush_s``), close the tiers, stop the
        runtime. Idempotent; the cache cannot be used (CacheClosedError) or started
        again afterwards. A program that exits without it gets the same close, from
        an exit hook (:mod:`lmtier.exiting`)."""
        self._close(None)

    def close_at_exit(self) -> None:
        """:meth:`close`, bounded for interpreter exit (:mod:`lmtier.exiting`): after
        ``close_flush_s`` plus ``EXIT_GRACE_S`` the process exits without waiting more."""
        self._close(self.config.close_flush_s + EXIT_GRACE_S)

    def _close(self, timeout_s: float | None) -> None:
        with self._lock:
            manager, pool = self._manager, self._pool
            self._manager = self._pool = None
            self._closed = True
        exiting.forget(self)
        if manager is None:
            return
        timed_out = False
        try:
            self._runtime.run(manager.close(self.config.close_flush_s), timeout_s)
        except TimeoutError:
            if timeout_s is None:
                raise
            # At exit: the loop's thread is a daemon, it ends with the process.
            timed_out = True
            logger.warning("exit: closing the cache took over %g s; not waiting more", timeout_s)
        finally:
            if not timed_out:
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
