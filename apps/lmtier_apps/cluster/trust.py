"""What the nodes of a shipped cluster need to trust each other and nothing else:
generated once, at the first start, and kept.

A shared Redis must not be a way in: whoever can write it can name any peer and
plant any chunk. So ``lmtier cluster up`` (local processes) and docker-compose's
``cluster-secrets`` job (``lmtier cluster secrets --dir``) write, where a file is
missing, into the cluster's secrets directory:

=================  ==========================================================
``peer.secret``    the node secret (``peer.token_file``): each peer call proves it,
                   never sends it (:mod:`lmtier.wire.peer_auth`); no sidecar
                   token equals it
``integrity.key``  the chunk MAC key (``integrity.key_file``): a chunk from Redis,
                   S3 or a peer that was not written by a node is a miss
``peer-ca.pem``    the cluster's own CA (``peer.tls_ca_file``): peers talk mutual TLS
``peer.pem``,      the nodes' certificate and key (``peer.tls_cert_file``,
``peer-key.pem``   ``peer.tls_key_file``), for the name :data:`SERVER_NAME`
=================  ==========================================================

Every file is 0600 and written atomically; existing ones are kept, so a restarted
cluster keeps its keys (the three TLS files are made together: one missing remakes
all three). The CA's private key is never written: once the nodes' certificate is
signed no further certificate can be made for the cluster, so a stolen secrets
directory is the only way to pose as a node. Every node holds the same certificate,
so mutual TLS proves membership of the cluster, not which node called.

It needs ``cryptography`` (the ``cluster`` extra).
"""

from __future__ import annotations

import datetime
import secrets
from dataclasses import dataclass
from pathlib import Path

from lmtier.extras import install_command
from lmtier_apps.cluster.state import ClusterError, write_private

__all__ = ["SERVER_NAME", "TrustFiles", "ensure_trust"]

SERVER_NAME = "lmtier-peer"
"""The name in the nodes' certificate, which peers check (``peer.tls_server_name``)."""
VALID_DAYS = 3650


@dataclass(frozen=True, slots=True)
class TrustFiles:
    """The paths of a cluster's trust files (module docstring)."""

    node_secret: Path
    integrity_key: Path
    ca: Path
    cert: Path
    key: Path

    @classmethod
    def in_directory(cls, directory: Path) -> TrustFiles:
        return cls(
            directory / "peer.secret",
            directory / "integrity.key",
            directory / "peer-ca.pem",
            directory / "peer.pem",
            directory / "peer-key.pem",
        )

    def sidecar_env(self) -> dict[str, str]:
        """The ``LMTIER_*`` variables that point a sidecar at these files."""
        return {
            "LMTIER_PEER__TOKEN_FILE": str(self.node_secret),
            "LMTIER_PEER__TLS_CA_FILE": str(self.ca),
            "LMTIER_PEER__TLS_CERT_FILE": str(self.cert),
            "LMTIER_PEER__TLS_KEY_FILE": str(self.key),
            "LMTIER_PEER__TLS_SERVER_NAME": SERVER_NAME,
            "LMTIER_INTEGRITY__KEY_FILE": str(self.integrity_key),
        }


def ensure_trust(directory: Path) -> tuple[TrustFiles, list[str]]:
    """The trust files in ``directory`` (made 0700 if new), generating the missing
    ones; also the names of the files it wrote. ClusterError when the directory
    cannot be used or ``cryptography`` is missing."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ClusterError(f"cannot use {directory}: {exc.strerror}") from None
    files, made = TrustFiles.in_directory(directory), []
    try:
        for path in (files.node_secret, files.integrity_key):
            if not path.exists():
                write_private(path, secrets.token_urlsafe(32) + "\n")
                made.append(path.name)
        if not (files.ca.exists() and files.cert.exists() and files.key.exists()):
            ca, cert, key = _certificates()
            for path, text in ((files.key, key), (files.cert, cert), (files.ca, ca)):
                write_private(path, text)
                made.append(path.name)
    except OSError as exc:
        raise ClusterError(f"cannot write the cluster's secrets in {directory}: {exc}") from None
    return files, made


def _certificates() -> tuple[str, str, str]:
    """A fresh CA's certificate, and a certificate and key it signed for
    :data:`SERVER_NAME` (client and server use), all PEM."""
    try:
        from cryptography import x509  # noqa: PLC0415 - the cluster extra
        from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415
        from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: PLC0415
    except ImportError:
        raise ClusterError(
            "the cluster's TLS certificates need cryptography (the 'cluster' extra): "
            + install_command("cluster")
        ) from None
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lmtier cluster CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    node_key = ec.generate_private_key(ec.SECP256R1())
    node = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME)]))
        .issuer_name(ca_name)
        .public_key(node_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    key_pem = node_key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return (
        ca.public_bytes(pem).decode(),
        node.public_bytes(pem).decode(),
        key_pem.decode(),
    )
