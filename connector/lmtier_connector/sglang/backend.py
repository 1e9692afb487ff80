"""lmtier as SGLang's HiCache storage backend (its "L3"): :class:`LMTierStorage`.

SGLang (0.5.23) loads it with ``--hicache-storage-backend dynamic`` and
``--hicache-storage-backend-extra-config '{"backend_name": "lmtier", "module_path":
"lmtier_connector.sglang", "class_name": "LMTierStorage", "interface_v1": 1, ...}'``
(docs/sglang.md). SGLang builds it with ``(storage_config, kwargs)``, then registers
its host KV pool (:meth:`register_mem_pool_host`); the cache is opened then, since the
pool names the geometry (one page is one chunk: :mod:`.pages`).

* Zero-copy path (``interface_v1``): :meth:`batch_get_v1` / :meth:`batch_set_v1`
  move pages between lmtier's slabs and SGLang's host pool at ``host_indices``, one
  copy each way; :meth:`batch_exists` is one lookup of every tier (the leading run).
* SGLang's older API (:meth:`get`, :meth:`batch_get`, :meth:`set`, :meth:`batch_set`,
  :meth:`exists`) with its flat page tensors, the same bytes and keys.
* Keys: SGLang's page hashes (a chain from the sequence's start, seeded by its
  cache salt) bound into lmtier's namespace, which names the model (``model_id``,
  ``model_revision``), the geometry, the dtype, the page size, the TP rank (MHA; an
  MLA page is the same on every rank) and the extra config's ``cache_salt``: two
  servers of one model share pages through every shared tier, and no other model,
  geometry or rank ever matches.
* Failures are misses: SGLang's threads never see an exception from a storage
  call; a page that is not loaded whole is reported ``False`` and its bytes are not
  counted as loaded.
* Hybrid models (Mamba, SWA, indexer pools: SGLang's v2 API) are refused when SGLang
  registers their pools, naming them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from lmtier.api import LMTier
from lmtier.chunks.keys import ChunkKey, Namespace
from lmtier.errors import ConfigError
from lmtier_connector.settings import open_engine_cache
from lmtier_connector.sglang.pages import PoolPages
from lmtier_connector.sglang.settings import WHERE, BackendSettings

__all__ = ["LMTierStorage", "bind_page_hash"]

logger = logging.getLogger(__name__)

_BIND_TAG = b"lmtier/sglang-page\0"
BOUND_KEYS = 1 << 16
"""Page hashes whose keys a backend remembers (~10 MiB)."""
T = TypeVar("T")


def bind_page_hash(namespace: Namespace, page_hash: str) -> ChunkKey:
    """The storage key of the SGLang page whose hash is ``page_hash``, in
    ``namespace``: equal across processes and machines for equal inputs."""
    digest = namespace.digest
    return ChunkKey(digest + xxhash.xxh3_128_digest(_BIND_TAG + digest + page_hash.encode()))


class LMTierStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang is untyped
    """SGLang's HiCache L3 over an lmtier cache (module docstring). Thread-safe: SGLang
    calls it from its prefetch and backup threads at once."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        config = storage_config
        for name, value in (
            ("pp_size", config.pp_size),
            ("attn_cp_size", config.attn_cp_size),
            ("dcp_size", getattr(config, "dcp_size", 1)),
        ):
            if value != 1:
                raise ConfigError(
                    f"lmtier's SGLang backend serves one pipeline stage and no context "
                    f"parallelism; this server has {name}={value}"
                )
        if getattr(config, "should_split_heads", False):
            raise ConfigError("lmtier's SGLang backend does not split heads (page_head layout)")
        self.settings = BackendSettings.from_extra_config(config.extra_config)
        model_id = self.settings.model_id or (config.model_name or "")
        if not model_id.strip():
            raise ConfigError(
                f"SGLang gave no model name: set model_id in the {WHERE} "
                "(servers that share pages must agree on it)"
            )
        self.model_id = model_id
        self.mem_pool_host: Any = None
        self._pages: PoolPages | None = None
        self._cache: LMTier | None = None
        self._namespace: Namespace | None = None
        self._lock = threading.Lock()
        self._metrics: dict[str, list[Any]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }
        self._warned: set[str] = set()
        self._bound: dict[str, ChunkKey] = {}

    # ---- attach ----------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host KV pool and open the cache its geometry names."""
        pages = PoolPages.of(mem_pool_host)
        config, settings = self.storage_config, self.settings
        try:  # lmtier's config keeps the rule for chunk sizes; SGLang's user gets the flag
            lmtier_config = settings.config.replace(chunk_size=pages.page_size)
        except ConfigError as exc:
            raise ConfigError(
                f"SGLang's pages hold {pages.page_size} tokens, not an lmtier chunk size "
                f"({exc}): start SGLang with --page-size 64 (or another multiple of 16)"
            ) from None
        super().register_mem_pool_host(mem_pool_host)
        mla = pages.mla or bool(config.is_mla_model)
        with self._lock:
            if self._cache is not None:
                if self._pages is not None and self._pages.spec != pages.spec:
                    raise ConfigError("a second host pool of another geometry was registered")
                self._pages = pages
                return
            cache = open_engine_cache(
                lmtier_config,
                pages.spec,
                model_id=self.model_id,
                model_revision=settings.model_revision,
                tp_size=1 if mla else config.tp_size,
                tp_rank=0 if mla else config.tp_rank,
                sidecar=settings.sidecar,
                engine="sglang",
            )
            self._pages, self._cache = pages, cache
            self._namespace = cache.namespace(settings.cache_salt)
        logger.info(
            "lmtier HiCache backend: %s pages of %d tokens (%s), %s, model %r rank %d/%d",
            pages.layout,
            pages.page_size,
            pages.spec,
            "sidecar " + settings.sidecar.target if settings.sidecar else "embedded",
            self.model_id,
            0 if mla else config.tp_rank,
            1 if mla else config.tp_size,
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang registers every host pool here, the KV pool included; any other pool
        (Mamba, SWA, an indexer: a hybrid model) is refused, naming it."""
        if str(getattr(host_pool_name, "value", host_pool_name)) == "kv":
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        raise ConfigError(
            f"lmtier's SGLang backend stores the KV pool only; this model also has a "
            f"{getattr(host_pool_name, 'value', host_pool_name)!s} pool "
            f"({type(host_pool).__name__}): hybrid models are not supported"
        )

    def close(self) -> None:
        """Close the cache (writes queued so far land first, within ``close_flush_s``)."""
        with self._lock:
            cache, self._cache = self._cache, None
        if cache is not None:
            cache.close()

    # ---- keys --------------------------------------------------------------------------

    def _ready(self) -> tuple[LMTier, PoolPages, Namespace]:
        cache, pages, namespace = self._cache, self._pages, self._namespace
        if cache is None or pages is None or namespace is None:
            raise ConfigError("no host pool registered (or the backend was closed)")
        return cache, pages, namespace

    def keys_of(self, page_hashes: Sequence[str]) -> list[ChunkKey]:
        """lmtier's keys of SGLang's page hashes (:func:`bind_page_hash`). SGLang asks
        about the same pages again and again (a lookup, then the prefetch; every turn
        of a conversation): the keys bound last are remembered (up to
        :data:`BOUND_KEYS`), so a lookup of 256 pages does not hash 256 strings."""
        bound = self._bound
        try:
            return [bound[h] for h in page_hashes]
        except KeyError:
            pass
        namespace = self._ready()[2]
        keys = []
        for page_hash in page_hashes:
            key = bound.get(page_hash)
            if key is None:
                key = bind_page_hash(namespace, page_hash)
                if len(bound) >= BOUND_KEYS:
                    bound.clear()  # simpler than an LRU, and as good for prefixes seen again
                bound[page_hash] = key
            keys.append(key)
        return keys

    def _guarded(self, what: str, fallback: T, call: Callable[[], T]) -> T:
        """``call()``, or ``fallback`` with the error logged (the first of each kind
        with its traceback): a storage call never raises into SGLang's threads."""
        try:
            return call()
        except Exception as exc:
            kind = f"{what}:{type(exc).__name__}"
            first = kind not in self._warned
            self._warned.add(kind)
            logger.warning(
                "lmtier HiCache %s failed, served as a miss: %s", what, exc, exc_info=first
            )
            return fallback

    # ---- the zero-copy path (interface_v1) -------------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages of ``keys`` some tier holds (one lookup of all)."""
        if not keys:
            return 0
        return self._guarded(
            "lookup", 0, lambda: self._ready()[0].lookup_keys(self.keys_of(keys)).num_chunks
        )

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load the leading pages of ``keys`` that some tier holds into the host pool at
        ``host_indices``; per page, whether it was loaded."""
        if not keys:
            return []

        def load() -> int:
            pages = self._ready()[1]
            starts = pages.starts(host_indices, len(keys))
            return self._load(keys, [pages.page(s) for s in starts])

        return self._loaded(len(keys), self._guarded("load", 0, load))

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the pages of ``keys`` from the host pool at ``host_indices``; per page,
        whether lmtier holds it now (stored, or held already)."""
        if not keys:
            return []

        def store() -> int:
            pages = self._ready()[1]
            starts = pages.starts(host_indices, len(keys))
            return self._store(keys, [pages.page(s) for s in starts])

        return self._loaded(len(keys), self._guarded("store", 0, store))

    # ---- SGLang's older API: flat page tensors ---------------------------------------

    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0]

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        """Load the leading pages of ``keys`` into ``target_locations`` (SGLang's flat
        page tensors; new ones when None); None for each page not loaded."""
        if not keys:
            return []

        def load() -> list[torch.Tensor | None]:
            pages = self._ready()[1]
            targets = list(target_locations) if target_locations is not None else None
            if targets is None:
                targets = [pages.new_flat() for _ in keys]
            if len(targets) != len(keys):
                raise ValueError(f"{len(targets)} target pages for {len(keys)} keys")
            count = self._load(keys, [pages.flat(t) for t in targets])
            return [*targets[:count], *([None] * (len(keys) - count))]

        return self._guarded("load", [None] * len(keys), load)

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store each of ``values`` (SGLang's flat pages) as the page of its key; True
        when lmtier holds every one now."""
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            return False

        def store() -> int:
            pages = self._ready()[1]
            return self._store(keys, [pages.flat(v) for v in values])

        return self._guarded("store", 0, store) == len(keys)

    # ---- moving pages ----------------------------------------------------------------

    def _load(self, keys: Sequence[str], places: Sequence[torch.Tensor]) -> int:
        """Copy the leading pages some tier holds into ``places`` (chunk-layout views);
        how many. One shared copy for the whole batch (:meth:`lmtier.LoadResult.copy_to`)."""
        cache = self._ready()[0]
        started = time.perf_counter()
        with cache.load_keys(self.keys_of(keys)) as hit:
            count = hit.copy_to(places)
        self._record("prefetch", count, time.perf_counter() - started)
        return count

    def _store(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> int:
        """Store the pages the local tiers do not hold (:meth:`lmtier.LMTier.hold_pages`:
        no lookup round trip of its own; SGLang backs up pages it computed, which it
        did not find here); how many leading pages lmtier holds now."""
        cache = self._ready()[0]
        started = time.perf_counter()
        held = cache.hold_pages(self.keys_of(keys), list(pages))
        self._record("backup", held, time.perf_counter() - started)
        return held

    @staticmethod
    def _loaded(total: int, count: int) -> list[bool]:
        return [True] * count + [False] * (total - count)

    # ---- operations --------------------------------------------------------------------

    def clear(self) -> None:
        """Delete every page of this server's namespace (model, geometry, rank, salt)
        from every tier."""

        def purge() -> None:
            cache = self._ready()[0]
            counts = cache.purge(self.settings.cache_salt)
            logger.info("lmtier HiCache clear: pages deleted by tier %s", counts)

        self._guarded("clear", None, purge)

    def _record(self, kind: str, pages: int, seconds: float) -> None:
        if not self.storage_config.enable_storage_metrics or pages <= 0:
            return
        page_bytes = self._ready()[1].page_bytes
        with self._lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(pages * page_bytes / max(seconds, 1e-9) / 1e9)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` of the calls since the last call (pages per call
        and GB/s), or None without ``--enable-metrics``; lmtier's own counters per
        tier are in :meth:`lmtier_stats`."""
        if not self.storage_config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics  # noqa: PLC0415

        with self._lock:
            taken = {name: values[:] for name, values in self._metrics.items()}
            for values in self._metrics.values():
                values.clear()
        return StorageMetrics(**taken)

    def flush(self) -> None:
        """Wait until the writes queued so far have landed in every tier (SGLang never
        calls it; a benchmark or a shutdown script may)."""
        self._ready()[0].flush()

    def lmtier_stats(self) -> dict[str, dict[str, object]]:
        """lmtier's counters per tier (:meth:`lmtier.LMTier.stats`)."""
        return self._ready()[0].stats()
