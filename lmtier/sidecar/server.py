"""``lmtier serve``: one process that owns a node's KV cache and serves it over gRPC.

:class:`Sidecar` assembles the parts on one asyncio loop: the host pool (in shared
memory when clients may map it), the StorageManager with every configured tier, one
:class:`~lmtier.sidecar.namespaces.NamespaceCheck` for all the namespaces its
sessions describe, the gRPC server (``lmtier.v1.Sidecar`` and ``grpc.health.v1``), the peer
listener when ``peer.listen`` is set (:mod:`.peer`), the lease reaper and the Prometheus endpoint.

Shutdown (SIGTERM or SIGINT) drains: health turns NOT_SERVING and new calls get
UNAVAILABLE; sessions are told and end; calls in flight finish (up to half of
``sidecar.drain_timeout_s``); queued background writes are flushed within what is
left; the tiers close; the shared pool's file and the socket are removed; exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from lmtier.chunks.integrity import load_key
from lmtier.config import LMTierConfig
from lmtier.errors import ConfigError
from lmtier.sidecar.auth import Authenticator, server_credentials
from lmtier.sidecar.lane import LaneServer, lane_path
from lmtier.sidecar.listen import (
    HANDSHAKE_TIMEOUT_MS,
    ListenAddress,
    check_policy,
    default_listen,
    parse_listen,
    prepare_unix_socket,
    secure_unix_socket,
)
from lmtier.sidecar.metrics import MetricsServer, SidecarMetrics
from lmtier.sidecar.namespaces import NamespaceCheck
from lmtier.sidecar.peer import PeerServer
from lmtier.sidecar.service import Parts, SidecarService
from lmtier.sidecar.sessions import Sessions
from lmtier.sidecar.shares import Shares
from lmtier.sidecar.status import lenient
from lmtier.storage.cpu_tier import open_cpu_tier
from lmtier.storage.manager import StorageManager
from lmtier.storage.node import SharesNode
from lmtier.storage.plugins import open_tiers
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.wire.shm import SharedRegion

__all__ = ["SERVICE_NAME", "Sidecar"]

logger = logging.getLogger(__name__)

SERVICE_NAME = "lmtier.v1.Sidecar"
KEEPALIVE_MS = 10_000
"""HTTP/2 pings on idle connections: a peer gone without a FIN (a machine lost, a
cable cut) is noticed within ~2 keepalives, and its sessions and leases end."""


class Sidecar:
    """A running sidecar (module docstring). ``await start()``, then ``await
    wait_closed()``; :meth:`drain` (also on SIGTERM) ends it."""

    def __init__(self, config: LMTierConfig, listen: str | None = None) -> None:
        self.config = config
        side = config.sidecar
        self.address: ListenAddress = parse_listen(
            listen or side.listen or default_listen(os.environ)
        )
        self.auth = Authenticator.from_config(side)
        check_policy(self.address, side, self.auth)
        self.metrics = SidecarMetrics()
        self.shm: SharedRegion | None = None
        self.service: SidecarService | None = None
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._metrics_server: MetricsServer | None = None
        self._lane: LaneServer | None = None
        self._peer: PeerServer | None = None
        self._manager: StorageManager | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = asyncio.Event()
        self._draining = False

    @property
    def target(self) -> str:
        """What a client dials (``unix:///...`` or ``host:port`` with the bound port)."""
        if self.address.kind == "unix":
            return self.address.grpc_target
        host = self.address.grpc_target.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def start(self) -> None:
        """Open the pool and tiers, bind, and serve."""
        config, side = self.config, self.config.sidecar
        offer_shm = side.shared_memory and self.address.kind == "unix"

        def shared(size: int) -> Any:
            self.shm = SharedRegion.create(side.shm_dir, size)
            return self.shm.tensor

        cpu, disk = config.cpu, config.disk
        memory = open_cpu_tier(
            side.slab_bytes,
            cached_bytes=cpu.capacity_bytes if cpu.enabled else 0,
            staging_bytes=cpu.staging_bytes,
            max_pinned_fraction=cpu.max_pinned_fraction,
            direct_io=disk.enabled and disk.o_direct,
            region=shared if offer_shm else None,
        )
        pool = memory.pool
        mac = load_key(config.integrity.key, config.integrity.key_file)
        check = NamespaceCheck(mac)
        try:
            tiers = await open_tiers(config)
            manager = StorageManager(memory, tiers, check=check)
            await manager.start()
        except BaseException:
            pool.close()
            self._drop_shm()
            raise
        self._manager = manager
        await self._open_peer(manager)
        sessions = Sessions(
            max_sessions=side.max_sessions,
            lease_ttl_s=side.lease_ttl_s,
            shares=self._shares(pool.num_slabs),
        )
        parts = Parts(config, manager, pool, check, sessions, self.auth, self.metrics, self.shm)
        self.service = service = SidecarService(parts)
        self._pool = pool
        try:
            await self._serve(service)
        except BaseException:
            await self._abandon_start()
            raise
        self.metrics.set_sources(
            tiers=lambda: {t.name: t.stats for t in (manager.memory, *manager.tiers)},
            extra=lambda: _queue_depths(manager),
            gauges=service.gauges,
        )
        if side.metrics_listen:
            self._metrics_server = self.metrics.serve(side.metrics_listen)
        self._tasks.append(asyncio.create_task(self._reap(sessions)))
        logger.info(
            "lmtier sidecar serving on %s (%s, %d slabs of %d bytes%s)",
            self.target,
            "token required" if self.auth.required else "no token",
            pool.num_slabs,
            pool.slab_bytes,
            ", shared memory" if offer_shm else "",
        )

    async def _abandon_start(self) -> None:
        """Undo a start that failed once the tiers were open (the listener would not
        bind): close them, and leave no pool file behind."""
        if self._peer is not None:
            await self._peer.stop(None)
        if self._manager is not None:
            await self._manager.close()
        self._pool.close()
        self._drop_shm()

    def _shares(self, num_slabs: int) -> Shares:
        """What one token may hold (:mod:`.shares`): ``sidecar.token_share``, else an
        equal share of the sessions and slabs for each token."""
        side = self.config.sidecar
        callers = self.auth.num_principals
        share = side.token_share if side.token_share is not None else 1 / callers
        shares = Shares.of(share, max_sessions=side.max_sessions, num_slabs=num_slabs)
        if callers > 1:
            logger.info(
                "each of %d tokens may hold %d sessions and %d of %d slabs%s",
                callers,
                shares.sessions_each,
                shares.slabs_each,
                num_slabs,
                " (sidecar.token_share is more than an equal share: together they can "
                "take them all, and a token may find none left)"
                if share * callers > 1 + 1e-9
                else "",
            )
        return shares

    async def _open_peer(self, manager: StorageManager) -> None:
        """With ``peer.listen``: serve this node's CPU tier to other nodes
        (:mod:`.peer`) and tell the tiers, so that the peer tier publishes it."""
        if not (self.config.peer.enabled and self.config.peer.listen):
            return
        peer = PeerServer(
            self.config,
            self.auth,
            self.metrics,
            manager.memory,
            manager.lock,
            sealer=manager.writes.sealer,
        )
        try:
            node = await peer.start()
            for tier in manager.tiers:
                if isinstance(tier, SharesNode):
                    await tier.attach_node(node)
        except BaseException:
            await peer.stop(None)
            await manager.close()
            manager.memory.pool.close()
            self._drop_shm()
            raise
        self._peer = peer

    async def _serve(self, service: SidecarService) -> None:
        side = self.config.sidecar
        options = [
            ("grpc.max_receive_message_length", side.max_message_bytes),
            ("grpc.max_send_message_length", side.max_message_bytes),
            ("grpc.keepalive_time_ms", KEEPALIVE_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
            # A keepalive that finds one of grpc's flow-control pings in flight (a
            # client uploading: StoreStream) waits for that ping's answer, whose
            # timeout defaults to 60 s: a client frozen mid-upload kept its session
            # and connection that long.
            ("grpc.http2.ping_timeout_ms", KEEPALIVE_MS),
            ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
        ]
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((method_handlers(service),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        credentials = server_credentials(side)
        address = self.address
        if address.kind == "unix":
            assert address.path is not None  # a unix address has one
            prepare_unix_socket(address.path)
        old_umask = os.umask(0o177)  # the socket is born owner-only, no window
        try:
            target = address.grpc_target
            try:
                if credentials is None:
                    self.port = server.add_insecure_port(target)
                else:
                    self.port = server.add_secure_port(target, credentials)
            except RuntimeError:  # grpc's only word for it: "Failed to bind to address"
                raise ConfigError(
                    f"sidecar.listen: cannot listen on {target} (in use, or not an address "
                    "of this machine)",
                    key="sidecar.listen",
                ) from None
            await server.start()
        finally:
            os.umask(old_umask)
        if address.kind == "unix":
            assert address.path is not None
            secure_unix_socket(address.path)
            if self.shm is not None:
                await self._open_lane(service, address.path)
        self._server = server
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def _open_lane(self, service: SidecarService, socket_path: Path) -> None:
        """The local lane beside the socket (:mod:`lmtier.sidecar.lane`), 0600."""
        path = lane_path(socket_path)
        prepare_unix_socket(path)
        lane = LaneServer(service, path, self.config.sidecar.max_message_bytes)
        old_umask = os.umask(0o177)
        try:
            await lane.start()
        finally:
            os.umask(old_umask)
        secure_unix_socket(path)
        self._lane, service.lane = lane, str(path)

    async def _reap(self, sessions: Sessions) -> None:
        interval = min(1.0, sessions.lease_ttl_s / 4)
        while True:
            await asyncio.sleep(interval)
            sessions.reap()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT drain (on the running loop)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, functools.partial(self._on_signal, sig))

    def _on_signal(self, sig: signal.Signals) -> None:
        logger.info("%s: draining", signal.Signals(sig).name)
        self._tasks.append(asyncio.create_task(self.drain()))

    async def drain(self) -> None:
        """Stop serving gracefully (module docstring). Idempotent."""
        if self._draining:
            await self._closed.wait()
            return
        self._draining = True
        deadline = time.monotonic() + self.config.sidecar.drain_timeout_s
        try:
            await self._drain(deadline)
        finally:
            self._closed.set()

    async def _drain(self, deadline: float) -> None:
        service, server, manager = self.service, self._server, self._manager
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if service is not None:
            await self._finish_calls(service, deadline)
        if server is not None:
            await server.stop(max(0.0, (deadline - time.monotonic()) / 2))
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        if manager is not None:
            try:
                await asyncio.wait_for(manager.flush(), max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                logger.warning("drain: background writes still queued at the deadline")
            await manager.close()  # the peer tier withdraws this node from the directory
        if self._peer is not None:
            await self._peer.stop(0)
        if service is not None:
            for session in service.parts.sessions:
                service.parts.sessions.close(session)
        self._release()
        logger.info("lmtier sidecar stopped")

    async def _finish_calls(self, service: SidecarService, deadline: float) -> None:
        """Refuse new calls, let those in flight (on the lane too) finish within half
        the time left, then end the sessions: ending one ends its leases, so a call
        that grants some must finish first."""
        service.draining = True
        grace = max(0.0, (deadline - time.monotonic()) / 2)
        if self._lane is not None:
            await self._lane.close(grace)
        if not await service.in_flight.wait_idle(deadline - time.monotonic() - grace):
            logger.warning("drain: %d call(s) still in flight", service.in_flight.count)
        for session in service.parts.sessions:
            session.ended.set()

    def _release(self) -> None:
        """The last of a drain: metrics, the pool and its file, the socket."""
        if self._metrics_server is not None:
            self._metrics_server.close()
        self._pool.close()
        self._drop_shm()
        if self.address.kind == "unix" and self.address.path is not None:
            with contextlib.suppress(OSError):
                Path(self.address.path).unlink()

    def _drop_shm(self) -> None:
        if self.shm is not None:
            self.shm.close()

    async def wait_closed(self) -> None:
        """Until :meth:`drain` has finished."""
        await self._closed.wait()


def method_handlers(service: SidecarService) -> grpc.GenericRpcHandler:
    """The handlers of ``lmtier.v1.Sidecar``, built from its descriptor: protobuf
    (de)serializers for every message but the chunk pieces of ``LoadStream`` and
    ``StoreStream``, which travel as bytes that :mod:`lmtier.wire.pieces` encodes
    and parses (one copy of the chunk's bytes each way)."""
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["Sidecar"].methods:
        request, reply = getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)
        make = kinds[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            getattr(service, method.name),
            request_deserializer=None if method.name == "StoreStream" else lenient(request),
            response_serializer=None if method.name == "LoadStream" else reply.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def _queue_depths(manager: StorageManager) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for tier in manager.tiers:
        depth = manager.writes.depth(tier)
        if depth is None:  # a tier without writes may still have work waiting (peer)
            depth = tier.usage().get("pending")
        if depth is not None:
            out[tier.name] = {"queue_depth": float(depth)}
    return out


async def serve(config: LMTierConfig, listen: str | None = None) -> int:
    """Run a sidecar until SIGTERM or SIGINT; the exit code (0 after a drain)."""
    sidecar = Sidecar(config, listen)
    await sidecar.start()
    sidecar.install_signal_handlers()
    print(f"lmtier sidecar listening on {sidecar.target}", flush=True)
    await sidecar.wait_closed()
    return 0
