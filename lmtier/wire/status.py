"""The wire's error contract, both ways, in one table: which lmtier errors the server
answers with which gRPC status code, and what that code means to the client.

A client lives by one rule (:mod:`lmtier.remote.connection`): a sidecar that is down,
restarting or does not know this client costs misses, never a failed request; an
error that is the call's own raises for that call, and changes nothing for the
others. So each status code says two things, what the caller gets and whether the
sidecar is up (its circuit breaker records a success, or opens):

===================  ===============================  ==========================  ======
code                 the server sends it for          the caller gets             sidecar
===================  ===============================  ==========================  ======
UNAUTHENTICATED      AuthenticationError              a miss (:class:`SidecarRe-  down
                                                      fused`), logged
PERMISSION_DENIED    PermissionError (a namespace     PermissionDeniedError       up
                     outside its token's scope)
NOT_FOUND            :class:`SessionNotFound`         a miss; sessions reopened   up
RESOURCE_EXHAUSTED   CapacityError                    a miss (busy)               up
UNAVAILABLE          :class:`Draining`,               a miss                      down
                     CacheClosedError
FAILED_PRECONDITION  :class:`NotOffered`              a miss                      down
INVALID_ARGUMENT     InvalidRequestError,             InvalidRequestError (its    up
                     a message that does not parse,   arguments)
                     ConfigError
DEADLINE_EXCEEDED,   (grpc's own, or INTERNAL: any    a miss                      down
CANCELLED, UNKNOWN,  other exception, logged on the
INTERNAL, ABORTED    server under an incident id)
anything else        -                                a miss, logged              down
===================  ===============================  ==========================  ======

PERMISSION_DENIED is not "down": a token scoped to one cache salt is refused every
other namespace, the unsalted one included, by a sidecar that serves its own salt
well; taking the refusal for an outage opened the breaker and cost the allowed
salt's calls too. UNAUTHENTICATED (a token the sidecar does not accept, e.g. one
rotated on the sidecar while engines run) makes every call of this client fail
alike, so it is answered as an outage: misses, an ERROR line per attempt (one per
breaker probe, at most one every 5 s), and tools that must tell it apart
(``lmtier stats --sidecar``) ask :meth:`lmtier.remote.connection.Connection.check`,
which raises AuthenticationError for it.

The server reads the table with :func:`status_of`, the client with :func:`outcome`;
the lane carries the same codes as numbers (:mod:`.lane`).
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from lmtier.errors import (
    AuthenticationError,
    CacheClosedError,
    CapacityError,
    ConfigError,
    InvalidRequestError,
    LMTierError,
    PermissionDeniedError,
)

__all__ = [
    "MAX_DETAILS",
    "REFUSALS",
    "TABLE",
    "Draining",
    "Meaning",
    "NotOffered",
    "Outcome",
    "SessionNotFound",
    "SidecarRefused",
    "SidecarUnavailable",
    "meaning_of",
    "outcome",
    "status_of",
]

logger = logging.getLogger(__name__)

Code = grpc.StatusCode


class Draining(LMTierError):
    """The sidecar is shutting down and takes no new work."""


class NotOffered(LMTierError):
    """The call needs something this session was not given (shared memory)."""


class SessionNotFound(LMTierError, LookupError):
    """A call named a session that does not exist (never opened, closed, or expired)."""


class SidecarUnavailable(Exception):
    """The call cannot reach a working session now: answer it as a miss."""


class SidecarRefused(SidecarUnavailable):
    """The sidecar does not accept this client's token (UNAUTHENTICATED): a miss, as
    an outage is (module docstring)."""


@dataclass(frozen=True, slots=True)
class Meaning:
    """One row of the table (module docstring): the ``code``, the exceptions the server
    answers with it (``sent_for``, tried in the table's order), the exception the
    client raises for it (``raised``: a :class:`SidecarUnavailable` is a miss; an
    lmtier error is the caller's own and says ``sidecar: <details>``), whether the
    sidecar is ``up`` (the breaker records a success), whether the client reopens its
    sessions (``forget``), and the ERROR line the client writes (``complaint``, with
    ``{target}``, ``{code}`` and ``{details}``; empty: none)."""

    code: grpc.StatusCode
    sent_for: tuple[type[BaseException], ...]
    raised: type[Exception]
    up: bool
    forget: bool = False
    complaint: str = ""


TABLE: tuple[Meaning, ...] = (
    Meaning(
        Code.UNAUTHENTICATED,
        (AuthenticationError,),
        SidecarRefused,
        up=False,
        complaint="sidecar {target} refused this client's token: {details}",
    ),
    Meaning(Code.PERMISSION_DENIED, (PermissionError,), PermissionDeniedError, up=True),
    Meaning(Code.NOT_FOUND, (SessionNotFound,), SidecarUnavailable, up=True, forget=True),
    Meaning(Code.RESOURCE_EXHAUSTED, (CapacityError,), SidecarUnavailable, up=True),
    Meaning(Code.UNAVAILABLE, (Draining, CacheClosedError), SidecarUnavailable, up=False),
    Meaning(Code.FAILED_PRECONDITION, (NotOffered,), SidecarUnavailable, up=False),
    Meaning(
        Code.INVALID_ARGUMENT,
        # DecodeError: a client stream's unparsable message
        (InvalidRequestError, DecodeError, ConfigError),
        InvalidRequestError,
        up=True,
    ),
    *(
        Meaning(code, (), SidecarUnavailable, up=False)
        for code in (
            Code.DEADLINE_EXCEEDED,
            Code.CANCELLED,
            Code.UNKNOWN,
            Code.INTERNAL,
            Code.ABORTED,
        )
    ),
)
"""Every code the wire uses on purpose, in the order the server tries them."""

_UNEXPECTED = Meaning(
    Code.UNKNOWN,
    (),
    SidecarUnavailable,
    up=False,
    complaint="sidecar {target}: unexpected {code}: {details}",
)
"""What any code the table does not list means to the client."""
_BY_CODE = {meaning.code: meaning for meaning in TABLE}

REFUSALS = frozenset({Code.UNAUTHENTICATED, Code.PERMISSION_DENIED})
"""The codes of a call refused for who made it (its token, proof or scope), not for
what it asked: the peer tier warns of these once per peer."""

MAX_DETAILS = 1024
"""Characters of a status message at most: it travels as a header, which grpc caps
(16 KiB), and a message that quotes a long hostile string must not turn the caller's
error into another one (RESOURCE_EXHAUSTED from grpc's header limit)."""


def status_of(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    """The status code and message a failed call answers with (the server's reading of
    the table). An unexpected exception is INTERNAL: logged here with its traceback
    under an id the message names."""
    for meaning in TABLE:
        for kind in meaning.sent_for:
            if isinstance(exc, kind):
                text = str(exc) or kind.__name__
                if len(text) > MAX_DETAILS:
                    text = text[: MAX_DETAILS - 20] + f"... ({len(text)} characters)"
                return meaning.code, text
    incident = secrets.token_hex(4)
    logger.error("%s failed (incident %s)", method, incident, exc_info=exc)
    return Code.INTERNAL, f"internal error in the sidecar (incident {incident})"


def meaning_of(code: grpc.StatusCode) -> Meaning:
    """The table's row for ``code`` (an unlisted code: a miss, down, logged)."""
    return _BY_CODE.get(code, _UNEXPECTED)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a failed call means: ``error`` for the caller to raise (a
    :class:`SidecarUnavailable` is a miss), whether the sidecar ``answered`` (up: the
    breaker records a success; else it opens), whether its sessions are to be
    reopened (``forget``: it no longer knows them), and a ``complaint`` worth an ERROR
    line (empty: none)."""

    error: Exception
    answered: bool
    forget: bool = False
    complaint: str = ""


def outcome(code: grpc.StatusCode, details: str, target: str) -> Outcome:
    """The :class:`Outcome` of a call to the sidecar at ``target`` that failed with
    ``code`` and ``details`` (the client's reading of the table)."""
    meaning = meaning_of(code)
    caller_s = issubclass(meaning.raised, LMTierError)
    error = meaning.raised(f"sidecar: {details}" if caller_s else details)
    complaint = meaning.complaint.format(target=target, code=code.name, details=details)
    return Outcome(error, answered=meaning.up, forget=meaning.forget, complaint=complaint)
