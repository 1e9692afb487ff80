"""Whether a sidecar serves: its ``grpc.health.v1`` answer, which needs no token.

Used by whoever waits for a sidecar (tests, ``lmtier cluster``) and kept apart from
:mod:`.connection`, whose calls carry a token and a session.
"""

from __future__ import annotations

import grpc

__all__ = ["serving_problem"]


def serving_problem(target: str, timeout_s: float) -> str | None:
    """None when the sidecar at ``target`` (a gRPC target: ``unix:///...``, ``host:port``)
    says SERVING through ``grpc.health.v1``, which needs no token (it tells whether the
    process serves, nothing of what it holds); else why not, in a few words."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415 - probes only

    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
    except grpc.RpcError as exc:
        return f"sidecar {target}: {exc.code().name}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return f"sidecar {target}: {name}"
    return None
