"""What a failed sidecar call means to its client: a miss, or an error for that call.

A client lives by one rule (:mod:`.connection`): a sidecar that is down, restarting
or does not know this client costs misses, never a failed request; an error that is
the call's own raises for that call, and changes nothing for the others. So each
status code says two things, what the caller gets and whether the sidecar is up
(its circuit breaker records a success, or opens):

======================  ==========================================  ===========
code                    the caller gets                             sidecar
======================  ==========================================  ===========
INVALID_ARGUMENT        InvalidRequestError (its arguments)         up
PERMISSION_DENIED       PermissionDeniedError (a namespace outside  up
                        its token's scope: another salt or model)
RESOURCE_EXHAUSTED      a miss (busy)                               up
NOT_FOUND               a miss; its sessions are reopened           up
UNAUTHENTICATED         a miss (:class:`SidecarRefused`), logged    down
anything else           a miss                                      down
======================  ==========================================  ===========

PERMISSION_DENIED is not "down": a token scoped to one cache salt is refused every
other namespace, the unsalted one included, by a sidecar that serves its own salt
well; taking the refusal for an outage opened the breaker and cost the allowed
salt's calls too. UNAUTHENTICATED (a token the sidecar does not accept, e.g. one
rotated on the sidecar while engines run) makes every call of this client fail
alike, so it is answered as an outage: misses, an ERROR line per attempt (one per
breaker probe, at most one every 5 s), and tools that must tell it apart
(``lmtier stats --sidecar``) ask :meth:`.connection.Connection.check`, which raises
AuthenticationError for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from lmtier.errors import InvalidRequestError, PermissionDeniedError

__all__ = ["Outcome", "SidecarRefused", "SidecarUnavailable", "outcome"]

_EXPECTED = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)
"""The codes of a sidecar that is down or failing, which need no log line of their
own (the breaker's warning says it once)."""


class SidecarUnavailable(Exception):
    """The call cannot reach a working session now: answer it as a miss."""


class SidecarRefused(SidecarUnavailable):
    """The sidecar does not accept this client's token (UNAUTHENTICATED): a miss, as
    an outage is (module docstring)."""


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
    ``code`` and ``details`` (the module docstring's table)."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return Outcome(InvalidRequestError(f"sidecar: {details}"), answered=True)
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return Outcome(PermissionDeniedError(f"sidecar: {details}"), answered=True)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Outcome(SidecarUnavailable(details), answered=True)
    if code == grpc.StatusCode.NOT_FOUND:  # it forgot our sessions: reopen on the next call
        return Outcome(SidecarUnavailable(details), answered=True, forget=True)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        complaint = f"sidecar {target} refused this client's token: {details}"
        return Outcome(SidecarRefused(details), answered=False, complaint=complaint)
    complaint = "" if code in _EXPECTED else f"sidecar {target}: unexpected {code.name}: {details}"
    return Outcome(SidecarUnavailable(details), answered=False, complaint=complaint)
