"""The checks the facade applies to its callers' arguments, before a store sees them.

A bad argument is a typed one-line :class:`~lmtier.errors.InvalidRequestError` that
says what to pass, raised before anything changes (a store trusts what the facade
hands it: :mod:`lmtier.store`).
"""

from __future__ import annotations

from collections.abc import Sequence

from lmtier.chunks.keys import KEY_BYTES, ChunkKey
from lmtier.errors import InvalidRequestError, brief

__all__ = ["checked_keys", "require_int"]


def require_int(name: str, value: object, *, lowest: int = 0) -> int:
    """``value`` if it is an int (not a bool) >= ``lowest``; InvalidRequestError if not."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise InvalidRequestError(f"{name} must be an int >= {lowest}, got {brief(value)}")
    return value


def checked_keys(keys: object) -> Sequence[ChunkKey]:
    """``keys`` if it is a sequence of 32-byte chunk keys; InvalidRequestError if not."""
    if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
        raise InvalidRequestError(f"keys must be a sequence of chunk keys, got {brief(keys)}")
    for key in keys:
        if type(key) is not bytes or len(key) != KEY_BYTES:
            raise InvalidRequestError(f"a chunk key is {KEY_BYTES} bytes, got {brief(key)}")
    return keys
