"""The engines behind the router: their addresses, health and load.

Each engine (``--engine NAME=URL``: NAME is the ``fleet.node_id`` of the node whose
cache serves it) is asked ``GET /health`` every ``interval_s``; one that does not
answer 200 within ``timeout_s`` is skipped until it does again (a request that fails
on it marks it down at once). Its load is what the router has in flight there, plus
what the engine itself says is waiting or running beyond that, where its
``GET /metrics`` says so (vLLM's ``vllm:num_requests_waiting``); an engine without
such metrics (``lmtier demo serve``) counts the router's requests only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

__all__ = ["Engine", "EngineError", "Engines", "parse_engine"]

logger = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_WAITING = re.compile(rb"^vllm:num_requests_waiting(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)


class EngineError(ValueError):
    """A bad ``--engine`` value."""


@dataclass(slots=True)
class Engine:
    """One engine (module docstring)."""

    name: str
    url: str
    healthy: bool = True
    in_flight: int = 0
    waiting: int = 0
    failures: int = 0
    served: int = 0
    _checked: bool = field(default=False, repr=False)


def parse_engine(value: str) -> Engine:
    """``NAME=URL`` (``http://host:port``, no path) as an Engine; EngineError if not."""
    name, sep, url = value.partition("=")
    if not sep or not _NAME.fullmatch(name):
        raise EngineError(f"{value!r}: give NAME=URL, NAME the node's fleet.node_id")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise EngineError(f"{value!r}: the URL must be http(s)://host:port")
    return Engine(name, url.rstrip("/"))


class Engines:
    """The engines, polled in the background (module docstring)."""

    def __init__(
        self,
        engines: list[Engine],
        *,
        interval_s: float = 2.0,
        timeout_s: float = 2.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        names = [engine.name for engine in engines]
        if len(set(names)) != len(names) or not names:
            raise EngineError("give each engine once, under a name of its own")
        self.all = engines
        self.by_name = {engine.name: engine for engine in engines}
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._headers = headers or {}
        self._task: asyncio.Task[None] | None = None

    def healthy(self) -> list[Engine]:
        return [engine for engine in self.all if engine.healthy]

    def start(self, session: aiohttp.ClientSession) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll(session))

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def failed(self, engine: Engine) -> None:
        """A request failed on ``engine``: skip it until its health says otherwise."""
        engine.failures += 1
        if engine.healthy:
            logger.warning(
                "engine %s (%s) failed a request: skipped until healthy", engine.name, engine.url
            )
        engine.healthy = False

    async def check(self, session: aiohttp.ClientSession) -> None:
        """Ask every engine once, at the same time."""
        await asyncio.gather(*(self._check(session, engine) for engine in self.all))

    async def _poll(self, session: aiohttp.ClientSession) -> None:
        while True:
            await self.check(session)
            await asyncio.sleep(self.interval_s)

    async def _check(self, session: aiohttp.ClientSession, engine: Engine) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with session.get(
                f"{engine.url}/health", timeout=timeout, headers=self._headers
            ) as answer:
                healthy = answer.status == 200
            if healthy:
                engine.waiting = await self._waiting(session, engine, timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            healthy = False
        if healthy != engine.healthy or not engine._checked:
            logger.info(
                "engine %s (%s) is %s", engine.name, engine.url, "up" if healthy else "down"
            )
        engine.healthy, engine._checked = healthy, True

    async def _waiting(
        self, session: aiohttp.ClientSession, engine: Engine, timeout: aiohttp.ClientTimeout
    ) -> int:
        """What the engine's metrics say waits in its queue (0 without such metrics)."""
        try:
            async with session.get(
                f"{engine.url}/metrics", timeout=timeout, headers=self._headers
            ) as answer:
                if answer.status != 200:
                    return 0
                text = await answer.content.read(4 << 20)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return 0
        total = 0.0
        for match in _WAITING.finditer(text):
            with contextlib.suppress(ValueError):
                total += float(match.group(1))
        return max(0, int(total))
