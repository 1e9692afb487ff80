"""Who may call the sidecar: bearer tokens, their scopes, and the listeners' TLS
credentials (a client's are :mod:`lmtier.wire.credentials`).

Tokens come from the ``sidecar`` config section (``auth_token``, ``auth_token_file``,
``tokens_file``) and live only inside :class:`~lmtier.config.secrets.Secret` wrappers
and as SHA-256 digests: no repr, log line or error message here ever holds one.

A call presents ``authorization: Bearer <token>``. :meth:`Authenticator.authenticate`
hashes it and compares the digest with *every* configured digest, with
``hmac.compare_digest`` and no early exit: comparing digests (all 32 bytes long)
rather than the tokens themselves means the time taken reveals neither which token
matched nor how long any of them is. The rejected alternative, a dict keyed by token,
answers in time that depends on the token's hash and bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from lmtier.config.secrets import Secret, read_secret_file, read_secret_text, warn_if_shared
from lmtier.config.sidecar import SidecarConfig
from lmtier.errors import AuthenticationError, ConfigError, brief
from lmtier.wire.credentials import read_pem

__all__ = [
    "ANONYMOUS",
    "Authenticator",
    "Principal",
    "server_credentials",
    "tls_server_credentials",
]

logger = logging.getLogger(__name__)

_ENTRY_KEYS = frozenset({"token", "token_file", "models", "salts", "name"})


@dataclass(frozen=True, slots=True)
class Principal:
    """Who made a call, and which namespaces that caller may reach.

    ``name`` identifies the caller in logs and metrics (``"anonymous"``, ``"token 2"``
    or the name a ``tokens_file`` entry gives): it is never the token. ``models`` and
    ``salts`` list the model ids and cache salts the caller may use; ``None`` means any.
    """

    name: str
    models: frozenset[str] | None = None
    salts: frozenset[str] | None = None

    @property
    def reaches_all(self) -> bool:
        """Whether this caller may reach every namespace (no scope): only such a caller
        is handed the shared pool, which holds every namespace's chunks."""
        return self.models is None and self.salts is None

    def allows(self, model_id: str, cache_salt: str) -> bool:
        """Whether this caller may open a namespace of ``model_id`` under ``cache_salt``."""
        if self.models is not None and model_id not in self.models:
            return False
        return self.salts is None or cache_salt in self.salts


ANONYMOUS = Principal("anonymous")
"""The caller when no token is configured: it may reach every namespace."""


@dataclass(frozen=True, slots=True)
class _Token:
    """One configured token, kept only as its digest (what calls are compared with)."""

    digest: bytes = field(repr=False)
    principal: Principal


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class Authenticator:
    """Checks each call's bearer token and says which :class:`Principal` made it.

    With no token configured every call is :data:`ANONYMOUS` (fit for a unix socket
    that only its owner can open; :func:`lmtier.sidecar.listen.check_policy` refuses
    a remote listener without tokens). Thread-safe: it never changes after building.
    """

    __slots__ = ("_tokens",)

    def __init__(self, tokens: Iterable[tuple[Secret, Principal]] = ()) -> None:
        built: list[_Token] = []
        for secret, principal in tokens:
            _check_token(secret.reveal(), principal.name)
            digest = _digest(secret.reveal())
            for other in built:
                if hmac.compare_digest(other.digest, digest):
                    raise ConfigError(
                        f"sidecar: {principal.name} and {other.principal.name} carry the "
                        "same token; give each caller its own"
                    )
            built.append(_Token(digest, principal))
        self._tokens: tuple[_Token, ...] = tuple(built)

    @classmethod
    def from_config(cls, sidecar: SidecarConfig) -> Authenticator:
        """The tokens of ``sidecar``: ``auth_token``, ``auth_token_file`` (both allow
        every namespace) and each entry of ``tokens_file``.

        Raises ConfigError for a file that cannot be read, an empty token or a malformed
        ``tokens_file``; warns (without the token) about a token file that others can
        read.
        """
        tokens: list[tuple[Secret, Principal]] = []
        if sidecar.auth_token is not None:
            tokens.append((sidecar.auth_token, Principal("auth_token")))
        if sidecar.auth_token_file is not None:
            token = read_secret_file(sidecar.auth_token_file, "sidecar.auth_token_file")
            tokens.append((token, Principal("auth_token_file")))
        if sidecar.tokens_file is not None:
            tokens.extend(_read_tokens_file(sidecar.tokens_file))
        return cls(tokens)

    @property
    def required(self) -> bool:
        """Whether calls must carry a token (at least one is configured)."""
        return bool(self._tokens)

    @property
    def num_principals(self) -> int:
        """How many callers can be told apart: one per token, or one (:data:`ANONYMOUS`)
        without tokens. The default share of each (:mod:`.shares`) is 1 / this."""
        return max(1, len(self._tokens))

    def authenticate(self, metadata: Sequence[tuple[str, Any]] | None) -> Principal:
        """The principal whose token ``metadata`` carries.

        ``metadata`` is what grpc.aio's ``context.invocation_metadata()`` returns.
        Raises AuthenticationError when a token is required and the call has none, a
        malformed one, or one that is not configured (the message says which, never
        the token).
        """
        if not self._tokens:
            return ANONYMOUS
        presented = _bearer(metadata)
        digest = _digest(presented)
        found: _Token | None = None
        for token in self._tokens:  # every token, always: no early exit
            equal = hmac.compare_digest(token.digest, digest)
            found = token if equal and found is None else found
        if found is None:
            raise AuthenticationError("the bearer token is not one this sidecar accepts")
        return found.principal

    def accepts(self, secret: Secret) -> bool:
        """Whether ``secret`` is one of this sidecar's tokens (the node secret must not
        be: every node of a cluster holds it)."""
        digest = _digest(secret.reveal())
        return any([hmac.compare_digest(token.digest, digest) for token in self._tokens])

    def __repr__(self) -> str:
        names = ", ".join(token.principal.name for token in self._tokens)
        return f"Authenticator(tokens=[{names}])"


def _bearer(metadata: Sequence[tuple[str, Any]] | None) -> str:
    """The token of the call's one ``authorization: Bearer <token>`` entry."""
    values = [value for key, value in metadata or () if key.lower() == "authorization"]
    if not values:
        raise AuthenticationError(
            "this sidecar requires a token: send 'authorization: Bearer <token>' metadata"
        )
    if len(values) > 1:
        raise AuthenticationError("the call carries more than one 'authorization' entry")
    value = values[0]
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    parts = str(value).split(None, 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        raise AuthenticationError("the 'authorization' metadata is not 'Bearer <token>'")
    return parts[1].strip()


def _check_token(token: str, where: str) -> None:
    """Refuse tokens a call could never present (gRPC metadata is printable ASCII)."""
    if not token:
        raise ConfigError(f"sidecar: the token of {where} is empty")
    if not all("!" <= char <= "~" for char in token):
        raise ConfigError(f"sidecar: the token of {where} must be printable ASCII without spaces")


def _read_tokens_file(path: Path) -> list[tuple[Secret, Principal]]:
    """The entries of a ``tokens_file`` (YAML list of mappings)."""
    what = "sidecar.tokens_file"
    warn_if_shared(path, what)
    try:
        entries = yaml.safe_load(read_secret_text(path, what))
    except yaml.YAMLError as exc:
        # The problem and its position only: yaml's full message quotes the line, which
        # may hold a token (its problems quote at most one character).
        mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        why = f": {problem}" if problem else ""
        raise ConfigError(f"{what}: {path} is not valid YAML{where}{why}", key=what) from None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(
            f"{what}: {path} must be a non-empty YAML list of "
            "{token: ..., models: [...], salts: [...]} entries",
            key=what,
        )
    return [_entry(item, index, path) for index, item in enumerate(entries, start=1)]


def _entry(item: object, index: int, path: Path) -> tuple[Secret, Principal]:
    where = f"sidecar.tokens_file: {path} entry {index}"
    if not isinstance(item, dict):  # never quoted: a bare string here is a token
        raise ConfigError(f"{where} must be a mapping with a 'token' or 'token_file' key")
    unknown = sorted(str(key) for key in item if key not in _ENTRY_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {brief(unknown)}; known: {sorted(_ENTRY_KEYS)}")
    name = item.get("name", f"token {index}")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{where}: 'name' must be a non-empty string")
    if ("token" in item) == ("token_file" in item):
        raise ConfigError(f"{where} needs exactly one of 'token' and 'token_file'")
    if "token" in item:
        if not isinstance(item["token"], str):
            raise ConfigError(f"{where}: 'token' must be a string (quote it in YAML)")
        secret = Secret(item["token"].strip())
    else:
        if not isinstance(item["token_file"], str) or not item["token_file"].strip():
            raise ConfigError(f"{where}: 'token_file' must be a path")
        token_path = path.parent / Path(item["token_file"]).expanduser()
        secret = read_secret_file(token_path, f"{where}: token_file")
    principal = Principal(name, _scope(item, "models", where), _scope(item, "salts", where))
    _check_token(secret.reveal(), f"{path} entry {index}")
    return secret, principal


def _scope(item: dict[Any, Any], key: str, where: str) -> frozenset[str] | None:
    values = item.get(key)
    if values is None:
        return None
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ConfigError(f"{where}: '{key}' must be a list of strings")
    if not values:
        raise ConfigError(f"{where}: '{key}' is empty, which allows nothing; omit it to allow any")
    return frozenset(values)


def server_credentials(sidecar: SidecarConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for the sidecar's port, or None when TLS is off.

    ``tls_cert_file`` + ``tls_key_file`` turn TLS on; ``tls_client_ca_file`` also
    requires every client to present a certificate that CA signed (mutual TLS).
    """
    if sidecar.tls_cert_file is None or sidecar.tls_key_file is None:
        return None
    return tls_server_credentials(
        sidecar.tls_cert_file, sidecar.tls_key_file, sidecar.tls_client_ca_file, "sidecar"
    )


def tls_server_credentials(
    cert_file: Path, key_file: Path, client_ca_file: Path | None, section: str
) -> grpc.ServerCredentials:
    """A listener's TLS credentials: its certificate and key, and with
    ``client_ca_file`` a certificate that CA signed required of every caller. Errors
    name ``<section>.tls_*``."""
    cert = read_pem(cert_file, f"{section}.tls_cert_file")
    warn_if_shared(key_file, f"{section}.tls_key_file")
    key = read_pem(key_file, f"{section}.tls_key_file")
    client_ca = None
    if client_ca_file is not None:
        what = "tls_client_ca_file" if section == "sidecar" else "tls_ca_file"
        client_ca = read_pem(client_ca_file, f"{section}.{what}")
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )
