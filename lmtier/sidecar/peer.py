"""The sidecar's peer listener: ``lmtier.v1.Peer`` on a TCP port of its own, serving
this node's CPU tier to the other nodes of a cluster (the ``peer`` tier's fetches).

Why a listener of its own: the sidecar's main listener is usually a unix socket (the
engines are on the node), while peers are on other machines; and a separate server
carries only ``Peer``, so a node token cannot open sessions through it.

* **Only the CPU tier.** A fetch leases each cached chunk's slab (``CPUTier.share``,
  under the StorageManager's lock), streams it, and lets go: never a lower tier, so a
  request never bounces between nodes and a peer's miss costs the asker one round trip.
* **Sealed bytes only.** A chunk an engine stored is unsealed until its first write
  down (:mod:`lmtier.storage.sealing`), and the asker verifies what it receives: a
  fetch seals it first, with the StorageManager's sealer (its MAC key; a write down
  in flight shares the hash), so a node without lower tiers serves its peers too.
* **Node tokens only.** A token is always required (a listener without one is a
  ConfigError) and must be unscoped: a token limited to some models or salts could
  otherwise read every tenant's chunks by key, so it gets PERMISSION_DENIED.
* **Bounded.** At most :data:`MAX_FETCH_KEYS` keys per call; pieces of at most
  ``sidecar.stream_piece_bytes``, as ``LoadStream`` cuts them (:mod:`.pieces`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from lmtier.chunks.keys import KEY_BYTES, ChunkKey
from lmtier.config import LMTierConfig
from lmtier.errors import ConfigError, InvalidRequestError
from lmtier.sidecar.auth import Authenticator, server_credentials
from lmtier.sidecar.listen import HANDSHAKE_TIMEOUT_MS, parse_listen
from lmtier.sidecar.metrics import SidecarMetrics
from lmtier.sidecar.pieces import chunk_pieces
from lmtier.sidecar.status import lenient, parsed, status_of
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.node import LocalNode
from lmtier.storage.sealing import Sealer
from lmtier.v1 import sidecar_pb2 as pb

__all__ = ["MAX_FETCH_KEYS", "PEER_SERVICE", "PeerServer"]

logger = logging.getLogger(__name__)

PEER_SERVICE = "lmtier.v1.Peer"
MAX_FETCH_KEYS = 4096
_WILDCARDS = ("0.0.0.0", "::", "")  # noqa: S104 - names of "every interface", not a bind


class PeerServer:
    """The peer listener (module docstring): ``await start()``, then :attr:`node`."""

    def __init__(
        self,
        config: LMTierConfig,
        auth: Authenticator,
        metrics: SidecarMetrics,
        memory: CPUTier,
        lock: threading.RLock,
        *,
        sealer: Sealer,
    ) -> None:
        peer = config.peer
        self.config = config
        self.address = parse_listen(peer.listen, key="peer.listen")
        if self.address.kind != "tcp":
            raise ConfigError("peer.listen must be host:port (other machines dial it)")
        if not auth.required:
            raise ConfigError(
                "peer.listen needs a sidecar token (sidecar.auth_token_file or "
                "tokens_file): other nodes fetch with it",
                key="peer.listen",
            )
        self.auth = auth
        self.metrics = metrics
        self.memory, self.lock, self.sealer = memory, lock, sealer
        self._piece = config.sidecar.stream_piece_bytes
        self._server: grpc.aio.Server | None = None
        self.node: LocalNode | None = None

    async def start(self) -> LocalNode:
        """Bind and serve; the node as other nodes reach it (``peer.advertise``, else
        the bound address)."""
        side = self.config.sidecar
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", side.max_message_bytes),
                ("grpc.max_receive_message_length", 1024**2),
                ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
            ]
        )
        handler = grpc.unary_stream_rpc_method_handler(
            self.Fetch,
            request_deserializer=lenient(pb.PeerFetchRequest),
            response_serializer=None,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(PEER_SERVICE, {"Fetch": handler}),)
        )
        credentials = server_credentials(side)
        target = self.address.grpc_target
        if credentials is None:
            port = server.add_insecure_port(target)
        else:
            port = server.add_secure_port(target, credentials)
        await server.start()
        self._server = server
        advertise = self.config.peer.advertise
        if not advertise:
            if self.address.host in _WILDCARDS:
                await server.stop(None)
                raise ConfigError(
                    f"peer.listen {target} binds every interface: set peer.advertise to "
                    "the host:port other nodes dial",
                    key="peer.advertise",
                )
            host = self.address.grpc_target.rsplit(":", 1)[0]
            advertise = f"{host}:{port}"
        if not self.address.loopback and credentials is None:
            logger.warning(
                "the peer listener %s has no TLS: tokens and KV travel in clear text; "
                "set sidecar.tls_cert_file and sidecar.tls_key_file (and peer.tls_ca_file)",
                target,
            )
        self.node = LocalNode(self.memory, self.lock, advertise)
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
            principal = self.auth.authenticate(context.invocation_metadata())
            request = parsed(request)
            if not principal.reaches_all:
                raise PermissionError(
                    f"{principal.name} is scoped to some models or salts: peers fetch "
                    "with a node token that covers every namespace"
                )
            for key in _keys(request.keys):
                with self.lock:
                    shared = self.memory.share(key)
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


def _keys(data: bytes) -> list[ChunkKey]:
    if len(data) % KEY_BYTES:
        raise InvalidRequestError(f"keys must be 32 bytes each; got {len(data)} bytes")
    if len(data) > MAX_FETCH_KEYS * KEY_BYTES:
        raise InvalidRequestError(f"at most {MAX_FETCH_KEYS} keys per fetch")
    return [ChunkKey(data[i : i + KEY_BYTES]) for i in range(0, len(data), KEY_BYTES)]
