"""One session as its client holds it, and how its ``OpenSession`` stream is read.

A session lives as long as its stream (:mod:`.connection` opens and watches it): the
first event says it opened (its :class:`~lmtier.v1.sidecar_pb2.SessionInfo`), and the
stream's end is the session's end, in the sidecar as here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import grpc

from lmtier.storage.host_pool import HostPool
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.wire.lane import LaneClient
from lmtier.wire.status import SidecarUnavailable

__all__ = ["ClientSession", "first_event"]


@dataclass(eq=False)
class ClientSession:
    """One open session of a client (:mod:`.connection`)."""

    info: pb.SessionInfo
    call: Any
    pool: HostPool | None
    """The shared pool's slabs, mapped (None: this session streams)."""
    lane: LaneClient | None = None
    """The local lane for this session's data-path calls (None: gRPC)."""
    alive: bool = True
    releases: list[int] = field(default_factory=list)
    held: int = 0
    """Leases of this session held here (:class:`~lmtier.remote.slabs.RemoteSlab`)."""
    ending: bool = False
    """Ended here while leases were held: its stream is cancelled once the last ends."""

    @property
    def id(self) -> bytes:
        return bytes(self.info.session_id)


def first_event(call: Any, timeout_s: float) -> pb.SessionEvent:
    """The first message of an OpenSession stream, within ``timeout_s``."""
    result: list[Any] = []

    def read() -> None:
        try:
            result.append(next(call))
        except BaseException as exc:  # an RpcError, or StopIteration on a bare close
            result.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not result:
        call.cancel()
        reader.join()
    first = result[0]
    if isinstance(first, grpc.RpcError):
        raise first
    if isinstance(first, BaseException) or first.WhichOneof("event") != "opened":
        raise SidecarUnavailable("the sidecar ended the session before opening it")
    event: pb.SessionEvent = first
    return event
