"""Values that must never reach a repr, a log line or ``lmtier config show``.

:class:`Secret` wraps a credential (an AWS key, a token); :class:`SecretURL` wraps a
URL that may carry one (``redis://:password@host``). Both print redacted; the only
way to the value is an explicit ``reveal()``, so a grep for ``reveal(`` finds every
place a secret leaves its wrapper. :func:`redact_url` is the same redaction as a
plain function, for logging code that holds a URL string.

Why wrappers and not a redacting ``__repr__`` on the config classes: a secret also
travels outside the config (into a backend's constructor, an exception message, a
debug log of its kwargs), and the wrapper stays redacted on every one of those paths.
"""

from __future__ import annotations

import hmac
from urllib.parse import unquote_plus

__all__ = ["MASK", "REDACTED", "Secret", "SecretURL", "redact_url"]

REDACTED = "***"
"""What replaces a password or a secret query value in a redacted URL."""
MASK = "**********"
"""What a :class:`Secret` shows instead of its value (same length whatever the value)."""

# Query parameters whose values are credentials (compared lowercased, after
# percent-decoding the name). ``password``/``token`` are what Redis URLs use; the
# rest are common enough in endpoint URLs that leaking them would be a bug report.
_SECRET_QUERY_KEYS = frozenset(
    {
        "password",
        "passwd",
        "pwd",
        "token",
        "access_token",
        "auth_token",
        "secret",
        "api_key",
        "apikey",
        "x-amz-signature",
        "x-amz-security-token",
    }
)


def redact_url(url: str) -> str:
    """Return ``url`` with its password and secret query values replaced by ``***``.

    ``redis://user:pw@host:6379/0?token=t`` becomes ``redis://user:***@host:6379/0?token=***``.
    The user name, host, port, path and other query values are kept: they are what
    one needs to debug a connection. Never raises, so logging code can call it on
    anything. The password is everything between the first ``:`` of the user info
    and the last ``@`` before the query, so an unencoded ``/`` or ``@`` inside a
    password is still hidden (over-redacting a path with an ``@`` is the cheaper error).
    """
    head, sep, rest = url.partition("://")
    if not sep:
        head, rest = "", url
    query_start = _first_index(rest, "?#")
    at = rest.rfind("@", 0, query_start)
    if at >= 0 and ":" in rest[:at]:
        user = rest[:at].partition(":")[0]
        rest = f"{user}:{REDACTED}{rest[at:]}"
    before_query, qmark, after = rest.partition("?")
    if qmark:
        query, hash_mark, fragment = after.partition("#")
        pairs = [_redact_pair(pair) for pair in query.split("&")]
        rest = f"{before_query}?{'&'.join(pairs)}{hash_mark}{fragment}"
    return f"{head}{sep}{rest}"


def _first_index(text: str, chars: str) -> int:
    """Index of the first of ``chars`` in ``text``, or ``len(text)`` if none occurs."""
    found = [i for i in (text.find(c) for c in chars) if i >= 0]
    return min(found, default=len(text))


def _redact_pair(pair: str) -> str:
    name, eq, _value = pair.partition("=")
    if eq and unquote_plus(name).strip().lower() in _SECRET_QUERY_KEYS:
        return f"{name}={REDACTED}"
    return pair


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


class SecretURL:
    """A URL that may embed a password; prints as :func:`redact_url` shows it."""

    __slots__ = ("_url",)

    def __init__(self, url: str) -> None:
        if not isinstance(url, str):
            raise TypeError(f"SecretURL wraps a str, got {type(url).__name__}")
        self._url = url

    def reveal(self) -> str:
        """Return the full URL, password included, for the client that connects with it."""
        return self._url

    @property
    def scheme(self) -> str:
        """The URL's scheme, lowercased (``'redis'``); ``''`` if it has none."""
        head, sep, _rest = self._url.partition(":")
        return head.lower() if sep else ""

    def __repr__(self) -> str:
        return f"SecretURL({redact_url(self._url)!r})"

    def __str__(self) -> str:
        return redact_url(self._url)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SecretURL):
            return NotImplemented
        return hmac.compare_digest(self._url.encode(), other._url.encode())

    def __hash__(self) -> int:
        # The redacted form carries no secret and equal URLs redact equally.
        return hash(redact_url(self._url))
