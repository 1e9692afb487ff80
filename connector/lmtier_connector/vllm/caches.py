"""The vLLM connector's caches, one per process and key, counted: both halves of a
connector in one process share one :class:`~lmtier.api.LMTier` (its CPU tier included),
and a forked child never uses its parent's (:class:`Caches`).
"""

from __future__ import annotations

import os
import threading

from lmtier.api import LMTier
from lmtier.config import LMTierConfig
from lmtier.kv_spec import KVSpec
from lmtier_connector.settings import SidecarSettings, open_engine_cache

__all__ = ["CacheKey", "Caches", "caches", "open_cache"]


CacheKey = tuple[LMTierConfig, KVSpec, str, str, int, int, SidecarSettings | None]
"""(config, geometry, model id, revision, TP size, TP rank, sidecar). The frozen config
itself, not its repr: a key may be printed or logged, and the config's secrets print
redacted (an unredacted repr of them must never sit in a key)."""


class Caches:
    """The started caches of this process, one per :data:`CacheKey`, counted.

    When vLLM runs the scheduler and the worker in one process (its in-process
    executor, tests), both halves share one cache, CPU tier included; in separate
    processes each half opens its own and they meet in the shared tiers. With a
    sidecar (the key's last part) the cache is a client of it
    (:func:`lmtier.connect`): every process meets in the sidecar's tiers,
    its CPU tier included.

    A forked child inherits this registry but not the threads, event loop and
    sockets behind the parent's caches, so it must never use them: every call first
    checks the process id (as redis-py's ``ConnectionPool._checkpid`` does) and, in
    a new process, forgets the parent's caches, unclosed (closing them would act on
    the parent's tiers and memory), and opens its own. The lock is made anew in a
    forked child, since one a parent's thread held at the fork stays held there.
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._entries: dict[CacheKey, tuple[LMTier, int]] = {}
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def _owned(self) -> dict[CacheKey, tuple[LMTier, int]]:
        """This process's entries (call holding the lock): none right after a fork."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._entries = {}
        return self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._owned())

    def acquire(self, key: CacheKey) -> LMTier:
        """The started cache of ``key`` in this process, opened on first use."""
        with self._lock:
            entries = self._owned()
            found = entries.get(key)
            if found is not None:
                entries[key] = (found[0], found[1] + 1)
                return found[0]
            cache = open_cache(key)
            entries[key] = (cache, 1)
            return cache

    def release(self, key: CacheKey) -> None:
        """Drop one use of ``key``'s cache; the last closes it (not one of a parent's)."""
        with self._lock:
            entries = self._owned()
            found = entries.pop(key, None)
            if found is None:
                return
            cache, count = found
            if count > 1:
                entries[key] = (cache, count - 1)
                return
        cache.close()


def open_cache(key: CacheKey) -> LMTier:
    """A started LMTier for ``key``: a sidecar's client, or a cache of its own."""
    config, spec, model_id, revision, tp_size, tp_rank, sidecar = key
    return open_engine_cache(
        config,
        spec,
        model_id=model_id,
        model_revision=revision,
        tp_size=tp_size,
        tp_rank=tp_rank,
        sidecar=sidecar,
        engine="vllm",
    )


caches = Caches()
"""This process's registry: every :class:`~lmtier_connector.vllm.connector.LMTierConnector`
acquires its cache here and releases it at ``shutdown``."""
