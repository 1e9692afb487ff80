"""A credential that never reaches a repr or a log line: :class:`Secret`.

It sits on lmtier's lowest floor, beside :mod:`lmtier.errors`, because both the chunk
code (the integrity key, :mod:`lmtier.chunks.integrity`) and the configuration
(:mod:`lmtier.config.secrets`, which re-exports it with the other redactions) hold
one, and the chunk code sits below the configuration.
"""

from __future__ import annotations

import hmac

__all__ = ["MASK", "Secret"]

MASK = "**********"
"""What a :class:`Secret` shows instead of its value (same length whatever the value)."""


class Secret:
    """A credential string that prints as ``Secret('**********')``.

    Equality compares the values in constant time. The hash is the same for every
    Secret: consistent with equality, and it tells nothing about the value (a
    value-derived hash would let anyone holding it test guesses).
    """

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        if not isinstance(value, str):
            raise TypeError(f"Secret wraps a str, got {type(value).__name__}")
        self._value = value

    def reveal(self) -> str:
        """Return the secret value. Call it only where the value is handed to a client."""
        return self._value

    def __repr__(self) -> str:
        return f"Secret({MASK!r})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Secret):
            return NotImplemented
        return hmac.compare_digest(self._value.encode(), other._value.encode())

    def __hash__(self) -> int:
        return hash(Secret)
