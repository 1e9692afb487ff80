"""The ``peer`` section: chunks served from another node's CPU tier (``lmtier serve``
nodes of one cluster), found through a directory kept in the shared Redis.

A node with ``enabled`` does two things. Its waterfall gains a ``peer`` tier (after
disk, before Redis) that asks the directory who holds a chunk and fetches it from
that node's sidecar. And, when it runs as a sidecar, it serves its own CPU tier to
the other nodes on ``listen`` and publishes what that tier holds in the directory.
See :mod:`lmtier_backends.peer` and docs/cluster.md.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BeforeValidator, Strict, model_validator

from lmtier.config.section import Section
from lmtier.config.types import (
    Bool,
    Count,
    PathValue,
    PositiveFloat,
    SecretText,
    SecretUrl,
    Size,
    Text,
    Timeout,
)
from lmtier.errors import ConfigError, brief

__all__ = ["AddressPolicy", "PeerConfig", "split_address"]

_SCHEMES = ("redis", "rediss", "unix")
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_MAX_HOST = 253


def split_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of a peer address ``host:port`` (``[v6]:port`` for IPv6), or
    ValueError: a host name of DNS labels or an IP literal, a port of 1-65535, and
    nothing else (no scheme such as ``unix:`` or ``dns:``, no list, no path)."""
    if not isinstance(address, str) or len(address) > _MAX_HOST + 8:
        raise ValueError("not a host:port address")
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{brief(address)} is not host:port with a port of 1-65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"{brief(address)}: {brief(host)} is no IPv6 address") from None
        return host[1:-1], int(port_text)
    if not _is_host(host):
        raise ValueError(f"{brief(address)}: {brief(host)} is no host name or IPv4 address")
    return host, int(port_text)


def _is_host(host: str) -> bool:
    if not host or len(host) > _MAX_HOST:
        return False
    try:
        ipaddress.IPv4Address(host)
        return True
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    return all(_LABEL.fullmatch(label) for label in labels) and not labels[-1].isdigit()


@dataclass(frozen=True, slots=True)
class AddressPolicy:
    """Which peer addresses may be dialled (``peer.allowed_peers``): IP literals by
    network, host names by name or by domain (``*.example``). A host name never
    matches a network: it is not resolved here, since what it resolves to is the
    resolver's business, and a name the operator listed is trusted by name."""

    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    names: frozenset[str] = frozenset()
    domains: tuple[str, ...] = ()

    @classmethod
    def parse(cls, entries: Sequence[str]) -> AddressPolicy:
        """The policy of ``entries``; ValueError naming a bad one."""
        networks, names, domains = [], set(), []
        for raw in entries:
            entry = raw.strip()
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            if entry.startswith("*.") and _is_host(entry[2:]):
                domains.append("." + entry[2:].lower().removesuffix("."))
            elif _is_host(entry):
                names.add(entry.lower().removesuffix("."))
            else:
                raise ValueError(f"{brief(raw)} is no network (10.0.0.0/8), host name or *.domain")
        return cls(tuple(networks), frozenset(names), tuple(domains))

    def allows(self, address: str) -> bool:
        """Whether ``address`` (``host:port``) is well formed and allowed."""
        try:
            host, _ = split_address(address)
        except ValueError:
            return False
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            name = host.lower().removesuffix(".")
            return name in self.names or any(name.endswith(d) for d in self.domains)
        return any(ip in network for network in self.networks)


def _entries(value: Any) -> Any:
    """A comma-separated string (an environment variable) as a list of entries."""
    if isinstance(value, str):
        return [part for part in (p.strip() for p in value.split(",")) if part]
    return value


def _checked_entries(value: tuple[str, ...]) -> tuple[str, ...]:
    if not value:
        raise ConfigError(
            "peer.allowed_peers: name at least one network or host (a node that should "
            "dial no peer does not enable the peer tier)",
            key="peer.allowed_peers",
        )
    try:
        AddressPolicy.parse(value)
    except ValueError as exc:
        raise ConfigError(f"peer.allowed_peers: {exc}", key="peer.allowed_peers") from None
    return value


PeerAddresses = Annotated[
    tuple[Annotated[str, Strict()], ...],
    BeforeValidator(_entries),
    AfterValidator(_checked_entries),
]


class PeerConfig(Section):
    """Peer-to-peer sharing of CPU tiers between the nodes of a cluster (module docstring).

    Empty ``directory_url`` and ``key_prefix`` fall back on the ``redis`` section's
    URL and prefix, and empty ``tls_cert_file``/``tls_key_file`` on the ``sidecar``
    section's (:func:`lmtier.storage.plugins.peer_section` fills them in). The node
    secret has no fallback: it must not be a token the sidecar accepts, since every
    node of the cluster holds it.
    """

    SECTION: ClassVar[str] = "peer"
    enabled: Bool = False
    """Fetch chunks from other nodes' CPU tiers (and, as a sidecar, serve this one's)."""
    node_id: Text = ""
    """This node's name in the directory, unique in the cluster. Empty: the host name
    and the advertised port."""
    listen: Text = ""
    """``host:port`` of this sidecar's peer listener (TCP; port 0 picks one). Empty: the
    node fetches from peers but serves none."""
    advertise: Text = ""
    """``host:port`` other nodes dial to reach ``listen`` (empty: ``listen`` itself,
    with the port bound). Set it when ``listen`` binds 0.0.0.0 or sits behind NAT."""
    directory_url: SecretUrl | None = None
    """The Redis holding the directory (None: ``redis.url``)."""
    key_prefix: Text | None = None
    """Prefix of the directory's Redis keys (None: ``redis.key_prefix``)."""
    token: SecretText | None = None
    """The cluster's node secret: every node of the cluster has the same one, and no
    sidecar token may equal it. It is never sent: a node proves it holds it with an
    HMAC over a nonce, the address it dials and the request (:mod:`lmtier.wire.peer_auth`),
    and takes nothing from a peer that cannot prove the same."""
    token_file: PathValue | None = None
    """A file whose first line is the node secret."""
    allowed_peers: PeerAddresses = ("127.0.0.0/8", "::1/128", "localhost")
    """The peer addresses this node may dial: networks (``10.0.0.0/8``, ``::1/128``) for
    addresses the directory names by IP, host names (``sidecar-a``, or ``*.lmtier.svc``
    for a domain's names) for the others. An address the directory names outside them
    is never dialled (whoever can write the shared Redis could name any). In YAML a
    list; in ``LMTIER_PEER__ALLOWED_PEERS`` entries separated by commas."""
    proof_window_s: Timeout = 120.0
    """How far a peer call's time stamp may be from this node's clock (its proof is
    refused beyond): the nodes' clocks must agree to within it."""
    tls_cert_file: PathValue | None = None
    """PEM certificate of this node's peer listener, also presented as the client
    certificate when it dials peers (None: ``sidecar.tls_cert_file``)."""
    tls_key_file: PathValue | None = None
    """Its private key (None: ``sidecar.tls_key_file``)."""
    tls_ca_file: PathValue | None = None
    """PEM CA bundle that signed the nodes' certificates: peers are dialled with TLS and
    must present a certificate it signed, and the listener requires one of callers
    (mutual TLS). None: plaintext (the proofs still keep the node secret to itself)."""
    tls_server_name: Text = ""
    """The name checked in a peer's certificate. Empty: the host of the address dialled.
    A cluster whose nodes share one certificate names it here (``lmtier cluster``'s
    is ``lmtier-peer``)."""
    ttl_s: PositiveFloat = 15.0
    """Seconds a node stays in the directory without a heartbeat (sent every third of
    it): a node that died is forgotten within this."""
    publish_interval_s: PositiveFloat = 0.5
    """How often the CPU tier's contents are compared with what was published (new
    chunks published, evicted ones withdrawn)."""
    timeout_s: Timeout = 1.0
    """Seconds a peer call may go without moving a byte before it counts as failed."""
    min_bytes_per_s: Size = 64 * 1024**2
    """Slowest fetch rate still counted as healthy (a call's deadline grows with its bytes)."""
    max_keys_per_fetch: Count = 256
    """Most chunks asked of one peer in one call (a larger read is split, one call
    after another; each call pays HTTP/2's flow-control ramp again: 128 chunks of
    2 MiB in calls of 64 ran at 0.74-0.81x a raw gRPC stream, in one call 0.80x)."""

    @model_validator(mode="after")
    def _checked(self) -> PeerConfig:
        if self.token is not None and self.token_file is not None:
            raise ValueError("set token or token_file, not both")
        url = self.directory_url
        if url is not None and url.scheme not in _SCHEMES:
            raise ValueError(f"directory_url: scheme must be one of {', '.join(_SCHEMES)}")
        if self.publish_interval_s * 2 > self.ttl_s:
            raise ValueError("publish_interval_s must be at most half of ttl_s")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("set both tls_cert_file and tls_key_file, or neither")
        return self

    def resolved(
        self, redis_url: Any, redis_prefix: str, tls_cert_file: Any, tls_key_file: Any
    ) -> PeerConfig:
        """This section with its empty directory, prefix and certificate filled from the
        ``redis`` and ``sidecar`` sections' values (class docstring)."""
        changes: dict[str, Any] = {}
        if self.directory_url is None:
            changes["directory_url"] = redis_url
        if self.key_prefix is None:
            changes["key_prefix"] = redis_prefix
        if self.tls_cert_file is None and self.tls_key_file is None:
            changes["tls_cert_file"], changes["tls_key_file"] = tls_cert_file, tls_key_file
        return self.replace(**changes) if changes else self

    @property
    def policy(self) -> AddressPolicy:
        """``allowed_peers`` as a policy that checks addresses."""
        return AddressPolicy.parse(self.allowed_peers)
