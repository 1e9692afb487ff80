"""The Redis tier's wire path: a packer that never copies values, and an exchange that
writes a command and reads its replies straight into the caller's buffers.

redis-py manages connections (connect, AUTH, TLS, unix sockets, pools, cluster
topology); the bytes of the tier's own commands move here, over a connection the
tier has checked out of a redis-py pool. Measured on the 2-core machine with
benchmarks/bench_redis.py (concurrency 4, medians of three runs):

* **Reads**: redis-py's GET copies a value three times before the caller sees it
  (socket data -> StreamReader buffer -> ``readexactly`` bytes -> ``[:-2]`` slice)
  and the tier would copy it once more into the slab, each copy into fresh memory.
  :func:`exchange` swaps the connection's transport to an
  :class:`asyncio.BufferedProtocol` for the duration of one command, so the kernel
  ``recv_into``-s the value straight into its pool slab: no copy in Python at all.
  2.2-3.6x redis-py's GET for 2 MiB values, 1.7-2.3x for 8 MiB.
* **Lookups**: a redis-py pipeline of 512 EXISTS costs ~4 ms (per-command Python);
  packed as one buffer and answered by splitting reply lines here, ~0.4 ms, of which
  0.15 ms is naming and packing the keys (a PING is ~0.09 ms).
* **Writes**: Python 3.11's ``transport.writelines`` joins its pieces (a copy of the
  value) and buffers what the socket does not take (a second copy). Here a value
  goes out in 256 KiB memoryview slices, each sent by the transport straight from
  the slab, the next written once the transport's buffer has drained: only what the
  socket does not take at once is copied (0% of 2 MiB values, 3% of 8 MiB ones).
  Over TLS the encryption copies anyway; the slices still bound the buffering.

The connection classes (:class:`ZeroCopyConnection` and its TLS and unix-socket
siblings) pack every command with :func:`pack_command`, which passes values and
memoryviews through as separate pieces whether or not hiredis is installed
(redis-py's hiredis packer copies every value), and abort the socket on
disconnect, so closing never waits on a dead or stopped server.

The transport swap relies on one redis-py private attribute, the connection's
``_writer`` (its asyncio StreamWriter); everything else is public asyncio API
(``get_protocol``/``set_protocol``, ``BufferedProtocol``, write buffer limits).
The original protocol is put back before the connection returns to its pool, and a
connection whose exchange did not finish cleanly is aborted, never reused.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, cast

from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, InvalidResponse
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT

from lmtier.storage.budget import Progress

__all__ = [
    "Reply",
    "ZeroCopyConnection",
    "ZeroCopySSLConnection",
    "ZeroCopyUnixConnection",
    "exchange",
    "pack_command",
    "pack_commands",
    "pack_key_commands",
    "zero_copy_class",
]

Piece: TypeAlias = bytes | memoryview
Reply: TypeAlias = int | bytes | None
"""One reply: ``int`` is the length of a bulk string (its bytes are in the reply's sink
when it fit), ``bytes`` a status, integer or error line with its type byte
(``b"+OK"``, ``b":1"``, ``b"-ERR ..."``), ``None`` a nil."""

INLINE_MAX = 16 * 1024
"""Arguments up to this size are joined into the command's header; larger ones (and
every memoryview) travel as their own piece, uncopied."""
SLICE = 256 * 1024
"""Bytes handed to the transport per write: big enough to amortise the call, small
enough that the socket takes most of it directly (what it does not take is copied)."""
_SCRATCH = 64 * 1024
_CRLF = b"\r\n"
_SIMPLE_LINES = re.compile(rb"(?:[:+\-][^\r\n]*\r\n)*")
"""Status, integer and error lines only (what EXISTS and DEL pipelines answer)."""


def _encode(arg: EncodableT) -> Piece:
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, memoryview) and arg.format == "B" and arg.ndim == 1:
        return arg
    if isinstance(arg, (bytearray, memoryview)):
        return memoryview(arg).cast("B")
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, bool):  # bool is an int; redis-py refuses it too
        raise DataError("refusing to send a bool to Redis")
    if isinstance(arg, (int, float)):
        return repr(arg).encode()
    raise DataError(f"cannot send {type(arg).__name__} to Redis")


def pack_command(*args: EncodableT) -> list[Piece]:
    """RESP pieces of one command; large values and memoryviews are passed through."""
    first = args[0]
    # redis-py sends some commands as one argument ("CLUSTER SLOTS"); Redis wants two.
    if isinstance(first, (str, bytes)) and len(first.split()) > 1:
        args = (*first.split(), *args[1:])
    pieces: list[Piece] = []
    head = bytearray(b"*%d\r\n" % len(args))
    for arg in args:
        data = _encode(arg)
        if isinstance(data, memoryview) or len(data) > INLINE_MAX:
            head += b"$%d\r\n" % len(data)
            pieces.append(bytes(head))
            pieces.append(data)
            head = bytearray(_CRLF)
        else:
            head += b"$%d\r\n%b\r\n" % (len(data), data)
    pieces.append(bytes(head))
    return pieces


def pack_key_commands(command: bytes, names: Iterable[bytes]) -> bytes:
    """A pipeline of ``command name`` for every name, as one buffer (the lookup's hot path:
    one format per key instead of a general packer call)."""
    head = b"*2\r\n$%d\r\n%b\r\n" % (len(command), command)
    return b"".join([b"%b$%d\r\n%b\r\n" % (head, len(name), name) for name in names])


def pack_commands(commands: Iterable[Iterable[EncodableT]]) -> list[Piece]:
    """Pieces of a pipeline: small pieces joined, large ones passed through."""
    out: list[Piece] = []
    small: list[bytes] = []
    for command in commands:
        for piece in pack_command(*command):
            if isinstance(piece, bytes) and len(piece) <= INLINE_MAX:
                small.append(piece)
                continue
            if small:
                out.append(b"".join(small))
                small = []
            out.append(piece)
    if small:
        out.append(b"".join(small))
    return out


# ---- connection classes ---------------------------------------------------------------

if TYPE_CHECKING:
    _Base = AbstractConnection
else:
    _Base = object


class _ZeroCopy(_Base):
    """Mixin: our packer for every command, and a disconnect that never waits."""

    def pack_command(self, *args: EncodableT) -> list[bytes]:
        # The list carries memoryviews too, exactly as redis-py's own Python packer does.
        return cast("list[bytes]", pack_command(*args))

    def pack_commands(self, commands: Iterable[Iterable[EncodableT]]) -> list[bytes]:
        return cast("list[bytes]", pack_commands(commands))

    async def disconnect(self, nowait: bool = False, *args: Any, **kwargs: Any) -> None:
        # A graceful close waits for queued writes to reach a server that may be dead
        # or stopped; a cache loses nothing by dropping them, so abort instead.
        writer = self._writer
        if writer is not None:
            writer.transport.abort()
        await super().disconnect(True, *args, **kwargs)


class ZeroCopyConnection(_ZeroCopy, Connection):
    """TCP connection with the tier's packer and an aborting disconnect."""


class ZeroCopySSLConnection(_ZeroCopy, SSLConnection):
    """TLS connection with the tier's packer and an aborting disconnect."""


class ZeroCopyUnixConnection(_ZeroCopy, UnixDomainSocketConnection):
    """Unix-socket connection with the tier's packer and an aborting disconnect."""


_ZERO_COPY: dict[type[AbstractConnection], type[AbstractConnection]] = {
    Connection: ZeroCopyConnection,
    SSLConnection: ZeroCopySSLConnection,
    UnixDomainSocketConnection: ZeroCopyUnixConnection,
}


def zero_copy_class(cls: type[AbstractConnection]) -> type[AbstractConnection]:
    """Our subclass of redis-py connection class ``cls`` (as chosen from a URL)."""
    if cls in _ZERO_COPY.values():
        return cls
    try:
        return _ZERO_COPY[cls]
    except KeyError:
        raise ValueError(f"no zero-copy variant of {cls.__name__}") from None


# ---- the exchange -------------------------------------------------------------------


class _Exchange(asyncio.BufferedProtocol):
    """Stands in for a connection's protocol during one exchange; parses flat replies
    (no arrays: GET/SET/EXISTS/DEL answer with one line or one bulk string each)."""

    def __init__(
        self,
        original: asyncio.BaseProtocol,
        num_replies: int,
        sinks: Sequence[memoryview | None],
        meter: Progress | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.original = original
        self.meter = meter
        """The tier's I/O progress, ticked whenever bytes move (the guard's view)."""
        self.done: asyncio.Future[None] = loop.create_future()
        self.replies: list[Reply] = []
        self.progress = 0
        """Bytes moved either way; the watchdog's measure of a live server."""
        self._num_replies = num_replies
        self._sinks = sinks
        self._scratch = bytearray(_SCRATCH)
        self._view = memoryview(self._scratch)
        self._start = 0
        self._end = 0
        # Inside a bulk reply: its length, the bytes still to come, and where they go
        # (None: discarded, because it has no sink or does not fit in it).
        self._bulk_len = -1
        self._bulk_left = 0
        self._sink: memoryview | None = None
        self._sink_at = 0
        self._drained: asyncio.Future[None] | None = None
        self._watchdog: asyncio.TimerHandle | None = None

    # -- the watchdog -----------------------------------------------------------------

    def watch(self, timeout: float | None) -> None:
        """Fail the exchange after ``timeout`` seconds without a byte moving either way:
        a 32 MiB value may take longer than the timeout to move, a silent server never
        finishes. One timer, re-armed while there is progress."""
        if timeout is not None:
            loop = asyncio.get_running_loop()
            self._watchdog = loop.call_later(timeout, self._check, self.progress, timeout)

    def _check(self, seen: int, timeout: float) -> None:
        if self.done.done():
            return
        if self.progress == seen:
            self._fail(RedisTimeoutError(f"Redis made no progress for {timeout} s"))
        else:
            self.watch(timeout)

    def unwatch(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()

    # -- writing: flow control ----------------------------------------------------------

    def pause_writing(self) -> None:
        self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        self.progress += 1
        if self.meter is not None:
            self.meter.tick()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    async def drained(self) -> None:
        """Wait until the transport has handed everything it holds to the socket (or the
        exchange failed: ``_fail`` wakes this too)."""
        while (waiter := self._drained) is not None and not self.done.done():
            await waiter

    # -- reading ---------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._sink is not None and self._bulk_left and self._start == self._end:
            # The value goes straight from the socket into the caller's buffer.
            return self._sink[self._sink_at : self._sink_at + self._bulk_left]
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._scratch):
            kept = self._scratch[self._start : self._end]
            self._view.release()
            self._scratch = bytearray(max(_SCRATCH, 2 * len(kept)))
            self._scratch[: len(kept)] = kept
            self._view = memoryview(self._scratch)
            self._start, self._end = 0, len(kept)
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self.progress += nbytes
        if self.meter is not None:
            self.meter.tick()
        if self._sink is not None and self._bulk_left and self._start == self._end:
            self._sink_at += nbytes
            self._bulk_left -= nbytes
        else:
            self._end += nbytes
        try:
            self._parse()
        except (ValueError, InvalidResponse) as exc:
            self._fail(InvalidResponse(f"unexpected reply from Redis: {exc}"))

    def _parse(self) -> None:
        if self._bulk_len < 0 and not self._sinks:
            self._parse_lines()
        while len(self.replies) < self._num_replies:
            if self._bulk_len >= 0:
                if not self._finish_bulk():
                    return
                continue
            found = self._scratch.find(_CRLF, self._start, self._end)
            if found < 0:
                return
            line = bytes(self._view[self._start : found])
            self._start = found + 2
            kind = line[:1]
            if kind == b"$":
                self._begin_bulk(int(line[1:]))
            elif kind == b"_":  # RESP3 null
                self.replies.append(None)
            elif kind in (b"+", b"-", b":"):
                self.replies.append(line)
            else:
                raise InvalidResponse(f"reply type {kind!r}")
        if self._start != self._end:
            raise InvalidResponse("more bytes than replies")
        if not self.done.done():
            self.done.set_result(None)

    def _parse_lines(self) -> None:
        """Fast path for a pipeline's simple replies (EXISTS, DEL): split all complete lines
        at once; stops at anything else, which the general loop then parses."""
        last = self._scratch.rfind(_CRLF, self._start, self._end)
        if last < 0:
            return
        at = self._start
        wanted = self._num_replies - len(self.replies)
        lines = bytes(self._view[at:last]).split(_CRLF)
        if len(lines) <= wanted and _SIMPLE_LINES.fullmatch(self._view[at : last + 2]):
            self.replies += lines  # all simple: no per-line Python at all
            self._start = last + 2
            return
        for line in lines[:wanted]:
            kind = line[:1]
            if kind in (b":", b"+", b"-"):
                self.replies.append(line)
            elif kind == b"_":
                self.replies.append(None)
            else:
                break
            at += len(line) + 2
        self._start = at

    def _begin_bulk(self, length: int) -> None:
        if length < 0:
            self.replies.append(None)
            return
        index = len(self.replies)
        sink = self._sinks[index] if index < len(self._sinks) else None
        self._sink = sink if sink is not None and length <= len(sink) else None
        self._sink_at = 0
        self._bulk_len = self._bulk_left = length

    def _finish_bulk(self) -> bool:
        """Consume what the scratch holds of the current bulk reply; True when it ended."""
        if self._bulk_left:
            take = min(self._bulk_left, self._end - self._start)
            if self._sink is not None and take:
                self._sink[self._sink_at : self._sink_at + take] = self._view[
                    self._start : self._start + take
                ]
                self._sink_at += take
            self._start += take
            self._bulk_left -= take
            if self._bulk_left:
                return False
        if self._end - self._start < 2:
            return False
        if self._view[self._start : self._start + 2] != _CRLF:
            raise InvalidResponse("bulk string without its CRLF")
        self._start += 2
        self.replies.append(self._bulk_len)
        self._bulk_len = -1
        self._sink = None
        return True

    # -- the end of the connection ----------------------------------------------------

    def eof_received(self) -> bool:
        self._fail(RedisConnectionError("Redis closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        # The stream reader must learn of it too, or redis-py would think it connected.
        self.original.connection_lost(exc)
        self._fail(RedisConnectionError(f"connection to Redis lost: {exc or 'closed'}"))

    def _fail(self, exc: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(exc)
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)


async def exchange(
    connection: AbstractConnection,
    pieces: Sequence[Piece],
    num_replies: int,
    sinks: Sequence[memoryview | None] = (),
    timeout: float | None = None,
    *,
    meter: Progress | None = None,
) -> list[Reply]:
    """Send ``pieces`` (packed commands) on ``connection`` and read ``num_replies`` flat
    replies; bulk reply ``i`` lands in ``sinks[i]`` when it fits (else it is discarded
    and only its length returned). ``timeout``: fail after that long without a byte
    moving; ``meter`` is ticked whenever bytes move.

    Raises redis ``ConnectionError`` / ``TimeoutError`` / ``InvalidResponse``; after any
    exception the connection's socket is aborted and the caller must disconnect it.
    """
    writer = connection._writer
    if writer is None:
        raise RedisConnectionError("connection is not open")
    transport = writer.transport
    original = transport.get_protocol()
    proto = _Exchange(original, num_replies, sinks, meter)
    transport.set_protocol(proto)
    # pause_writing as soon as anything is queued (TLS transports pause at size >= high,
    # plain ones at size > high: high=0 would pause a TLS writer forever)
    transport.set_write_buffer_limits(high=1, low=0)
    proto.watch(timeout)
    clean = False
    try:
        for piece in pieces:
            view = memoryview(piece) if len(piece) > SLICE else piece  # slices of bytes copy
            for offset in range(0, len(view), SLICE):
                if transport.is_closing() or proto.done.done():
                    break
                transport.write(view[offset : offset + SLICE])
                await proto.drained()
        if transport.is_closing() and not proto.done.done():
            raise RedisConnectionError("connection to Redis closed while writing")
        await proto.done  # raises what ended the exchange early
        clean = True
        return proto.replies
    finally:
        proto.unwatch()
        if proto.done.done() and not proto.done.cancelled():
            proto.done.exception()  # retrieved: asyncio must not log it as forgotten
        if clean:
            transport.set_write_buffer_limits()
            transport.set_protocol(original)
        else:
            transport.set_protocol(original)
            transport.abort()
