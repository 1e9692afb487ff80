"""HTTP/2 keepalive on the wire's gRPC channels, from ``sidecar.keepalive_s``.

Both ends ping an idle connection every ``keepalive_s`` and give up on it when a ping
goes unanswered that long, so a peer gone without a FIN (a machine lost, a cable
cut, a process frozen) is noticed within about two keepalives: the server ends its
sessions and leases, a client reconnects. The sidecar's server and its clients
(``lmtier.connect``, the ops commands) read the same setting, so a test (or an
operator) that shortens it shortens both sides alike; they must agree, since the
server refuses pings more often than every half of its own. The peer tier's
channels ping at the default.
"""

from __future__ import annotations

from lmtier.config.sidecar import SidecarConfig

__all__ = ["DEFAULT_KEEPALIVE_S", "keepalive_options", "millis"]

DEFAULT_KEEPALIVE_S: float = SidecarConfig.model_fields["keepalive_s"].default
"""``sidecar.keepalive_s``'s default, for a channel built without a config."""


def millis(seconds: float) -> int:
    """``seconds`` as the whole milliseconds grpc's options take (at least 1)."""
    return max(1, round(seconds * 1000))


def keepalive_options(keepalive_s: float) -> list[tuple[str, int]]:
    """A channel's keepalive options: a ping every ``keepalive_s`` on an idle
    connection, and as long for its answer."""
    ms = millis(keepalive_s)
    return [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms)]
