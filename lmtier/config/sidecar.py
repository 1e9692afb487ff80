"""The ``sidecar`` section: how ``lmtier serve`` listens, authenticates and leases
its shared host memory. The tiers it serves are the rest of the same config."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar

from pydantic import Field, model_validator

from lmtier.config.section import Section
from lmtier.config.types import (
    Bool,
    Count,
    PathValue,
    PositiveFloat,
    SecretText,
    Share,
    Size,
    Text,
    Timeout,
)

__all__ = ["DEFAULT_SLAB_BYTES", "SidecarConfig"]

Interval = Annotated[Timeout, Field(ge=0.05)]
"""Seconds of a connection timer (keepalive, handshake): 0.05 (grpc's timers run in
milliseconds; tests shorten them) to ``MAX_TIMEOUT_S``."""

DEFAULT_SLAB_BYTES = 2 * 1024**2 + 4096
"""A 2 MiB payload (256 tokens of a 8 KiB/token model) and its header."""


class SidecarConfig(Section):
    """``lmtier serve``: the listener, its security, and the shared host pool.

    Host memory is the ``cpu`` section's (``capacity_bytes + staging_bytes``), cut
    into slabs of ``slab_bytes`` that every namespace shares.
    """

    SECTION: ClassVar[str] = "sidecar"
    listen: Text = ""
    """``unix:///path/to.sock`` or ``host:port``. Empty: ``unix://`` a socket named
    ``sidecar.sock`` in ``$XDG_RUNTIME_DIR/lmtier`` (else ``$XDG_CACHE_HOME/lmtier/run``,
    ``~/.cache/lmtier/run``). A
    unix socket is made owner-only (0600, in a 0700 directory)."""
    allow_remote: Bool = False
    """Let a TCP listener bind an address other than loopback. A token is then
    required (``auth_token``, ``auth_token_file`` or ``tokens_file``)."""
    allow_tcp_without_token: Bool = False
    """Let a loopback TCP listener take calls without a token (logged as a warning at
    every start). Off, a TCP listener needs a token: every user of the machine can
    dial loopback, and without one reads and writes every tenant's KV."""
    metrics_listen: Text = ""
    """``host:port`` of the Prometheus ``/metrics`` endpoint (empty: none)."""
    auth_token: SecretText | None = None
    """A bearer token every call must carry (``authorization: Bearer <token>``);
    it allows every namespace. Never logged."""
    auth_token_file: PathValue | None = None
    """A file whose first line is that token (owner-only permissions advised)."""
    tokens_file: PathValue | None = None
    """A YAML list of scoped tokens: ``- {token: ..., models: [...], salts: [...]}``;
    a token reaches only the listed model ids and cache salts (omitted: any)."""
    tls_cert_file: PathValue | None = None
    """PEM certificate chain of the server; with ``tls_key_file`` turns on TLS."""
    tls_key_file: PathValue | None = None
    """PEM private key of the server."""
    tls_client_ca_file: PathValue | None = None
    """PEM CA bundle: when set, clients must present a certificate it signed."""
    shared_memory: Bool = True
    """Offer the shared-memory data path to clients on the unix socket."""
    shm_dir: PathValue = Path("/dev/shm")  # noqa: S108 (files are 0600, named per pid)
    """Where the shared host pool's file lives (a tmpfs)."""
    slab_bytes: Size = DEFAULT_SLAB_BYTES
    """Bytes of one slab: the largest encoded chunk of any namespace served."""
    lease_ttl_s: PositiveFloat = 60.0
    """Seconds a client may hold a leased slab; then the slab is reclaimed."""
    drain_timeout_s: PositiveFloat = 30.0
    """On SIGTERM: seconds to finish in-flight calls and flush write queues."""
    max_sessions: Count = 4096
    """Open sessions at once (one per client process and namespace)."""
    token_share: Share | None = None
    """The part of ``max_sessions``, and of the pool's slabs, that one token may hold
    at once (leases, and the slabs its streaming calls hold). Empty: an equal share,
    1 / the number of configured tokens, so that every token always gets its share
    whatever the others hold (no token, or one: all of it)."""
    stream_stall_s: PositiveFloat = 10.0
    """Seconds a streaming call may stop moving chunk bytes (a ``StoreStream`` between
    two pieces of a chunk, a ``LoadStream`` whose reader stops reading) before the
    slabs it holds are reclaimed: the chunk is dropped, the load ends there."""
    keepalive_s: Interval = 10.0
    """Seconds between HTTP/2 keepalive pings on an idle connection, and how long a
    ping may go unanswered: a client or peer gone without a FIN (a machine lost, a
    process frozen) is noticed within about two, and its sessions and leases end.
    The sidecar, its clients and the peer tier's channels all read it."""
    handshake_timeout_s: Interval = 10.0
    """Seconds a new connection to a gRPC listener (the sidecar's, the peer's) has to
    finish its TLS and HTTP/2 handshakes before it is closed: grpc's default, 120 s,
    let idle connections that need no token hold the sidecar's descriptors."""
    max_message_bytes: Size = 8 * 1024**2
    """The largest gRPC message accepted (bigger ones: RESOURCE_EXHAUSTED)."""
    stream_piece_bytes: Size = 4 * 1024**2
    """Most bytes of chunk data per message on the streaming calls (a chunk is cut
    into equal pieces: a 2 MiB chunk travels whole)."""

    @model_validator(mode="after")
    def _pairs(self) -> SidecarConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file")
        if self.stream_piece_bytes + 4096 > self.max_message_bytes:
            raise ValueError("stream_piece_bytes must leave 4 KiB under max_message_bytes")
        return self
