"""Connections of the Redis tier: one routing interface over a standalone server and a
Redis Cluster, built on redis-py's pools and topology, with our connection classes.

A :class:`Route` answers three questions for the tier: which node serves a key
(:meth:`Route.node_of`), how a batch of keys splits by node (:meth:`Route.group`,
so a pipelined batch is one round trip per node), and how to borrow a connected
connection to a node (:meth:`Route.connection`); and it lists keys by prefix on every
node that holds some (:meth:`Route.primaries`, :meth:`Route.scan`, with a
:func:`match_prefix` pattern), for a purge. Standalone, there is one node, the
server, and connections come from a redis-py ``ConnectionPool``. In a cluster, keys
map to slots with Redis's own CRC16 (``redis.crc.key_slot``) and slots to masters
with redis-py's slot cache; each master has its own pool (``ClusterNode``).

Cluster mode is chosen by :func:`open_route`'s ``cluster``: True or False as given;
None (the default) asks the server once at open, with ``INFO cluster``, whether
``cluster_enabled:1``, for ``redis://`` and ``rediss://`` URLs (a ``unix://`` URL is
always standalone: redis-py's cluster client does not speak unix sockets).

Every connection is one of :mod:`lmtier_backends.redis.wire`'s zero-copy classes,
with the tier's timeout as socket timeout (and at least ``CONNECT_TIMEOUT_FLOOR_S`` to
connect: a TLS handshake under load takes longer than a command), RESP2 (the tier's replies are
flat, and RESP2 has no push messages), and no retries inside redis-py (the tier
retries reads itself; writes are never retried). A connection that failed in the
middle of an exchange is disconnected (its socket aborted) before it goes back to
its pool, so the next borrower reconnects.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection, Connection, ConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot

from lmtier_backends.redis.wire import zero_copy_class

__all__ = [
    "CONNECT_TIMEOUT_FLOOR_S",
    "ClusterRoute",
    "Node",
    "Route",
    "StandaloneRoute",
    "match_prefix",
    "open_route",
]

Node = ClusterNode | None
"""Where a key lives: a cluster master, or None for the one standalone server."""

_GLOB_SPECIAL = frozenset(b"\\*?[]")


def match_prefix(prefix: bytes) -> bytes:
    """A SCAN ``MATCH`` pattern for the keys that start with ``prefix``: its glob
    metacharacters (``* ? [ ] \\``) escaped, so a ``key_prefix`` such as ``cache[1]*``
    matches itself only, then ``*``."""
    escaped = bytearray()
    for byte in prefix:
        if byte in _GLOB_SPECIAL:
            escaped.append(0x5C)  # a backslash: the next byte is literal
        escaped.append(byte)
    return bytes(escaped) + b"*"


class Route(ABC):
    """How the tier reaches the node that serves a key (module docstring)."""

    client: Redis | RedisCluster
    """The redis-py client, for what the tier does not do on its own wire path."""
    is_cluster: bool

    @abstractmethod
    def node_of(self, name: bytes) -> Node:
        """The node serving Redis key ``name``."""

    def group(self, names: Sequence[bytes]) -> list[tuple[Node, list[int]]]:
        """Indices of ``names`` per node, in order within each node."""
        return [(None, list(range(len(names))))]

    @abstractmethod
    def connection(self, node: Node) -> AbstractAsyncContextManager[AbstractConnection]:
        """``async with``: a connected connection to ``node``, returned to its pool after
        (disconnected first if the body raised)."""

    async def refresh(self) -> None:  # noqa: B027 - nothing to reload standalone
        """Reload the topology after a connection failure (cluster only)."""

    def primaries(self) -> list[Node]:
        """The nodes that hold keys: every master, or the one server."""
        return [None]

    @abstractmethod
    async def scan(
        self, node: Node, cursor: int, match: bytes, count: int
    ) -> tuple[int, list[bytes]]:
        """One ``SCAN cursor MATCH match COUNT count`` on ``node``: the next cursor (0
        when done) and the key names of this page (maybe none)."""

    @abstractmethod
    async def aclose(self) -> None:
        """Close every connection; never waits on the server."""


class StandaloneRoute(Route):
    """One server, one redis-py ``ConnectionPool``."""

    is_cluster = False

    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = pool
        self.client = Redis(connection_pool=pool)

    def node_of(self, name: bytes) -> Node:
        return None

    async def scan(
        self, node: Node, cursor: int, match: bytes, count: int
    ) -> tuple[int, list[bytes]]:
        following, names = await self.client.scan(cursor, match=match, count=count)
        return int(following), cast("list[bytes]", names)  # no decode_responses: bytes

    @asynccontextmanager
    async def connection(self, node: Node) -> AsyncIterator[AbstractConnection]:
        # The pool reconnects a connection that holds unread bytes or was closed by the
        # server while idle (it checks before handing one out).
        conn = await self.pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            yield conn
        except BaseException:
            await conn.disconnect(nowait=True)
            raise
        finally:
            await self.pool.release(conn)

    async def aclose(self) -> None:
        try:
            await self.client.aclose()
        finally:
            await self.pool.aclose()


class ClusterRoute(Route):
    """A Redis Cluster through redis-py's ``RedisCluster`` (slot cache, per-node pools)."""

    is_cluster = True

    def __init__(self, cluster: RedisCluster) -> None:
        self.client = self.cluster = cluster
        self._stale = False

    def node_of(self, name: bytes) -> Node:
        node: ClusterNode = self.cluster.nodes_manager.get_node_from_slot(key_slot(name))
        return node

    def primaries(self) -> list[Node]:
        return list(self.cluster.get_primaries())

    async def scan(
        self, node: Node, cursor: int, match: bytes, count: int
    ) -> tuple[int, list[bytes]]:
        if node is None:
            raise ValueError("a cluster scan needs a node")
        # redis-py answers a cluster SCAN with a cursor per node asked.
        cursors, names = await self.cluster.scan(
            cursor, match=match, count=count, target_nodes=node
        )
        following = cast("dict[str, int]", cursors)[node.name]
        return int(following), cast("list[bytes]", names)

    def group(self, names: Sequence[bytes]) -> list[tuple[Node, list[int]]]:
        groups: dict[str, tuple[Node, list[int]]] = {}
        get_node = self.cluster.nodes_manager.get_node_from_slot
        for index, name in enumerate(names):
            node: ClusterNode = get_node(key_slot(name))
            groups.setdefault(node.name, (node, []))[1].append(index)
        return list(groups.values())

    @asynccontextmanager
    async def connection(self, node: Node) -> AsyncIterator[AbstractConnection]:
        if node is None:
            raise ValueError("a cluster connection needs a node")
        conn = node.acquire_connection()
        try:
            await conn.connect()  # type: ignore[no-untyped-call] # a no-op when connected
            if await conn.can_read():  # closed by the server while idle, or stray bytes
                await conn.disconnect(nowait=True)
                await conn.connect()  # type: ignore[no-untyped-call]
            yield conn
        except BaseException:
            self._stale = True
            await conn.disconnect(nowait=True)
            raise
        finally:
            node.release(conn)

    async def refresh(self) -> None:
        if self._stale:
            await self.cluster.nodes_manager.initialize()
            self._stale = False

    async def aclose(self) -> None:
        await self.client.aclose()


CONNECT_TIMEOUT_FLOOR_S = 2.0
"""Connections get at least this long to be established: a TLS handshake on a loaded
2-core machine, 16 at once, was measured to exceed a 0.5 s command timeout."""


def _options(max_connections: int, timeout_s: float) -> dict[str, Any]:
    return {
        "max_connections": max_connections,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": max(timeout_s, CONNECT_TIMEOUT_FLOOR_S),
        "retry": Retry(NoBackoff(), 0),  # writes are never retried; reads retry in the tier
        "protocol": 2,
    }


async def open_route(
    url: str, *, cluster: bool | None, max_connections: int, timeout_s: float
) -> Route:
    """Connect to the server or cluster at ``url`` and check that it answers.

    Raises redis-py's exceptions (the tier translates them).
    """
    options = _options(max_connections, timeout_s)
    if cluster is not True:
        pool = ConnectionPool.from_url(url, **options)
        pool.connection_class = zero_copy_class(pool.connection_class)
        route = StandaloneRoute(pool)
        try:
            if cluster is None and not url.lower().startswith("unix:"):
                info = await route.client.info("cluster")
                found_cluster = bool(info.get("cluster_enabled"))
            else:
                await route.client.ping()
                found_cluster = False
        except BaseException:
            await route.aclose()
            raise
        if not found_cluster:
            return route
        await route.aclose()
    client = RedisCluster.from_url(url, **options)
    connection_class = cast(
        "type[Connection]", zero_copy_class(client.connection_kwargs["connection_class"])
    )
    # Nodes found at initialize() are built from these kwargs; the startup nodes exist already.
    client.connection_kwargs["connection_class"] = connection_class
    for node in client.nodes_manager.startup_nodes.values():
        node.connection_class = connection_class
    await client.initialize()  # closes its connections itself when it fails
    return ClusterRoute(client)
