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
    ├── InvalidTokensError          token ids that are negative, non-integer or too large
    ├── CorruptChunk                bytes that are not a valid chunk; a tier treats it as a miss
    │   ├── BadMagic                not a chunk at all (foreign or zeroed file)
    │   ├── UnsupportedVersion      a chunk from a newer or older format
    │   ├── HeaderTooLarge          a header length beyond the format's limit
    │   ├── TruncatedChunk          fewer bytes than the header promises
    │   ├── ChecksumMismatch        payload bytes changed after encoding
    │   └── InconsistentChunk       header fields that contradict each other or the size
    ├── BackendError                a storage tier failed; the StorageManager turns it into a miss
    │   ├── BackendUnavailable      connection refused, server down, circuit breaker open
    │   └── BackendTimeout          the call did not finish within its timeout
    ├── CapacityError               an item larger than a pool or tier could ever hold
    └── HandleError                 misuse of a pooled buffer (double release, use after release)

``CorruptChunk`` is not a ``BackendError``: decoding validates bytes from anywhere
(a file, a socket, a test), and a corrupt chunk says nothing about the tier's health.
The token and config errors also derive from ``ValueError`` so that generic callers
that validate input with ``except ValueError`` keep working.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BackendTimeout",
    "BackendUnavailable",
    "BadMagic",
    "CapacityError",
    "ChecksumMismatch",
    "ConfigError",
    "CorruptChunk",
    "HandleError",
    "HeaderTooLarge",
    "InconsistentChunk",
    "InvalidTokensError",
    "LMTierError",
    "TruncatedChunk",
    "UnsupportedVersion",
]


class LMTierError(Exception):
    """Base of every exception lmtier raises on purpose."""


class ConfigError(LMTierError, ValueError):
    """Configuration that cannot be used: an unknown key, a bad value, a bad file."""


class InvalidTokensError(LMTierError, ValueError):
    """Token ids that cannot be hashed: negative, non-integer, or out of range."""


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


class BackendError(LMTierError):
    """A storage tier failed to serve a call."""


class BackendUnavailable(BackendError):
    """The tier cannot be reached (refused, closed, or its circuit breaker is open)."""


class BackendTimeout(BackendError):
    """The tier did not answer within its timeout."""


class CapacityError(LMTierError):
    """An item can never fit: larger than a pool slab or a tier's whole capacity."""


class HandleError(LMTierError):
    """A pooled buffer handle was misused (released twice, or used after release)."""
