"""The sidecar's end of the local lane (:mod:`lmtier.wire.lane` has the framing and
the client's end): each request runs through the service's own handler code (the
same checks, sessions and status codes) on the service's loop.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from lmtier.errors import InvalidRequestError
from lmtier.wire.lane import HEADER, HELLO, METHODS
from lmtier.wire.status import status_of

if TYPE_CHECKING:
    from lmtier.sidecar.service import SidecarService

__all__ = ["LaneServer"]

_BY_NUMBER = {number: (name, request) for name, (number, request, _) in METHODS.items()}


class LaneServer:
    """The sidecar's end of the lane (module docstring), on the service's loop."""

    def __init__(self, service: SidecarService, path: Path, max_frame: int) -> None:
        self.service = service
        self.path = path
        self.max_frame = max_frame
        self._server: asyncio.AbstractServer | None = None
        self._open: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._calling: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Listen (the socket is born 0600: the caller holds the umask)."""
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))

    async def close(self, grace_s: float = 1.0) -> None:
        """Stop accepting connections, let calls in flight finish (``grace_s`` at most),
        then close every connection and wait for their ends (idempotent)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        self.path.unlink(missing_ok=True)
        if self._calling:
            await asyncio.wait(set(self._calling), timeout=grace_s)
        for writer in self._open.values():
            writer.close()  # its reader sees the end and the connection's task returns
        if self._open:
            await asyncio.wait(set(self._open), timeout=grace_s)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._open[task] = writer
        try:
            await self._connection(reader, writer, task)
        finally:
            del self._open[task]
            self._calling.discard(task)

    async def _connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, task: asyncio.Task[None]
    ) -> None:
        auth, principal = self.service.parts.auth, None
        try:
            while True:
                self._calling.discard(task)  # between calls: closing it loses nothing
                length, method = HEADER.unpack(await reader.readexactly(HEADER.size))
                if length > self.max_frame:
                    message = f"a frame of {length} bytes; at most {self.max_frame}"
                    _reply(writer, grpc.StatusCode.RESOURCE_EXHAUSTED, message.encode())
                    break
                payload = await reader.readexactly(length)
                if method == HELLO:
                    value = payload.decode("utf-8", "replace")
                    try:
                        principal = auth.authenticate([("authorization", value)] if value else [])
                    except Exception as exc:
                        code, text = status_of(exc, "hello")
                        _reply(writer, code, text.encode())
                        break
                    _reply(writer, grpc.StatusCode.OK, b"")
                elif principal is None:
                    _reply(writer, grpc.StatusCode.UNAUTHENTICATED, b"say hello first")
                    break
                else:
                    self._calling.add(task)
                    code, body = await self._call(method, payload, principal)
                    _reply(writer, code, body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away: it had no state here
        finally:
            writer.close()

    async def _call(
        self, method: int, payload: bytes, principal: Any
    ) -> tuple[grpc.StatusCode, bytes]:
        service, found = self.service, _BY_NUMBER.get(method)
        name = found[0] if found is not None else "unknown"

        async def work() -> bytes:
            if found is None:
                raise InvalidRequestError(f"no lane method {method}")
            service.check_serving()
            handler = getattr(type(service), name).__wrapped__  # the body, not gRPC's wrapper
            reply = await handler(service, found[1].FromString(payload), principal)
            return bytes(reply.SerializeToString())

        code, result = await service.answer(name, work())
        return code, result if code is grpc.StatusCode.OK else str(result).encode()


def _reply(writer: asyncio.StreamWriter, code: grpc.StatusCode, body: bytes) -> None:
    writer.write(HEADER.pack(len(body), code.value[0]) + body)
