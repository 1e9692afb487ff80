"""What an lmtier error is on the wire: one gRPC status code per kind of failure,
with lmtier's message and never a stack trace."""

from __future__ import annotations

import logging
import secrets

import grpc
from google.protobuf.message import DecodeError

from lmtier.errors import (
    AuthenticationError,
    CacheClosedError,
    CapacityError,
    ConfigError,
    InvalidRequestError,
    LMTierError,
)
from lmtier.sidecar.sessions import SessionNotFound

__all__ = ["Draining", "NotOffered", "numeric_leaves", "status_of"]

logger = logging.getLogger(__name__)


class Draining(LMTierError):
    """The sidecar is shutting down and takes no new work."""


class NotOffered(LMTierError):
    """The call needs something this session was not given (shared memory)."""


_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionError, grpc.StatusCode.PERMISSION_DENIED),
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Draining, grpc.StatusCode.UNAVAILABLE),
    (CacheClosedError, grpc.StatusCode.UNAVAILABLE),
    (NotOffered, grpc.StatusCode.FAILED_PRECONDITION),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (DecodeError, grpc.StatusCode.INVALID_ARGUMENT),  # a client stream's unparsable message
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
)


def status_of(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    """The status code and message a failed call answers with. An unexpected exception
    is INTERNAL: logged here with its traceback under an id the message names."""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code, str(exc) or kind.__name__
    incident = secrets.token_hex(4)
    logger.error("%s failed (incident %s)", method, incident, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error in the sidecar (incident {incident})"


def numeric_leaves(entry: dict[str, object], prefix: str = "") -> list[tuple[str, float]]:
    """The numeric leaves of a stats entry, nested names joined with '.'."""
    out: list[tuple[str, float]] = []
    for name, value in entry.items():
        if isinstance(value, (bool, int, float)):
            out.append((prefix + name, float(value)))
        elif isinstance(value, dict):
            out.extend(numeric_leaves(value, f"{prefix}{name}."))
    return out
