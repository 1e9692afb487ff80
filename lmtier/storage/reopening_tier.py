"""A stand-in for a remote tier that was unreachable at start-up.

A dead Redis or S3 must cost misses, not availability: if it is down when lmtier
starts, the cache opens without it and :class:`ReopeningTier` takes its place. Every
call first tries to open the real tier, at most once per backoff interval (doubling
up to a cap); until it opens, calls raise BackendUnavailable, which the
StorageManager counts and feeds to the tier's circuit breaker like any failing tier.
Once open, every call goes straight to the real tier, and its counters are this
stand-in's, so the stats keep one history.

The real tier's properties are unknown until it opens, and the StorageManager reads
them once, so the stand-in declares those of a shared remote tier, with the write
policy, queue depth and timeout its config section names, and the call budget
(:mod:`lmtier.storage.budget`) its ``timeout_s``, ``min_bytes_per_s`` and
``lookup_key_s`` name. It owns the progress meter the guard watches and hands it to
the real tier when that opens, as it hands over its stats.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from lmtier.chunks.keys import ChunkKey
from lmtier.errors import BackendError, BackendUnavailable
from lmtier.storage.budget import CallBudget, Progress
from lmtier.storage.stats import TierStats
from lmtier.storage.tier import Buffer, CheckedRead, Tier, TierProperties

__all__ = ["ReopeningTier"]

logger = logging.getLogger(__name__)


class ReopeningTier(Tier):
    """Opens ``opener()``'s tier on first use after a backoff; delegates once open."""

    def __init__(
        self,
        name: str,
        opener: Callable[[], Awaitable[Tier]],
        section: object = None,
        *,
        retry_after_s: float = 2.0,
        max_retry_after_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.properties = TierProperties(
            shared=True,
            write_policy=getattr(section, "write_policy", "write_through"),
            queue_depth=getattr(section, "queue_depth", 256),
            timeout_s=getattr(section, "timeout_s", None),
        )
        self.stats = TierStats()
        timeout_s = self.properties.timeout_s
        if timeout_s is not None:
            self.budget = CallBudget(
                timeout_s,
                getattr(section, "min_bytes_per_s", None) or None,
                getattr(section, "lookup_key_s", 0.0),
            )
        self.io_progress = Progress()
        self._opener = opener
        self._clock = clock
        self._retry_after_s = retry_after_s
        self._max_retry_after_s = max_retry_after_s
        self._next_try = clock() + retry_after_s  # the first open just failed
        self._inner: Tier | None = None
        self._closed = False

    async def _tier(self) -> Tier:
        if self._inner is not None:
            return self._inner
        if self._closed:
            raise BackendUnavailable(f"{self.name}: closed")
        now = self._clock()
        if now < self._next_try:
            raise BackendUnavailable(
                f"{self.name}: not reachable yet; next try in {self._next_try - now:.1f} s"
            )
        try:
            inner = await self._opener()
        except BackendError as exc:
            self._retry_after_s = min(self._retry_after_s * 2, self._max_retry_after_s)
            self._next_try = self._clock() + self._retry_after_s
            raise BackendUnavailable(f"{self.name}: still not reachable: {exc}") from exc
        inner.stats = self.stats
        if hasattr(inner, "io_progress"):
            inner.io_progress = self.io_progress  # the meter the guard already watches
        self._inner = inner
        logger.warning("%s tier is reachable again and now in use", self.name)
        return inner

    def contains_now(self, keys: Sequence[ChunkKey]) -> int | None:
        return None if self._inner is None else self._inner.contains_now(keys)

    async def contains(self, keys: Sequence[ChunkKey]) -> int:
        return await (await self._tier()).contains(keys)

    async def _read_into(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        return await (await self._tier())._read_into(keys, buffers)

    async def _read_checked(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview]
    ) -> Sequence[int | CheckedRead | None]:
        return await (await self._tier())._read_checked(keys, buffers)

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> int:
        return await (await self._tier()).put(items)

    async def delete(self, keys: Sequence[ChunkKey]) -> int:
        return await (await self._tier()).delete(keys)

    async def _purge(self, namespace: bytes) -> int:
        # The real tier's own: its counters are ours already (``stats`` is shared).
        return await (await self._tier())._purge(namespace)

    async def _count_namespace(self, namespace: bytes) -> int:
        return await (await self._tier())._count_namespace(namespace)

    async def close(self) -> None:
        self._closed = True
        if self._inner is not None:
            await self._inner.close()
