"""What an lmtier error is on the wire: one gRPC status code per kind of failure,
with lmtier's message and never a stack trace."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any, TypeVar

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

__all__ = [
    "MAX_DETAILS",
    "Draining",
    "NotOffered",
    "Unparsed",
    "lenient",
    "numeric_leaves",
    "parsed",
    "status_of",
]

logger = logging.getLogger(__name__)
R = TypeVar("R")


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


MAX_DETAILS = 1024
"""Characters of a status message at most: it travels as a header, which grpc caps
(16 KiB), and a message that quotes a long hostile string must not turn the caller's
error into another one (RESOURCE_EXHAUSTED from grpc's header limit)."""


def status_of(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    """The status code and message a failed call answers with. An unexpected exception
    is INTERNAL: logged here with its traceback under an id the message names."""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            text = str(exc) or kind.__name__
            if len(text) > MAX_DETAILS:
                text = text[: MAX_DETAILS - 20] + f"... ({len(text)} characters)"
            return code, text
    incident = secrets.token_hex(4)
    logger.error("%s failed (incident %s)", method, incident, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error in the sidecar (incident {incident})"


class Unparsed:
    """A request message that did not parse: what :func:`lenient` hands a handler in its
    place, so that the handler answers INVALID_ARGUMENT (grpc itself would answer
    UNKNOWN and log a traceback for a deserializer that raises)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def lenient(message_type: Any) -> Callable[[bytes], Any]:
    """A request deserializer for grpc: the parsed message, or :class:`Unparsed`."""

    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return Unparsed(f"a malformed {message_type.__name__}: {exc}")

    return parse


def parsed(request: R) -> R:
    """``request`` as a handler takes it: InvalidRequestError if it did not parse."""
    if isinstance(request, Unparsed):
        raise InvalidRequestError(request.error)
    return request


def numeric_leaves(entry: dict[str, object], prefix: str = "") -> list[tuple[str, float]]:
    """The numeric leaves of a stats entry, nested names joined with '.'."""
    out: list[tuple[str, float]] = []
    for name, value in entry.items():
        if isinstance(value, (bool, int, float)):
            out.append((prefix + name, float(value)))
        elif isinstance(value, dict):
            out.extend(numeric_leaves(value, f"{prefix}{name}."))
    return out
