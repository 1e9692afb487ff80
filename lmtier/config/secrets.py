"""Values that must never reach a repr, a log line or ``lmtier config show``.

:class:`Secret` (defined in :mod:`lmtier.secret`, below the chunk code that also
holds one) wraps a credential (an AWS key, a token); :class:`SecretURL` wraps a
URL that may carry one (``redis://:password@host``). Both print redacted; the only
way to the value is an explicit ``reveal()``, so a grep for ``reveal(`` finds every
place a secret leaves its wrapper. :func:`redact_url` is the same redaction as a
plain function, for logging code that holds a URL string. :func:`read_secret_file`
reads a token kept in a file (the sidecar's, an engine's, an API key), the one way
every command and integration does it.

Why wrappers and not a redacting ``__repr__`` on the config classes: a secret also
travels outside the config (into a backend's constructor, an exception message, a
debug log of its kwargs), and the wrapper stays redacted on every one of those paths.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import stat
from pathlib import Path
from urllib.parse import unquote_plus

from lmtier.errors import ConfigError
from lmtier.secret import MASK, Secret

__all__ = [
    "MASK",
    "REDACTED",
    "Secret",
    "SecretURL",
    "read_secret_file",
    "read_secret_text",
    "redact_url",
    "warn_if_shared",
]

logger = logging.getLogger(__name__)

REDACTED = "***"
"""What replaces a password or a secret query value in a redacted URL."""

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


_PARAM = re.compile(r"[?&]([^=&?#]*)=")


def redact_url(url: str) -> str:
    """Return ``url`` with its password and secret query values replaced by ``***``.

    ``redis://user:pw@host:6379/0?db=1&token=t`` becomes
    ``redis://user:***@host:6379/0?db=1&token=***``. The user name, host, port, path
    and the query before a secret are kept: they are what one needs to debug a
    connection. Never raises, so logging code can call it on anything.

    It holds for any password, however badly encoded. Two readings of the URL are
    redacted together: the password is everything from the first ``:`` after the
    scheme to the *last* ``@`` (so ``/``, ``?``, ``#`` or ``@`` inside it cannot end
    it early), and a secret query value runs from its ``=`` to the end (an unencoded
    ``&``, ``#`` or ``@`` in it could not be told from what follows). Where the two
    overlap, both go: over-redacting is the cheaper error.
    """
    head, sep, rest = url.partition("://")
    if not sep:
        head, rest = "", url
    hidden = [False] * len(rest)
    at = rest.rfind("@")
    colon = rest.find(":")
    if 0 <= colon < at:
        hidden[colon + 1 : at] = [True] * (at - colon - 1)
    for match in _PARAM.finditer(rest):
        if unquote_plus(match[1]).strip().lower() in _SECRET_QUERY_KEYS:
            hidden[match.end() :] = [True] * (len(rest) - match.end())
            break
    out: list[str] = []
    for index, char in enumerate(rest):
        if not hidden[index]:
            out.append(char)
        elif index == 0 or not hidden[index - 1]:
            out.append(REDACTED)
    return f"{head}{sep}{''.join(out)}"


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


def warn_if_shared(path: Path, what: str) -> None:
    """Log a warning (naming the file, never its content) if others may read it."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return  # the read that follows reports it
    if mode & 0o077:
        logger.warning(
            "%s %s is accessible to group or others (mode %03o); chmod 600 it",
            what,
            path,
            stat.S_IMODE(mode),
        )


def read_secret_text(path: Path, what: str) -> str:
    """The text of a file holding secrets; ConfigError naming ``what`` (the setting or
    flag) and the reason when it cannot be read, never the content."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ConfigError(f"{what}: cannot read {path}: {reason}", key=what) from None


def read_secret_file(path: str | os.PathLike[str], what: str) -> Secret:
    """The first line of the file at ``path`` (``~`` expanded), stripped, as a Secret:
    how a token is kept in a file. Warns if group or others may read the file;
    ConfigError naming ``what`` when it cannot be read or that line is empty."""
    file = Path(path).expanduser()
    warn_if_shared(file, what)
    lines = read_secret_text(file, what).splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise ConfigError(f"{what}: the first line of {file} is empty; put the token there")
    return Secret(token)
