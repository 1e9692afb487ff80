"""A Redis reached through Lua scripts, as the peer directory and the fleet index
reach theirs: one connection made on first use and remade after a failure (so a
Redis that is down at start costs misses, not a failed open), scripts loaded once
(EVALSHA, reloaded on NOSCRIPT), and redis-py's exceptions turned into
:class:`~lmtier.errors.BackendUnavailable` or :class:`~lmtier.errors.BackendTimeout`
naming the server without its password."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from lmtier.config.secrets import SecretURL, redact_url
from lmtier.errors import BackendTimeout, BackendUnavailable
from lmtier_backends.redis.client import Route, open_route

__all__ = ["ScriptedRedis"]

logger = logging.getLogger(__name__)


class ScriptedRedis:
    """One Redis, its scripts and its failures (module docstring). Loop-bound."""

    def __init__(
        self,
        url: str | SecretURL,
        *,
        what: str,
        timeout_s: float = 1.0,
        max_connections: int = 4,
    ) -> None:
        self._url = url if isinstance(url, SecretURL) else SecretURL(url)
        self.timeout_s = timeout_s
        self._max_connections = max_connections
        self._route: Route | None = None
        self._scripts: dict[str, Any] = {}
        self._opening: asyncio.Lock | None = None
        self.where = f"{what} at {redact_url(self._url.reveal())}"

    async def connected(self) -> Route:
        """The connection, made now if there is none."""
        if self._route is not None:
            return self._route
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._route is None:
                self._route = await self.call(
                    open_route(
                        self._url.reveal(),
                        cluster=None,
                        max_connections=self._max_connections,
                        timeout_s=self.timeout_s,
                    )
                )
        return self._route

    async def run(self, name: str, source: str, keys: list[Any], args: list[Any]) -> Any:
        """Run script ``name`` (EVALSHA, loading it on NOSCRIPT)."""
        route = await self.connected()
        script = self._scripts.get(name)
        if script is None:
            script = self._scripts[name] = route.client.register_script(source)
        return await self.call(script(keys=keys, args=args))

    async def call(self, call: Any) -> Any:
        """Await a redis-py call; its failures as BackendError, and the connection
        dropped so that the next call reconnects."""
        try:
            return await call
        except (RedisTimeoutError, asyncio.TimeoutError) as exc:
            await self._drop()
            raise BackendTimeout(f"{self.where}: timed out") from exc
        except (RedisError, OSError) as exc:
            await self._drop()
            raise BackendUnavailable(f"{self.where}: {type(exc).__name__}") from exc

    async def close(self) -> None:
        """Close the connections; idempotent."""
        route, self._route = self._route, None
        self._scripts.clear()
        if route is not None:
            await route.aclose()

    async def _drop(self) -> None:
        route, self._route = self._route, None
        self._scripts.clear()
        if route is not None:
            try:
                await route.aclose()
            except (RedisError, OSError) as exc:  # closing a broken connection
                logger.debug("%s: close after a failure: %s", self.where, exc)
