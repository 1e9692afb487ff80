"""Every exception lmtier raises on purpose.

Callers catch :class:`LMTierError` to catch them all, or one branch of the tree.
Foreign exceptions (OSError, redis, botocore) are translated once, at the edge of
the module that talks to them, with ``raise ... from exc`` so the cause survives.

Expected conditions are *not* exceptions: a miss, a full queue or a dead remote tier
come back as values (a shorter hit, a counter). Exceptions are for bad input, bad
configuration and bugs.

::

    LMTierError
    ├── ConfigError                 invalid or unknown configuration (names the key)
    ├── InvalidRequestError         a call's arguments that cannot be used (ValueError, TypeError)
    │   ├── InvalidTokensError      token ids that are negative, non-integer or too large
    │   └── InvalidKVError          KV whose dtype, shape or device does not match the cache
    ├── CacheClosedError            a cache used after close (RuntimeError)
    ├── CorruptChunk                bytes that are not a valid chunk; a tier treats it as a miss
    │   ├── BadMagic                not a chunk at all (foreign or zeroed file)
    │   ├── UnsupportedVersion      a chunk from a newer or older format
    │   ├── HeaderTooLarge          a header length beyond the format's limit
    │   ├── TruncatedChunk          fewer bytes than the header promises
    │   ├── ChecksumMismatch        payload bytes changed after encoding
    │   ├── InconsistentChunk       header fields that contradict each other or the size
    │   └── UnauthenticChunk        a MAC that does not match (forged, or another key)
    ├── BackendError                a storage tier failed; the StorageManager turns it into a miss
    │   ├── BackendUnavailable      connection refused, server down, circuit breaker open
    │   └── BackendTimeout          the call did not finish within its timeout
    ├── NotSupportedError           an operation a component cannot do (a purge on a tier
    │                               that cannot list its chunks); NotImplementedError too
    ├── CapacityError               an item larger than a pool or tier could ever hold
    ├── HandleError                 misuse of a pooled buffer (double release, use after release)
    ├── AuthenticationError         a sidecar call without a valid bearer token
    └── PermissionDeniedError       a namespace (model, cache salt) the caller's token
                                    does not cover, asked of a sidecar

``CorruptChunk`` is not a ``BackendError``: decoding validates bytes from anywhere
(a file, a socket, a test), and a corrupt chunk says nothing about the tier's health.
The request and config errors also derive from ``ValueError`` (and request errors
from ``TypeError``, since a wrong type is one of them) so that generic callers that
validate input with ``except ValueError`` keep working.

Messages quote what the user passed with :func:`brief`: a bounded repr, so that a
10 MB string or a YAML alias bomb never becomes a 10 MB error message.
"""

from __future__ import annotations

import reprlib

__all__ = [
    "AuthenticationError",
    "BackendError",
    "BackendTimeout",
    "BackendUnavailable",
    "BadMagic",
    "CacheClosedError",
    "CapacityError",
    "ChecksumMismatch",
    "ConfigError",
    "CorruptChunk",
    "HandleError",
    "HeaderTooLarge",
    "InconsistentChunk",
    "InvalidKVError",
    "InvalidRequestError",
    "InvalidTokensError",
    "LMTierError",
    "NotSupportedError",
    "PermissionDeniedError",
    "TruncatedChunk",
    "UnauthenticChunk",
    "UnsupportedVersion",
    "brief",
]

_BRIEF = reprlib.Repr()
_BRIEF.maxstring = 60
_BRIEF.maxother = 60
_BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxdict = _BRIEF.maxset = 6
_BRIEF.maxlevel = 3


def brief(value: object) -> str:
    """A repr of ``value`` of bounded length (about 100 characters at most), for error
    messages that quote user input: nested and shared structures are cut, never expanded."""
    try:
        return _BRIEF.repr(value)
    except Exception:  # a hostile __repr__: say what it is, not what it claims
        return f"<{type(value).__name__}>"


class LMTierError(Exception):
    """Base of every exception lmtier raises on purpose."""


class ConfigError(LMTierError, ValueError):
    """Configuration that cannot be used: an unknown key, a bad value, a bad file.

    ``key``: the dotted key at fault, when there is one (``"cpu.capacity_bytes"``).
    """

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class InvalidRequestError(LMTierError, ValueError, TypeError):
    """Arguments of a call that cannot be used: the message names the argument and what
    to pass instead. Nothing was stored, loaded or changed."""


class InvalidTokensError(InvalidRequestError):
    """Token ids that cannot be hashed: negative, non-integer, or out of range."""


class InvalidKVError(InvalidRequestError):
    """KV tensors that do not match the cache's KVSpec (dtype, shape, layers, device)."""


class CacheClosedError(LMTierError, RuntimeError):
    """A cache (or one of its parts) used after ``close()`` or before ``start()``."""


class CorruptChunk(LMTierError):
    """Bytes that do not decode to a valid chunk. Tiers delete the chunk and report a miss."""


class BadMagic(CorruptChunk):
    """The bytes do not start with the chunk magic."""


class UnsupportedVersion(CorruptChunk):
    """The chunk was written by a format version this build does not read."""


class HeaderTooLarge(CorruptChunk):
    """The header length field exceeds the format's limit."""


class TruncatedChunk(CorruptChunk):
    """The buffer ends before the header or payload it announces."""


class ChecksumMismatch(CorruptChunk):
    """The payload checksum does not match the one recorded in the header."""


class InconsistentChunk(CorruptChunk):
    """Header fields contradict each other (shape, dtype and payload size disagree)."""


class UnauthenticChunk(CorruptChunk):
    """The chunk's MAC does not match: written without the integrity key, or forged."""


class BackendError(LMTierError):
    """A storage tier failed to serve a call."""


class BackendUnavailable(BackendError):
    """The tier cannot be reached (refused, closed, or its circuit breaker is open)."""


class BackendTimeout(BackendError):
    """The tier did not answer within its timeout."""


class NotSupportedError(LMTierError, NotImplementedError):
    """An operation this component cannot do at all, as opposed to one that failed: a
    tier that cannot list its chunks asked to purge a namespace. Nothing was changed;
    asking again will not help."""


class CapacityError(LMTierError):
    """An item can never fit: larger than a pool slab or a tier's whole capacity."""


class HandleError(LMTierError):
    """A pooled buffer handle was misused (released twice, or used after release)."""


class AuthenticationError(LMTierError):
    """A sidecar call carried no bearer token, a malformed one, or one that is not
    configured. The message says which, and never quotes a token."""


class PermissionDeniedError(LMTierError):
    """A sidecar refused a call's namespace: the caller's token is scoped (a
    ``tokens_file`` entry's ``models`` and ``salts``) and does not cover that model or
    cache salt. An error for that call only: nothing was stored, loaded or changed,
    and the namespaces the token does cover are served as before. The message names
    the token's entry, never the token."""
