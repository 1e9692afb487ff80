"""The peer tier: chunks fetched from other nodes' CPU tiers, found through a directory
in the shared Redis (:mod:`.tier`). Entry point ``peer``: :func:`open_tier`."""

from __future__ import annotations

from lmtier.config import PeerConfig
from lmtier.errors import ConfigError
from lmtier.wire.peer_auth import node_key
from lmtier_backends.peer.fetch import PeerTLS
from lmtier_backends.peer.tier import PeerTier

__all__ = ["PeerTier", "open_tier"]


async def open_tier(config: PeerConfig) -> PeerTier:
    """Entry point ``lmtier.backends: peer``: open the peer tier ``config`` (the ``peer``
    section, with the directory and certificate filled in from the ``redis`` and
    ``sidecar`` sections by :func:`lmtier.storage.plugins.peer_section`) describes. No
    I/O but reading the node secret: the directory is reached on first use, so a Redis
    that is down at start costs misses only."""
    if config.directory_url is None:
        raise ConfigError("peer.directory_url (or redis.url) is not set", key="peer")
    tls = None
    if config.tls_ca_file is not None:
        tls = PeerTLS(
            config.tls_ca_file, config.tls_cert_file, config.tls_key_file, config.tls_server_name
        )
    tier = PeerTier(
        config.directory_url,
        key=node_key(config),
        policy=config.policy,
        key_prefix=config.key_prefix if config.key_prefix is not None else "lmtier:",
        node_id=config.node_id,
        tls=tls,
        ttl_s=config.ttl_s,
        publish_interval_s=config.publish_interval_s,
        timeout_s=config.timeout_s,
        min_bytes_per_s=config.min_bytes_per_s,
        max_keys_per_fetch=config.max_keys_per_fetch,
    )
    await tier.start()
    return tier
