"""How the sidecar runs each call: the caller admitted (a token, not draining), the
request parsed, any failure turned into a status code with lmtier's message (never a
trace), the call timed and counted in the metrics, and the calls in flight counted,
which a drain waits for before it ends the sessions whose leases they grant."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import grpc

from lmtier.sidecar.auth import Principal
from lmtier.sidecar.metrics import SidecarMetrics
from lmtier.sidecar.status import parsed
from lmtier.wire.status import status_of

__all__ = ["Handler", "InFlight", "Served", "answer", "session_stream", "streaming", "unary"]

Handler = Callable[..., Awaitable[Any]]
Streamer = Callable[..., AsyncIterator[Any]]


class InFlight:
    """How many calls are being served (sessions' own streams aside), and a wait for
    none. Used on the event loop only."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def __enter__(self) -> None:
        self.count += 1
        self._idle.clear()

    def __exit__(self, *exc_info: object) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Until no call is in flight (True), or ``timeout_s`` has passed (False)."""
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout_s))
        except TimeoutError:
            return False
        return True


class Served(Protocol):
    """What the wrappers need of the service."""

    in_flight: InFlight
    metrics: SidecarMetrics

    def admit(self, context: Any) -> Principal: ...

    async def answer(self, name: str, work: Awaitable[Any]) -> tuple[grpc.StatusCode, Any]: ...


async def answer(served: Served, name: str, work: Awaitable[Any]) -> tuple[grpc.StatusCode, Any]:
    """Run call ``name``'s work: (OK, its reply), or the status code and message of its
    failure; timed, counted, and in flight meanwhile."""
    started, code = time.perf_counter(), grpc.StatusCode.OK
    try:
        with served.in_flight:
            return code, await work
    except Exception as exc:
        code, message = status_of(exc, name)
        return code, message
    finally:
        served.metrics.observe_call(name, time.perf_counter() - started, code.name)


def unary(method: Handler) -> Handler:
    """A gRPC handler with one answer (unary, or client-streaming)."""
    name = method.__name__

    @functools.wraps(method)
    async def handle(self: Served, request: Any, context: Any) -> Any:
        async def work() -> Any:
            principal = self.admit(context)
            return await method(self, parsed(request), principal)

        code, result = await self.answer(name, work())
        if code is not grpc.StatusCode.OK:
            await context.abort(code, result)
        return result

    return handle


def _stream(method: Streamer, *, counted: bool) -> Streamer:
    name = method.__name__

    @functools.wraps(method)
    async def handle(self: Served, request: Any, context: Any) -> AsyncIterator[Any]:
        started, code = time.perf_counter(), grpc.StatusCode.OK
        try:
            principal = self.admit(context)
            with self.in_flight if counted else contextlib.nullcontext():
                async for message in method(self, parsed(request), principal, context):
                    yield message
        except Exception as exc:
            code, text = status_of(exc, name)
            await context.abort(code, text)
        finally:
            self.metrics.observe_call(name, time.perf_counter() - started, code.name)

    return handle


def streaming(method: Streamer) -> Streamer:
    """A gRPC handler that streams its answer, in flight while it streams."""
    return _stream(method, counted=True)


def session_stream(method: Streamer) -> Streamer:
    """:func:`streaming` for a session's own stream (``OpenSession``): it lasts as
    long as the session, so a drain does not wait for it (it ends it)."""
    return _stream(method, counted=False)
