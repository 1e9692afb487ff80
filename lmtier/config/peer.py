"""The ``peer`` section: chunks served from another node's CPU tier (``lmtier serve``
nodes of one cluster), found through a directory kept in the shared Redis.

A node with ``enabled`` does two things. Its waterfall gains a ``peer`` tier (after
disk, before Redis) that asks the directory who holds a chunk and fetches it from
that node's sidecar. And, when it runs as a sidecar, it serves its own CPU tier to
the other nodes on ``listen`` and publishes what that tier holds in the directory.
See :mod:`lmtier_backends.peer` and docs/cluster.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import model_validator

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
)

__all__ = ["PeerConfig"]

_SCHEMES = ("redis", "rediss", "unix")


class PeerConfig(Section):
    """Peer-to-peer sharing of CPU tiers between the nodes of a cluster (module docstring).

    Empty ``directory_url``, ``key_prefix`` and token fall back on the ``redis``
    section's URL and prefix and the ``sidecar`` section's token, which is what a
    cluster whose nodes share one Redis and one node token wants
    (:func:`lmtier.storage.plugins.enabled_sections` fills them in).
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
    """The bearer token presented to other nodes' peer listeners, which must accept it
    as a node token (one covering every namespace). None: the sidecar's ``auth_token``
    or ``auth_token_file``."""
    token_file: PathValue | None = None
    """A file whose first line is that token."""
    tls_ca_file: PathValue | None = None
    """PEM CA bundle that signed the other nodes' certificates: peers are dialled with
    TLS (their sidecars set ``tls_cert_file``). None: plaintext."""
    ttl_s: PositiveFloat = 15.0
    """Seconds a node stays in the directory without a heartbeat (sent every third of
    it): a node that died is forgotten within this."""
    publish_interval_s: PositiveFloat = 0.5
    """How often the CPU tier's contents are compared with what was published (new
    chunks published, evicted ones withdrawn)."""
    timeout_s: PositiveFloat = 1.0
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
        return self

    def resolved(
        self, redis_url: Any, redis_prefix: str, token: Any, token_file: Any
    ) -> PeerConfig:
        """This section with its empty directory and token filled from the ``redis``
        and ``sidecar`` sections' values (class docstring)."""
        changes: dict[str, Any] = {}
        if self.directory_url is None:
            changes["directory_url"] = redis_url
        if self.key_prefix is None:
            changes["key_prefix"] = redis_prefix
        if self.token is None and self.token_file is None:
            changes["token"], changes["token_file"] = token, token_file
        return self.replace(**changes) if changes else self
