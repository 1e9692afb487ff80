"""The Redis tier: one Redis string per chunk, holding the chunk format's bytes unchanged.

Keys::

    <key_prefix><namespace hex>:<chain hex>     e.g. lmtier:6c6d...21:9f3a...07

32 hex digits each (:func:`lmtier.chunks.keys.split_key`), so an operator can list or drop
one model revision's or one tenant's chunks with ``SCAN MATCH <prefix><ns>:*``. There
are no hash tags: in a Redis Cluster the chunks of one prompt spread over every slot
and master (a ``{`` in ``key_prefix`` would pin them all to one slot; it is logged).

Writes: one ``SET key value [PX ttl]`` per chunk, no metadata key (the chunk carries
its own header and checksums), sent concurrently over the pool. The value leaves the
caller's pool slab as memoryview slices, never copied into a bytes object: commands
are packed by :mod:`lmtier_backends.redis.wire`, not by redis-py's hiredis packer
(which copies every value), whether or not hiredis is installed.

Reads: one ``GET`` per chunk (``GETEX key PX ttl`` when ``refresh_ttl_on_hit``, so a
hit renews the TTL in the same command), concurrent up to ``max_connections``; single
large GETs beat pipelined ones here. Each value is received straight into its buffer
(``recv_into`` the slab, no copy in Python). A value larger than its buffer, or a key
of another type under a chunk's name (WRONGTYPE), can never be served: it is
unservable, deleted and counted (``Tier.get_into``), so EXISTS stops finding it.

Lookups: ``contains`` sends one pipelined batch of ``EXISTS key`` per key (per-key
answers, to count the leading run) as a single write: one round trip standalone, one
per master in a cluster (concurrently). Deletes are pipelined ``DEL``-s the same way.
A purge ``SCAN``-s every master for ``<key_prefix><namespace hex>:*`` (the prefix's
glob metacharacters escaped) and ``UNLINK``-s each page of ``PURGE_PAGE`` names.

TTL: ``ttl_s`` (None: keys live until Redis evicts them; configure ``maxmemory`` and an
``allkeys-lru`` policy for a cache) is set on every SET and, with
``refresh_ttl_on_hit``, renewed by every read that hits.

Cluster mode: ``cluster=True``/``False`` on :meth:`RedisTier.open`; None (the default,
and what :func:`~lmtier_backends.redis.open_tier` uses) asks the server at open
(``INFO cluster``) for ``redis://``/``rediss://`` URLs; ``unix://`` is always
standalone. A ``MOVED``/``ASK`` reply (resharding) sends that one command through
redis-py's cluster client, which follows the redirect and updates its slot map.

Failures: a refused, reset or timed-out connection raises
:class:`~lmtier.errors.BackendUnavailable` or :class:`~lmtier.errors.BackendTimeout`
(translated here, ``from`` the redis error) when a call got nothing done, so the
StorageManager's breaker sees it; when part of a batch succeeded, the rest are misses
(or unstored chunks) counted in ``stats.errors``. Reads (GET, EXISTS) retry a lost
connection twice with exponential backoff (5 ms, 10 ms); writes are never retried.
A command that sees no progress for ``BACKSTOP * timeout_s`` fails with BackendTimeout:
a backstop for callers without a guard. The StorageManager bounds whole calls by the
tier's ``budget``: ``timeout_s`` plus the call's bytes at ``min_bytes_per_s`` (plus
``lookup_key_s`` per key looked up), and gives up on a call once ``io_progress``
(ticked whenever bytes move on any connection) has stood still for ``timeout_s`` of
time the process could watch (:mod:`lmtier.storage.guard`): it, not a wall-clock
timer, tells a hung server from a starved process, so the tier's own timers wait
longer. The URL's password never appears in logs, reprs or messages
(:func:`lmtier.config.secrets.redact_url`).

Stats: ``lookups``, ``puts``, ``bytes_written``, and ``errors`` for failures the tier
absorbs (part of a batch, a chunk Redis refused to store); ``get_into`` counts hits,
misses, bytes read and corrupt chunks. Latencies, and the errors of calls that raise,
are recorded by the StorageManager, which wraps every tier call.

Close: sockets are aborted, not drained (:mod:`lmtier_backends.redis.wire`), and the
whole close is bounded by ``CLOSE_TIMEOUT_S``, so it returns promptly even when the
server is dead or stopped. Idempotent; calls after close raise BackendUnavailable.
"""

from __future__ import annotations

import asyncio
import logging
from binascii import hexlify
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from contextlib import asynccontextmanager

from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from lmtier.chunks.keys import NAMESPACE_BYTES, ChunkKey, split_key
from lmtier.config.policy import DEFAULT_QUEUE_DEPTH, WritePolicy
from lmtier.config.secrets import SecretURL
from lmtier.errors import BackendError, BackendTimeout, BackendUnavailable
from lmtier.storage.budget import CallBudget, Progress
from lmtier.storage.failures import ExceptionMap, FailureLog, Rule, settle
from lmtier.storage.stats import TierStats
from lmtier.storage.tier import (
    UNSERVABLE,
    Buffer,
    Tier,
    TierProperties,
)
from lmtier_backends.redis.client import Node, Route, match_prefix, open_route
from lmtier_backends.redis.wire import Reply, exchange, pack_command, pack_key_commands

__all__ = ["CLOSE_TIMEOUT_S", "RedisTier"]

logger = logging.getLogger(__name__)

BACKSTOP = 2.0
"""The tier's own timers (redis-py's socket timeout, the exchange's no-progress
watchdog) wait ``BACKSTOP * timeout_s``. At ``timeout_s`` they raced the guard's
watched-time stall check, and a wall-clock timer on a starved event loop fires in the
same turn as the reply it was waiting for, failing a live server's answer."""

CLOSE_TIMEOUT_S = 0.5
"""Upper bound of :meth:`RedisTier.close`; sockets are aborted, so it rarely takes 1 ms."""
PURGE_PAGE = 1000
"""A purge's SCAN ``COUNT`` hint, and so about the most names one UNLINK carries."""

_REDIRECTS = (b"-MOVED ", b"-ASK ", b"-TRYAGAIN", b"-CLUSTERDOWN")
# Replies that say the server cannot serve anyone right now (not this one key): raised,
# so the breaker sees them. Other errors (OOM, WRONGTYPE) are about one command.
_SERVER_ERRORS = (b"-NOAUTH", b"-WRONGPASS", b"-NOPERM", b"-LOADING", b"-MASTERDOWN", b"-BUSY")
_TIER_FAILURES = (RedisError, OSError, BackendError)
_RULES = (
    Rule((RedisTimeoutError, asyncio.TimeoutError), BackendTimeout, tier_level=True),
    Rule((RedisError, OSError), BackendUnavailable, tier_level=True),
)
"""redis-py's exceptions as lmtier's: every one raised says the server is failing (a
command's own refusal, like OOM, is a reply the tier reads, never an exception)."""


class RedisTier(Tier):
    """Chunks as Redis strings, standalone or on a Redis Cluster (module docstring).

    ``await RedisTier.open(url, ...)`` (or :func:`~lmtier_backends.redis.open_tier` from a
    config); the constructor does no I/O.
    """

    def __init__(
        self,
        url: str | SecretURL,
        *,
        key_prefix: str = "lmtier:",
        ttl_s: float | None = None,
        refresh_ttl_on_hit: bool = False,
        timeout_s: float = 0.5,
        min_bytes_per_s: float = 64 * 1024**2,
        lookup_key_s: float = 0.0001,
        max_connections: int = 16,
        cluster: bool | None = None,
        read_retries: int = 2,
        write_policy: WritePolicy = "write_through",
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        name: str = "redis",
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        if read_retries < 0:
            raise ValueError(f"read_retries must be >= 0, got {read_retries}")
        self.name = name
        self.url = url if isinstance(url, SecretURL) else SecretURL(url)
        self.properties = TierProperties(
            shared=True, write_policy=write_policy, queue_depth=queue_depth, timeout_s=timeout_s
        )
        self.stats = TierStats()
        self._failures = FailureLog(name, self.stats)
        self._exceptions = ExceptionMap(f"redis tier {name!r} at {self.url}", _RULES)
        self.key_prefix = key_prefix
        self._prefix = key_prefix.encode()
        self.ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        """TTL set by every SET (and renewed by hits with ``refresh_ttl_on_hit``)."""
        self.refresh_ttl_on_hit = refresh_ttl_on_hit
        self.timeout_s = timeout_s
        self._command_timeout_s = BACKSTOP * timeout_s
        self.budget = CallBudget(timeout_s, min_bytes_per_s or None, lookup_key_s)
        """The deadline of each call, read by the StorageManager's guard."""
        self.io_progress = Progress()
        """Ticked whenever bytes move on any connection: a hung server stops it."""
        self.max_connections = max_connections
        self.cluster = cluster
        """Cluster mode as asked: True, False, or None (detect at open)."""
        self._route: Route | None = None
        self._closed = False
        # Every command holds a permit while it holds a connection, and uses at most one
        # connection per node, so no pool (one per master in a cluster) runs dry.
        self._permits = asyncio.Semaphore(max_connections)
        self._read_retry = Retry(
            ExponentialBackoff(cap=0.05, base=0.0025),
            read_retries,
            supported_errors=(RedisConnectionError,),
        )

    async def start(self) -> None:
        """Connect (detecting a cluster when ``cluster`` is None) and check the server
        answers. Raises BackendUnavailable / BackendTimeout when it does not."""
        try:
            self._route = await open_route(
                url=self.url.reveal(),
                cluster=self.cluster,
                max_connections=self.max_connections,
                timeout_s=self._command_timeout_s,
            )
        except _TIER_FAILURES as exc:
            raise self._exceptions.error(exc, "open") from exc
        if "{" in self.key_prefix and self.is_cluster:
            msg = "%s: key_prefix %r may hold a hash tag: chunks could share one cluster slot"
            logger.warning(msg, self.name, self.key_prefix)
        logger.info(
            "%s: %s at %s, %d connection(s) per node, ttl %s",
            self.name,
            "Redis Cluster" if self.is_cluster else "Redis",
            self.url,
            self.max_connections,
            "none" if self.ttl_ms is None else f"{self.ttl_ms / 1000} s",
        )

    @property
    def is_cluster(self) -> bool:
        """Whether the open tier talks to a Redis Cluster."""
        return self._route is not None and self._route.is_cluster

    def redis_key(self, key: ChunkKey) -> bytes:
        """The Redis key of chunk ``key``: ``<prefix><namespace hex>:<chain hex>``."""
        namespace, chain = split_key(key)
        return self._prefix + hexlify(namespace) + b":" + hexlify(chain)

    def _names(self, keys: Sequence[ChunkKey]) -> list[bytes]:
        # redis_key inlined: a lookup names every key it asks about, and this is most of
        # its Python time (hexlify gives bytes directly; bytes.hex() then encode is 2x).
        prefix, cut = self._prefix, NAMESPACE_BYTES
        return [prefix + hexlify(key[:cut]) + b":" + hexlify(key[cut:]) for key in keys]

    def __repr__(self) -> str:
        state = "open" if self._route is not None else "closed" if self._closed else "not open"
        return f"RedisTier(name={self.name!r}, url={str(self.url)!r}, {state})"

    # ---- the Tier interface ---------------------------------------------------------

    async def contains(self, keys: Sequence[ChunkKey]) -> int:
        if not keys:
            return 0
        route = self._require_route()
        self.stats.lookups += len(keys)
        names = self._names(keys)
        try:
            replies = await self._read_retry.call_with_retry(
                lambda: self._pipelined(route, b"EXISTS", names), self._before_retry
            )
            found = 0
            for name, reply in zip(names, replies, strict=True):
                if reply == b":0" or (
                    reply != b":1" and not await self._integer(route, b"EXISTS", name, reply)
                ):
                    break
                found += 1
        except _TIER_FAILURES as exc:
            raise self._exceptions.error(exc, "contains") from exc
        return found

    async def _read_into(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        if not keys:
            return []
        route = self._require_route()
        outcomes = await asyncio.gather(
            *(self._get(route, key, buffer) for key, buffer in zip(keys, buffers, strict=True)),
            return_exceptions=True,
        )
        sizes = [None if isinstance(outcome, BaseException) else outcome for outcome in outcomes]
        settle(self._failures, self._exceptions, "get", outcomes)
        return sizes

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> int:
        if not items:
            return 0
        route = self._require_route()
        latest = {key: _byte_view(data) for key, data in items}  # the last of each key wins
        outcomes = await asyncio.gather(
            *(self._set(route, self.redis_key(key), view) for key, view in latest.items()),
            return_exceptions=True,
        )
        stored = 0
        for view, outcome in zip(latest.values(), outcomes, strict=True):
            if outcome is True:
                stored += 1
                self.stats.bytes_written += len(view)
        self.stats.puts += stored
        settle(self._failures, self._exceptions, "put", outcomes)
        return stored

    async def delete(self, keys: Sequence[ChunkKey]) -> int:
        if not keys:
            return 0
        route = self._require_route()
        names = self._names(list(dict.fromkeys(keys)))
        try:
            replies = await self._pipelined(route, b"DEL", names)
            return sum(
                [
                    await self._integer(route, b"DEL", name, reply)
                    for name, reply in zip(names, replies, strict=True)
                ]
            )
        except _TIER_FAILURES as exc:
            raise self._exceptions.error(exc, "delete") from exc

    async def _count_namespace(self, namespace: bytes) -> int:
        return await self._purge(namespace, unlink=False)

    async def _purge(self, namespace: bytes, *, unlink: bool = True) -> int:
        # One SCAN page then its UNLINK (freed off the server's main thread) at a time,
        # each reply ticking progress: a long purge lives, a hung server is caught.
        route = self._require_route()
        pattern = match_prefix(self._prefix + hexlify(namespace) + b":")
        found = 0
        try:
            await route.refresh()
            async with self._permit():
                for node in route.primaries():
                    cursor: int | None = None  # None: not started; 0: done
                    while cursor != 0:
                        cursor, names = await route.scan(node, cursor or 0, pattern, PURGE_PAGE)
                        self.io_progress.tick()
                        if names:
                            found += await route.client.unlink(*names) if unlink else len(names)
                            self.io_progress.tick()
        except _TIER_FAILURES as exc:
            raise self._exceptions.error(exc, "purge") from exc
        return found

    async def close(self) -> None:
        """Abort every connection, within ``CLOSE_TIMEOUT_S`` whatever the server does."""
        route, self._route = self._route, None
        self._closed = True
        if route is None:
            return
        try:
            await asyncio.wait_for(route.aclose(), CLOSE_TIMEOUT_S)
        except (asyncio.TimeoutError, *_TIER_FAILURES) as exc:
            logger.warning("%s: close at %s did not finish cleanly: %r", self.name, self.url, exc)

    # ---- commands -------------------------------------------------------------------

    @asynccontextmanager
    async def _permit(self) -> AsyncIterator[None]:
        async with self._permits:
            if self._route is None:  # closed while this command waited for a permit
                raise BackendUnavailable(f"redis tier {self.name!r} is closed")
            yield

    async def _pipelined(self, route: Route, command: bytes, names: list[bytes]) -> list[Reply]:
        """``command name`` for every name, pipelined: one write and one round trip per
        node (nodes concurrently); the replies in the order of ``names``."""
        await route.refresh()
        groups = route.group(names)
        if len(groups) == 1:
            return await self._pipeline_on(route, groups[0][0], command, names)
        replies: list[Reply] = [None] * len(names)

        async def on_node(node: Node, indices: list[int]) -> None:
            got = await self._pipeline_on(route, node, command, [names[i] for i in indices])
            for index, reply in zip(indices, got, strict=True):
                replies[index] = reply

        await _all(on_node(node, indices) for node, indices in groups)
        return replies

    async def _pipeline_on(
        self, route: Route, node: Node, command: bytes, names: list[bytes]
    ) -> list[Reply]:
        request = pack_key_commands(command, names)
        async with self._permit(), route.connection(node) as conn:
            return await exchange(
                conn, [request], len(names), timeout=self._command_timeout_s, meter=self.io_progress
            )

    async def _integer(self, route: Route, command: bytes, name: bytes, reply: Reply) -> int:
        """The integer reply of ``command name``, following a cluster redirect."""
        if isinstance(reply, bytes) and reply[:1] == b":":
            return int(reply[1:])
        if self._redirected(route, reply):
            result: int = await route.client.execute_command(command, name)
            return result
        raise ResponseError(f"{command.decode()} answered {_shown(reply)}")

    async def _get(self, route: Route, key: ChunkKey, buffer: memoryview) -> int | None:
        name = self.redis_key(key)
        sink = _byte_view(buffer)
        if self.refresh_ttl_on_hit and self.ttl_ms is not None:
            command = pack_command("GETEX", name, "PX", self.ttl_ms)
        else:
            command = pack_command("GET", name)

        async def attempt() -> Reply:
            async with self._permit(), route.connection(route.node_of(name)) as conn:
                (reply,) = await exchange(
                    conn,
                    command,
                    1,
                    [sink],
                    timeout=self._command_timeout_s,
                    meter=self.io_progress,
                )
            return reply

        await route.refresh()
        reply = await self._read_retry.call_with_retry(attempt, self._before_retry)
        if isinstance(reply, int):
            if reply <= len(sink):
                return reply
            logger.debug("%s: %s holds %d bytes, more than its buffer", self.name, name, reply)
            return UNSERVABLE
        if reply is None:
            return None
        if self._redirected(route, reply):
            return await self._get_redirected(route, name, sink)
        if reply.startswith(_SERVER_ERRORS):
            raise ResponseError(f"GET answered {_shown(reply)}")
        logger.debug("%s: GET %s answered %s", self.name, name, _shown(reply))
        # A key of another type under our name can never be read as a chunk.
        return UNSERVABLE if reply.startswith(b"-WRONGTYPE") else None

    async def _get_redirected(self, route: Route, name: bytes, sink: memoryview) -> int | None:
        if self.refresh_ttl_on_hit and self.ttl_ms is not None:
            value = await route.client.execute_command("GETEX", name, "PX", self.ttl_ms)
        else:
            value = await route.client.execute_command("GET", name)
        if value is None:
            return None
        if len(value) > len(sink):
            return UNSERVABLE
        sink[: len(value)] = value
        return len(value)

    async def _set(self, route: Route, name: bytes, view: memoryview) -> bool:
        args: tuple[bytes | str | int | memoryview, ...] = ("SET", name, view)
        if self.ttl_ms is not None:
            args += ("PX", self.ttl_ms)
        await route.refresh()
        async with self._permit(), route.connection(route.node_of(name)) as conn:
            (reply,) = await exchange(
                conn,
                pack_command(*args),
                1,
                timeout=self._command_timeout_s,
                meter=self.io_progress,
            )
        if reply == b"+OK":
            return True
        if self._redirected(route, reply):
            await route.client.execute_command(*args)
            return True
        if isinstance(reply, bytes) and reply.startswith(_SERVER_ERRORS):
            raise ResponseError(f"SET answered {_shown(reply)}")
        self._failures.record("SET", f"{name!r} answered {_shown(reply)}: not stored", "refused")
        return False

    def _redirected(self, route: Route, reply: Reply) -> bool:
        """Whether ``reply`` is a cluster redirect; the caller then repeats the command
        through redis-py's cluster client, which follows it and updates its slot map."""
        if not (isinstance(reply, bytes) and reply.startswith(_REDIRECTS)):
            return False
        if not route.is_cluster:
            raise ResponseError(
                f"{_shown(reply)}: the server is a cluster node; open the tier with cluster=True"
            )
        return True

    async def _before_retry(self, error: Exception) -> None:
        logger.debug("%s: retrying a read after %r", self.name, error)

    # ---- failures -------------------------------------------------------------------

    def _require_route(self) -> Route:
        if self._route is None:
            state = "closed" if self._closed else "not open (use RedisTier.open)"
            raise BackendUnavailable(f"redis tier {self.name!r} at {self.url} is {state}")
        return self._route


async def _all(calls: Iterable[Awaitable[None]]) -> None:
    """Run coroutines concurrently; raise the first failure once all have finished."""
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome


def _byte_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _shown(reply: Reply) -> str:
    return repr(reply[:200]) if isinstance(reply, bytes) else repr(reply)
