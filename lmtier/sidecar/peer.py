"""The sidecar's peer listener: ``lmtier.v1.Peer`` on a TCP port of its own, serving
this node's CPU tier to the other nodes of a cluster (the ``peer`` tier's fetches).

Why a listener of its own: the sidecar's main listener is usually a unix socket (the
engines are on the node), while peers are on other machines; and a separate server
carries only ``Peer``, so the node secret cannot open sessions through it.

* **Only the CPU tier.** A fetch leases each cached chunk's slab (``CPUTier.share``,
  under the StorageManager's lock), streams it, and lets go: never a lower tier, so a
  request never bounces between nodes and a peer's miss costs the asker one round trip.
* **Sealed bytes only.** A chunk an engine stored is unsealed until its first write
  down (:mod:`lmtier.storage.sealing`), and the asker verifies what it receives: a
  fetch seals it first, with the StorageManager's sealer (its MAC key; a write down
  in flight shares the hash), so a node without lower tiers serves its peers too.
* **The node secret, proven, never sent.** Every call must carry a proof of the
  cluster's node secret made for this node's advertised address
  (:mod:`.peer_auth`), answered in the initial metadata before any byte of the reply;
  bearer tokens are refused. The node secret may not be a sidecar token (a
  ConfigError at start): every node holds it, and a sidecar token opens sessions.
* **Mutual TLS** with ``peer.tls_ca_file``: callers must present a certificate that
  CA signed.
* **Bounded.** At most :data:`MAX_FETCH_KEYS` keys per call; pieces of at most
  ``sidecar.stream_piece_bytes``, as ``LoadStream`` cuts them (:mod:`.pieces`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from lmtier.chunks.keys import KEY_BYTES, ChunkKey
from lmtier.config import LMTierConfig
from lmtier.errors import ConfigError, InvalidRequestError
from lmtier.local_store import HostView
from lmtier.sidecar.auth import Authenticator, tls_server_credentials
from lmtier.sidecar.metrics import SidecarMetrics
from lmtier.sidecar.status import lenient, parsed
from lmtier.storage.node import LocalNode
from lmtier.storage.plugins import peer_section
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.wire.address import parse_listen
from lmtier.wire.keepalive import millis
from lmtier.wire.peer_auth import (
    CONTAINS_METHOD,
    FETCH_METHOD,
    PEER_SERVICE,
    ProofChecker,
    node_key,
)
from lmtier.wire.pieces import chunk_pieces
from lmtier.wire.status import status_of

__all__ = ["MAX_FETCH_KEYS", "PeerServer"]

logger = logging.getLogger(__name__)

MAX_FETCH_KEYS = 4096
_WILDCARDS = ("0.0.0.0", "::", "")  # noqa: S104 - names of "every interface", not a bind


class PeerServer:
    """The peer listener (module docstring): ``await start()``, then :attr:`node`."""

    def __init__(
        self,
        config: LMTierConfig,
        auth: Authenticator,
        metrics: SidecarMetrics,
        host: HostView,
    ) -> None:
        self.config = config
        self.peer = peer = peer_section(config, directory=False)
        self.address = parse_listen(peer.listen, key="peer.listen")
        if self.address.kind != "tcp":
            raise ConfigError("peer.listen must be host:port (other machines dial it)")
        self.key = node_key(peer)
        if auth.accepts(self.key.secret):
            raise ConfigError(
                "the peer tier's node secret is also a sidecar token: give peer.token_file "
                "a secret of its own (every node holds it; a sidecar token opens sessions)",
                key="peer.token",
            )
        self.metrics = metrics
        self.cpu_tier, self.lock, self.sealer = host
        self._piece = config.sidecar.stream_piece_bytes
        self._server: grpc.aio.Server | None = None
        self.checker: ProofChecker | None = None
        self.node: LocalNode | None = None

    async def start(self) -> LocalNode:
        """Bind and serve; the node as other nodes reach it (``peer.advertise``, else
        the bound address)."""
        side, peer = self.config.sidecar, self.peer
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", side.max_message_bytes),
                ("grpc.max_receive_message_length", 1024**2),
                ("grpc.server_handshake_timeout_ms", millis(side.handshake_timeout_s)),
            ]
        )
        methods = {
            "Fetch": grpc.unary_stream_rpc_method_handler(
                self.Fetch,
                request_deserializer=lenient(pb.PeerFetchRequest),
                response_serializer=None,
            ),
            "Contains": grpc.unary_unary_rpc_method_handler(
                self.Contains,
                request_deserializer=lenient(pb.PeerFetchRequest),
                response_serializer=pb.PeerContainsReply.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(PEER_SERVICE, methods),)
        )
        credentials = None
        if peer.tls_cert_file is not None and peer.tls_key_file is not None:
            credentials = tls_server_credentials(
                peer.tls_cert_file, peer.tls_key_file, peer.tls_ca_file, "peer"
            )
        target = self.address.grpc_target
        if credentials is None:
            port = server.add_insecure_port(target)
        else:
            port = server.add_secure_port(target, credentials)
        advertise = peer.advertise
        if not advertise:
            if self.address.host in _WILDCARDS:
                raise ConfigError(
                    f"peer.listen {target} binds every interface: set peer.advertise to "
                    "the host:port other nodes dial",
                    key="peer.advertise",
                )
            host = self.address.grpc_target.rsplit(":", 1)[0]
            advertise = f"{host}:{port}"
        if not peer.policy.allows(advertise):
            raise ConfigError(
                f"this node is advertised as {advertise}, which peer.allowed_peers does not "
                "allow: nodes configured alike would never dial it (add its network or name)",
                key="peer.allowed_peers",
            )
        await server.start()
        self._server = server
        if not self.address.loopback and credentials is None:
            logger.warning(
                "the peer listener %s has no TLS: KV travels in clear text; set "
                "peer.tls_cert_file, peer.tls_key_file and peer.tls_ca_file",
                target,
            )
        self.checker = ProofChecker(self.key, advertise, window_s=peer.proof_window_s)
        self.node = LocalNode(self.cpu_tier, self.lock, advertise)
        logger.info("peer listener on %s (advertised as %s)", target, advertise)
        return self.node

    async def stop(self, grace_s: float | None) -> None:
        """Stop serving (calls in flight get ``grace_s``)."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace_s)

    async def Fetch(  # noqa: N802 - gRPC's method name
        self, request: pb.PeerFetchRequest, context: Any
    ) -> AsyncIterator[bytes]:
        """Stream the cached chunks of ``request.keys`` (module docstring)."""
        started, code = time.perf_counter(), grpc.StatusCode.OK
        try:
            keys, answer = self._checked(request, context, FETCH_METHOD)
            await context.send_initial_metadata(answer)
            for key in keys:
                with self.lock:
                    shared = self.cpu_tier.share(key)
                if shared is None:
                    continue
                handle, length = shared
                try:
                    if not (await self.sealer.seal([(handle, length)]))[0]:
                        continue  # not a chunk (logged): a miss for the asker
                    for piece in chunk_pieces(key, handle.view, length, self._piece, tier="peer"):
                        yield piece
                finally:
                    handle.release()
        except Exception as exc:
            code, text = status_of(exc, "PeerFetch")
            await context.abort(code, text)
        finally:
            self.metrics.observe_call("PeerFetch", time.perf_counter() - started, code.name)

    async def Contains(  # noqa: N802 - gRPC's method name
        self, request: pb.PeerFetchRequest, context: Any
    ) -> pb.PeerContainsReply:
        """How many leading keys of ``request.keys`` this node's CPU tier holds."""
        started, code = time.perf_counter(), grpc.StatusCode.OK
        try:
            keys, answer = self._checked(request, context, CONTAINS_METHOD)
            await context.send_initial_metadata(answer)
            with self.lock:
                leading = self.cpu_tier.count_prefix(keys)
            return pb.PeerContainsReply(leading=leading)
        except Exception as exc:
            code, text = status_of(exc, "PeerContains")
            await context.abort(code, text)
            raise  # abort raises; this keeps mypy's view of the return honest
        finally:
            self.metrics.observe_call("PeerContains", time.perf_counter() - started, code.name)

    def _checked(
        self, request: pb.PeerFetchRequest, context: Any, method: str
    ) -> tuple[list[ChunkKey], tuple[tuple[str, str], ...]]:
        """The keys of a call whose proof checks out, and the answer to send first;
        AuthenticationError or InvalidRequestError otherwise."""
        checker = self.checker
        if checker is None:
            raise ConnectionError("the peer listener is not started")
        request = parsed(request)
        answer = checker.check(context.invocation_metadata(), method, request.keys)
        return _keys(request.keys), answer


def _keys(data: bytes) -> list[ChunkKey]:
    if len(data) % KEY_BYTES:
        raise InvalidRequestError(f"keys must be 32 bytes each; got {len(data)} bytes")
    if len(data) > MAX_FETCH_KEYS * KEY_BYTES:
        raise InvalidRequestError(f"at most {MAX_FETCH_KEYS} keys per fetch")
    return [ChunkKey(data[i : i + KEY_BYTES]) for i in range(0, len(data), KEY_BYTES)]
