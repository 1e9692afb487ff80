"""The server's side of a request that does not parse: grpc hands a handler an
:class:`Unparsed` in its place, and the handler answers INVALID_ARGUMENT. Which code
each lmtier error is answered with is the wire's one table (:mod:`lmtier.wire.status`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from lmtier.errors import InvalidRequestError

__all__ = ["Unparsed", "lenient", "numeric_leaves", "parsed"]

R = TypeVar("R")


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
