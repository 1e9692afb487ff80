"""The facade a user starts from: :class:`LMTier`, a synchronous, thread-safe cache.

::

    from lmtier import LMTier, KVSpec

    spec = KVSpec(num_layers=8, num_kv_heads=4, head_dim=64)
    with LMTier.open(kv=spec, model_id="my-model") as cache:
        hit = cache.lookup(prompt_ids)          # tokens cached, and which tier has them
        with cache.load(prompt_ids) as loaded:  # KV of the cached prefix
            prefix_kv = loaded.kv()             # shape spec.shape(loaded.num_tokens)
        cache.store(prompt_ids, kv)             # after the prefill: new full chunks

The facade hashes token ids (in the calling thread), checks arguments and frames KV
into slabs; where the chunks live is its :class:`~lmtier.store.ChunkStore`: a
:class:`~lmtier.local_store.LocalStore` (``LMTier.open``: host memory and the
configured tiers in this process) or a sidecar's
(:func:`lmtier.connect`: :class:`~lmtier.remote.client.SidecarStore`). Every method
may be called from any thread; a store touches only host memory, under the storage
manager's lock, and never waits for I/O.

Bad arguments are typed lmtier errors that say what to pass (InvalidRequestError
and its InvalidTokensError and InvalidKVError, ConfigError for the cache's own
settings, CacheClosedError after close); they change nothing.

Engine integrations that already have chunk keys (the vLLM connector keys chunks by
vLLM's block hashes) use the key-level methods (``lookup_keys``, ``load_keys``,
``acquire_slabs``, ``put_encoded``); pins, prefetch, purge, eviction listeners,
flush and stats are what an operator or a warm-up job does.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from lmtier import exiting
from lmtier.arguments import checked_keys, require_int
from lmtier.chunks.format import ChunkMeta
from lmtier.chunks.hashers import make_hasher
from lmtier.chunks.keys import ChunkHasher, ChunkKey, ExtraKeys, Namespace
from lmtier.chunks.tokens import TokenInput
from lmtier.chunks.vllm_hash import engine_names
from lmtier.config import LMTierConfig, load_config
from lmtier.errors import CacheClosedError, ConfigError, InvalidRequestError
from lmtier.kv_spec import ChunkFramer, KVSource, KVSpec, frame_slab
from lmtier.namespaces import Namespaces, model_namespace
from lmtier.results import CacheLookup, HostMemory, LoadResult, caller
from lmtier.storage.host_pool import SlabHandle
from lmtier.storage.lookup import Lookup
from lmtier.store import ChunkStore, StoreLayout
from lmtier.storing import store_chunks, store_pages

if TYPE_CHECKING:
    import torch

    from lmtier.storage.manager import EvictListener

__all__ = ["CacheLookup", "HostMemory", "LMTier", "LoadResult"]

EXIT_GRACE_S = 10.0
"""At exit, how long closing may take beyond ``close_flush_s`` (tiers closing, calls
abandoned earlier finishing) before the process exits without it."""
PREFETCH_BATCH = 32
"""Chunks :meth:`LMTier.prefetch_keys` holds at once (64 MiB of 2 MiB chunks): a
prompt of any length is brought in without needing host memory for all of it."""


class LMTier:
    """A multi-tier KV cache for one model (module docstring). ``store``: where its
    chunks live (default: a :class:`~lmtier.local_store.LocalStore` of ``config``)."""

    def __init__(
        self,
        config: LMTierConfig,
        kv: KVSpec,
        *,
        store: ChunkStore | None = None,
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
            require_int("vocab_size", vocab_size, lowest=1)
        self.config = config
        self.kv_spec = kv
        self.chunk_size = config.chunk_size
        self.vocab_size = vocab_size
        base = model_namespace(
            kv,
            config.chunk_size,
            model_id=model_id,
            model_revision=model_revision,
            tp_size=tp_size,
            tp_rank=tp_rank,
        )
        self._namespaces = Namespaces(base)
        self._layout = StoreLayout(
            kv_spec=kv,
            chunk_size=config.chunk_size,
            framer=ChunkFramer(kv, config.chunk_size),
            base=base,
            namespace_of=self._namespaces.of_digest,
        )
        if store is None:
            # Here, not at the top: an engine that only connects to a sidecar never
            # loads the storage manager, its tiers and their plugins.
            from lmtier.local_store import LocalStore  # noqa: PLC0415

            store = LocalStore(config)
        self._store: ChunkStore = store
        self._started = self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def open(cls, config: LMTierConfig | None = None, *, kv: KVSpec, **kwargs: Any) -> LMTier:
        """Build and start a cache (``config`` defaults to :func:`load_config`)."""
        cache = cls(config if config is not None else load_config(), kv, **kwargs)
        cache.start()
        return cache

    @property
    def chunk_store(self) -> ChunkStore:
        """Where this cache's chunks live (:mod:`lmtier.store`)."""
        return self._store

    def start(self) -> LMTier:
        """Open the store: allocate host memory, open the tiers, start background
        writers (embedded), or connect (a sidecar's client: one that is down is logged,
        not raised, and costs misses until it is up).

        Host memory is ``cpu.capacity_bytes`` (when the CPU tier is on) plus
        ``cpu.staging_bytes``, in whole chunks, allocated now and never more.
        """
        with self._lock:
            if self._closed:
                raise CacheClosedError("this LMTier was closed; open a new one")
            if self._started:
                return self
            self._store.start(self._layout)
            self._started = True
        if self._store.holds_writes:
            exiting.close_at_exit(self)  # queued writes land even if close() is never called
        return self

    def check(self, cache_salt: str = "") -> LMTier:
        """Raise now why ``namespace(cache_salt)`` cannot be served, logging nothing: for
        a sidecar's client BackendUnavailable (no answer), AuthenticationError (token
        refused), PermissionDeniedError (token does not cover it); an embedded cache
        always can. For tools that must not take "no sidecar" for "nothing cached"
        (:mod:`lmtier.ops.caches`); an engine just calls, and misses meanwhile."""
        self._require().check(self.namespace(cache_salt))
        return self

    def _require(self) -> ChunkStore:
        """The store, while the cache is open (CacheClosedError before :meth:`start`
        or after close)."""
        if not self._started or self._closed:
            state = "closed" if self._closed else "not started; use LMTier.open(...) or .start()"
            raise CacheClosedError(f"this LMTier is {state}")
        return self._store

    def host_memory(self) -> HostMemory:
        """What this cache holds in host memory in this process now (a snapshot; a
        sidecar's client: its private streaming pool; the sidecar's is in
        :meth:`stats` under ``sidecar``)."""
        return self._require().host_memory()

    def in_memory(self, key: ChunkKey) -> bool:
        """Whether chunk ``key`` is in this process's CPU tier now (no stats, no recency
        change; always False for a sidecar's client)."""
        return self._require().in_memory(key)

    # ---- keys ----------------------------------------------------------------------

    def namespace(self, cache_salt: str = "") -> Namespace:
        """The namespace of this model for one tenant's ``cache_salt``."""
        if not isinstance(cache_salt, str):
            raise InvalidRequestError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
        return self._namespaces.get(cache_salt)

    def keys(
        self, tokens: TokenInput, *, cache_salt: str = "", extras: ExtraKeys | None = None
    ) -> list[ChunkKey]:
        """Chunk keys of every full chunk of ``tokens`` (with ``hash_algorithm: vllm``,
        the store's events learn vLLM's block hashes of them too)."""
        hasher = self.hasher(cache_salt=cache_salt, extras=extras)
        keys = hasher.extend(tokens)
        self._store.name_chunks(engine_names(hasher, keys, self.chunk_size))
        return keys

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

    # ---- lookups and loads ---------------------------------------------------------

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
        on a remote tier (a scheduler) and asks it elsewhere instead (a sidecar's
        client always says None: every answer is a call)."""
        keys = checked_keys(keys)
        store = self._require()
        return store.lookup_now(keys) if keys else Lookup(0, ())

    def _lookup(self, keys: Sequence[ChunkKey], *, local_only: bool) -> Lookup:
        store = self._require()
        return store.lookup(keys, local_only=local_only) if keys else Lookup(0, ())

    def load_keys(self, keys: Sequence[ChunkKey], lookup: Lookup | None = None) -> LoadResult:
        """Load the leading servable chunks of ``keys`` (release the result when done).

        Pass the ``lookup`` just made for these keys (``CacheLookup.lookup``) to skip a
        second walk of the tiers.
        """
        return self._load(checked_keys(keys), lookup, caller())

    def _load(self, keys: Sequence[ChunkKey], lookup: Lookup | None, origin: str) -> LoadResult:
        store = self._require()
        chunks = store.load(keys, lookup) if keys else []
        return LoadResult(chunks, self.chunk_size, self.kv_spec, origin)

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

    # ---- stores --------------------------------------------------------------------

    def acquire_slabs(self, count: int, *, wait: bool = True) -> list[SlabHandle]:
        """Up to ``count`` free host slabs to encode chunks into (evicting idle cached
        chunks); fewer, counted as drops, when readers and pending writes hold the rest.
        ``wait``: when pending writes hold them, wait for some while writes keep landing
        (``write_wait_s``) rather than drop at once; False for a caller that must never
        wait (an engine's forward pass)."""
        require_int("count", count)
        return self._require().acquire_slabs(count, wait=wait) if count > 0 else []

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
        store = self._require()
        return store.hand_over(list(encoded))() if encoded else 0

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
        self._require()  # fail fast when closed, before any work
        return self._store_keys(self.keys(tokens, cache_salt=cache_salt, extras=extras), kv, None)

    def store_keys(self, keys: Sequence[ChunkKey], kv: KVSource, *, skip: int | None = None) -> int:
        """:meth:`store` for the keys of a sequence already hashed (chunk ``i`` is
        ``kv``'s tokens ``[i * chunk_size, (i + 1) * chunk_size)``). ``skip``: how many
        leading chunks the caller knows are cached (its lookup); None asks the tiers."""
        return self._store_keys(checked_keys(keys), kv, skip)

    def store_pages(
        self, keys: Sequence[ChunkKey], pages: Sequence[torch.Tensor], *, skip: int | None = None
    ) -> int:
        """:meth:`store_keys` with chunk ``i`` of ``keys`` in ``pages[i]``, shaped
        ``kv_spec.shape(chunk_size)``, of the spec's dtype, any strides (a view into
        an engine's host pool, whose pages lie wherever its allocator put them)."""
        if skip is not None:
            require_int("skip", skip)
        return store_pages(self._require(), self._layout, checked_keys(keys), pages, skip)[1]

    def hold_pages(self, keys: Sequence[ChunkKey], pages: Sequence[torch.Tensor]) -> int:
        """:meth:`store_pages` of the chunks the local tiers (a sidecar's: asked with its
        slabs) lack; how many leading chunks of ``keys`` the cache holds then, as an
        engine's storage backend answers (SGLang's HiCache). A chunk only a remote tier
        holds is stored again: a copy, not a remote round trip on every call."""
        held, stored = store_pages(self._require(), self._layout, checked_keys(keys), pages, None)
        return held + stored

    def _store_keys(self, keys: Sequence[ChunkKey], kv: KVSource, skip: int | None) -> int:
        store = self._require()
        if skip is not None:
            require_int("skip", skip)
        return store_chunks(store, self._layout, keys, kv, skip)

    # ---- cache-wide operations -----------------------------------------------------

    def pin_keys(self, keys: Sequence[ChunkKey]) -> dict[str, int]:
        """Keep the chunks of ``keys`` out of LRU eviction in the tiers that evict by LRU
        (host memory, disk), within each tier's ``max_pinned_fraction`` of capacity: a
        warmed system prompt stays cached whatever other traffic passes. Per tier name,
        how many of ``keys`` it has pinned now (-1: the tier failed). Chunks a tier does
        not hold are skipped, so call :meth:`flush` after storing. Disk pins survive
        restarts; host-memory pins last as long as this cache (or its sidecar)."""
        keys = checked_keys(keys)
        return self._require().pin(keys)

    def unpin_keys(self, keys: Sequence[ChunkKey] | None = None) -> dict[str, int]:
        """Make pinned chunks evictable again (``keys`` None: every pinned chunk this
        cache may unpin: every namespace's embedded, this client's namespace through a
        sidecar); per tier name, how many were pinned (-1: the tier failed)."""
        if keys is not None:
            keys = checked_keys(keys)
        return self._require().unpin(keys)

    def prefetch_keys(self, keys: Sequence[ChunkKey]) -> dict[str, int]:
        """Bring the leading cached chunks of ``keys`` into this node's fast tiers: each
        is read from the tier that holds it and promoted as a load promotes it (into
        host memory, and written to every tier above its source: a Redis or S3 hit lands
        on local disk), without being copied out. Reads ``PREFETCH_BATCH`` chunks at a
        time and stops at the first miss; waits for the writes (:meth:`flush`). Per
        source tier name, how many chunks came from it."""
        keys = checked_keys(keys)
        served: dict[str, int] = {}
        for start in range(0, len(keys), PREFETCH_BATCH):
            part = keys[start : start + PREFETCH_BATCH]
            with self.load_keys(part) as hit:
                count = len(hit.chunks)
                for chunk in hit.chunks:
                    served[chunk.tier] = served.get(chunk.tier, 0) + 1
            if count < len(part):
                break
        self.flush()
        return served

    def add_evict_listener(self, callback: EvictListener) -> None:
        """Call ``callback(key)`` with the key of every chunk the CPU tier evicts from
        now on (the chunk may still be in a lower tier). Registration is thread-safe;
        the callback runs inside the eviction, under the cache's lock, in the thread
        that caused it (the runtime's loop, or one calling ``store`` or
        ``put_encoded``), so it must be quick, thread-safe, and must not call back
        into this cache. One that raises is logged and ignored. A sidecar's client
        accepts it and never calls it: evictions happen in the sidecar."""
        self._require().add_evict_listener(callback)

    def remove_evict_listener(self, callback: EvictListener) -> None:
        """Stop calling ``callback`` (a no-op once the cache is closed)."""
        if self._started and not self._closed:
            self._store.remove_evict_listener(callback)

    def purge(self, cache_salt: str = "", *, dry_run: bool = False) -> dict[str, int]:
        """Delete every chunk of this model's namespace under ``cache_salt`` from every
        tier; chunks deleted by tier name (-1: the tier failed, -2: it cannot list).
        With ``dry_run``, delete nothing: count what would go."""
        return self._require().purge(self.namespace(cache_salt), dry_run=dry_run)

    def flush(self) -> None:
        """Wait until background writes queued so far have been attempted."""
        self._require().flush()

    def stats(self) -> dict[str, dict[str, object]]:
        """Per tier: counters (:class:`~lmtier.storage.stats.TierStats`), and what it
        holds where it can tell (``Tier.usage``: capacity, used, chunks, pins)."""
        return self._require().stats()

    # ---- the rest ------------------------------------------------------------------

    def _limited_keys(
        self,
        tokens: TokenInput,
        cache_salt: str,
        extras: ExtraKeys | None,
        max_tokens: int | None,
        skip_tokens: int = 0,
    ) -> list[ChunkKey]:
        if max_tokens is not None:
            require_int("max_tokens", max_tokens)
        require_int("skip_tokens", skip_tokens)
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
        """Flush background writes (up to ``close_flush_s``) and close the store (its
        tiers and runtime; a sidecar's client: its sessions, so the sidecar gets every
        slab back). Idempotent; the cache cannot be used (CacheClosedError) or started
        again afterwards. A program that exits without it gets the same close, from
        an exit hook (:mod:`lmtier.exiting`)."""
        self._close(None)

    def close_at_exit(self) -> None:
        """:meth:`close`, bounded for interpreter exit (:mod:`lmtier.exiting`): after
        ``close_flush_s`` plus ``EXIT_GRACE_S`` the process exits without waiting more."""
        self._close(self.config.close_flush_s + EXIT_GRACE_S)

    def _close(self, timeout_s: float | None) -> None:
        with self._lock:
            started, self._closed = self._started and not self._closed, True
        exiting.forget(self)
        if started:
            self._store.close(timeout_s)

    def __enter__(self) -> LMTier:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
