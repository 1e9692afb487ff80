"""What a client of the sidecar presents: its bearer token and its TLS credentials.

Both ends of the wire agree on these forms: the token travels as one
``authorization: Bearer <token>`` entry (gRPC metadata, and the lane's hello), which
the server's :class:`lmtier.sidecar.auth.Authenticator` checks; TLS material is read
from PEM files. The engine-side client and the peer tier use them, so they live here,
below the server.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from lmtier.config.secrets import Secret
from lmtier.errors import ConfigError

__all__ = ["authorization", "channel_credentials", "read_pem", "token_metadata"]


def authorization(token: Secret | None) -> str:
    """The ``authorization`` value that carries ``token`` (empty without one)."""
    return f"Bearer {token.reveal()}" if token is not None else ""


def token_metadata(token: Secret | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token``: one ``authorization`` entry, or none."""
    return (("authorization", authorization(token)),) if token is not None else ()


def read_pem(path: Path, what: str) -> bytes:
    """The bytes of the PEM file ``path``; ConfigError naming ``what`` (a config key)
    if it cannot be read or holds no PEM block."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {path}: {exc.strerror}", key=what) from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{what}: {path} is not a PEM file", key=what)
    return data


def channel_credentials(
    ca_file: Path | None = None, cert_file: Path | None = None, key_file: Path | None = None
) -> grpc.ChannelCredentials:
    """TLS credentials for a client of the sidecar.

    ``ca_file``: the CA bundle that signed the server's certificate (None: the
    system's roots). ``cert_file`` + ``key_file``: the client's own certificate, for a
    sidecar that requires one (``tls_client_ca_file``).
    """
    if (cert_file is None) != (key_file is None):
        raise ConfigError("a client certificate needs both cert_file and key_file")
    ca = read_pem(ca_file, "ca_file") if ca_file is not None else None
    cert = read_pem(cert_file, "cert_file") if cert_file is not None else None
    key = read_pem(key_file, "key_file") if key_file is not None else None
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )
