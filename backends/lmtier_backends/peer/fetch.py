"""The client side of ``lmtier.v1.Peer/Fetch``: chunks of another node's CPU tier,
streamed straight into the caller's buffers (pool slabs).

One grpc.aio channel per peer address, kept open (HTTP/2 keepalive notices a peer
that vanished), with TLS and this node's certificate when ``peer.tls_ca_file`` is
set. No bearer token is ever sent: each call carries a proof of the node secret made
for the address dialled (:mod:`lmtier.wire.peer_auth`), and nothing the peer
sends is taken before its answer to that proof checks out, so a server that the
directory names but that is no node of the cluster learns no secret and serves
nothing. The pieces are parsed by :mod:`lmtier.wire.pieces` and copied once,
from the received message into the buffer. A chunk is a hit only once every byte of
it arrived in order; a chunk larger than its buffer is :data:`UNSERVABLE`; a stream
that breaks leaves the chunks it finished and makes the rest misses. A caller may
pass a ``check`` (the tier's :meth:`~lmtier.storage.tier.Tier.check_read`): each chunk
is then checked as its last piece lands, while its bytes are still in the CPU's
caches, rather than after the whole batch (a 2 MiB payload's checksum takes about a
third as long so).

Buffers are written by this coroutine only, between two awaits of the stream, so a
call that is cancelled touches no buffer afterwards (the tier contract).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from lmtier.chunks.keys import ChunkKey
from lmtier.errors import BackendError, BackendTimeout, BackendUnavailable, brief
from lmtier.storage.budget import Progress
from lmtier.storage.tier import UNSERVABLE, CheckedRead
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.wire.credentials import channel_credentials
from lmtier.wire.keepalive import DEFAULT_KEEPALIVE_S, keepalive_options
from lmtier.wire.peer_auth import CONTAINS_METHOD, FETCH_METHOD, NodeKey, RequestProof
from lmtier.wire.pieces import Piece, decode_piece
from lmtier.wire.status import REFUSALS

__all__ = ["Check", "PeerClient", "PeerTLS"]

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024**2
"""The largest piece accepted from a peer (a peer cuts chunks at its
``stream_piece_bytes``, 4 MiB by default)."""

Check = Callable[[ChunkKey, memoryview, int], CheckedRead]
"""Checks chunk ``key``, just received whole into ``buffer[:size]`` (``Tier.check_read``)."""


@dataclass(frozen=True, slots=True)
class PeerTLS:
    """How peers are dialled with TLS: the CA that signed the nodes' certificates, this
    node's own (presented as a client certificate), and the name checked in theirs
    (empty: the host dialled)."""

    ca_file: Path
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str = ""


class PeerClient:
    """Fetches chunks from peers (module docstring). Loop-bound; ``close`` when done."""

    def __init__(
        self,
        key: NodeKey,
        *,
        tls: PeerTLS | None = None,
        timeout_s: float = 1.0,
        progress: Progress | None = None,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
    ) -> None:
        self.key = key
        self._credentials = None
        self._options: list[tuple[str, object]] = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            *keepalive_options(keepalive_s),  # the default sidecar.keepalive_s
            ("grpc.enable_http_proxy", 0),
        ]
        if tls is not None:
            self._credentials = channel_credentials(tls.ca_file, tls.cert_file, tls.key_file)
            if tls.server_name:
                self._options.append(("grpc.ssl_target_name_override", tls.server_name))
        self.timeout_s = timeout_s
        self.progress = progress or Progress()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._refused: set[str] = set()

    def __repr__(self) -> str:
        return f"PeerClient(peers={sorted(self._channels)})"

    def _channel(self, address: str) -> grpc.aio.Channel:
        """The channel to ``address``, a ``host:port`` the caller has checked
        (``peer.allowed_peers``): grpc would take ``unix:`` and other schemes too."""
        channel = self._channels.get(address)
        if channel is None:
            options = self._options
            if self._credentials is None:
                channel = grpc.aio.insecure_channel(address, options=options)
            else:
                channel = grpc.aio.secure_channel(address, self._credentials, options=options)
            self._channels[address] = channel
        return channel

    async def count(self, address: str, keys: Sequence[ChunkKey]) -> int:
        """How many of ``keys``, from the first, the peer at ``address`` holds now.
        Raises BackendError when it could not be reached, refused this node's proof,
        or could not prove itself."""
        data = b"".join(keys)
        proof = self.key.prove(CONTAINS_METHOD, address, data)
        call = self._channel(address).unary_unary(
            CONTAINS_METHOD,
            request_serializer=pb.PeerFetchRequest.SerializeToString,
            response_deserializer=pb.PeerContainsReply.FromString,
        )(pb.PeerFetchRequest(keys=data), metadata=proof.metadata, timeout=self.timeout_s)
        try:
            await self._answered(address, call, proof)
            reply = await call
        except grpc.aio.AioRpcError as exc:
            raise self._error(address, exc.code(), exc.details()) from exc
        finally:
            call.cancel()
        self.progress.tick()
        return min(int(reply.leading), len(keys))

    async def _answered(self, address: str, call: Any, proof: RequestProof) -> None:
        """Wait for the reply's initial metadata; BackendUnavailable unless it answers
        ``proof`` (the peer holds the node secret and was dialled at its own address)."""
        if proof.answered_by(await call.initial_metadata()):
            return
        if call.done():  # it failed before any metadata: a refusal, or a dead peer
            code = await call.code()
            if code is not grpc.StatusCode.OK:
                raise self._error(address, code, await call.details())
        if address not in self._refused:
            self._refused.add(address)
            logger.warning(
                "peer %s (named by the directory) did not prove it holds the node secret: "
                "ignored; if no node of this cluster listens there, someone who can "
                "write the shared Redis may have named it",
                address,
            )
        raise BackendUnavailable(f"peer {address} did not prove it holds the node secret")

    async def fetch_into(
        self,
        address: str,
        keys: Sequence[ChunkKey],
        buffers: Sequence[memoryview],
        check: Check | None = None,
    ) -> list[int | CheckedRead | None]:
        """Fetch ``keys`` from the peer at ``address`` into ``buffers``: each chunk's
        length (with ``check``: what it returned for the chunk, as soon as the chunk
        was whole), None (the peer does not hold it, or the stream broke first) or
        UNSERVABLE (larger than its buffer). Raises BackendError when the peer could not
        be reached, refused this node's proof, could not prove itself, or failed
        before sending a whole chunk."""
        intake = _Intake(keys, buffers, check)
        data = b"".join(keys)
        proof = self.key.prove(FETCH_METHOD, address, data)
        call = self._channel(address).unary_stream(
            FETCH_METHOD,
            request_serializer=pb.PeerFetchRequest.SerializeToString,
            response_deserializer=None,
        )(pb.PeerFetchRequest(keys=data), metadata=proof.metadata)
        try:
            await self._answered(address, call, proof)
            async for raw in call:
                self.progress.tick()
                intake.take(decode_piece(raw))
        except grpc.aio.AioRpcError as exc:
            if not any(size is not None for size in intake.sizes):
                raise self._error(address, exc.code(), exc.details()) from exc
            logger.debug("peer %s: stream broke after some chunks: %s", address, exc.code())
        except ValueError as exc:
            logger.warning("peer %s sent a malformed stream: %s", address, exc)
            intake.abandon()
        finally:
            call.cancel()
        return intake.sizes

    def _error(self, address: str, code: grpc.StatusCode, details: str | None) -> BackendError:
        if code in REFUSALS:
            if address not in self._refused:
                self._refused.add(address)
                logger.warning(
                    "peer %s refused this node's proof (%s: %s): every node of the cluster "
                    "needs the same peer.token_file, and clocks within peer.proof_window_s",
                    address,
                    code.name,
                    brief(details),
                )
            return BackendUnavailable(f"peer {address} refused this node's proof ({code.name})")
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return BackendTimeout(f"peer {address}: deadline exceeded")
        return BackendUnavailable(f"peer {address}: {code.name}")

    async def close(self) -> None:
        """Close every channel; idempotent."""
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()


class _Intake:
    """Where the pieces of one fetch go: each chunk whole and in order into its buffer."""

    __slots__ = (
        "buffers",
        "check",
        "filled",
        "index",
        "keys",
        "sizes",
        "skipping",
        "total",
        "where",
    )

    def __init__(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview], check: Check | None
    ) -> None:
        self.keys, self.buffers, self.check = keys, buffers, check
        self.sizes: list[int | CheckedRead | None] = [None] * len(keys)
        self.where = {bytes(key): index for index, key in enumerate(keys)}
        self.index = -1
        self.total = self.filled = 0
        self.skipping = False

    def take(self, piece: Piece) -> None:
        """Copy one piece into its chunk's buffer (and check the chunk it completes);
        ValueError for a piece out of place."""
        if piece.offset == 0:
            index = self.where.get(piece.key, -1)
            if index < 0 or self.sizes[index] is not None or piece.total_length <= 0:
                raise ValueError("a piece of a chunk that was not asked for")
            self.index, self.total, self.filled = index, piece.total_length, 0
            self.skipping = self.total > len(self.buffers[index])
            if self.skipping:
                self.sizes[index] = UNSERVABLE
        elif self.index < 0 or piece.offset != self.filled:
            raise ValueError("a piece out of order")
        end = self.filled + len(piece.data)
        if end > self.total:
            raise ValueError("a piece past its chunk's length")
        if not self.skipping:
            self.buffers[self.index][self.filled : end] = piece.data
        self.filled = end
        if end == self.total and not self.skipping:
            index, check = self.index, self.check
            self.sizes[index] = (
                end if check is None else check(self.keys[index], self.buffers[index], end)
            )

    def abandon(self) -> None:
        """The stream went wrong: the chunk it was in the middle of is a miss."""
        if self.index >= 0 and self.filled != self.total:
            self.sizes[self.index] = None
