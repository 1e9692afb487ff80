"""The peer tier: chunks fetched from other nodes' CPU tiers, found through a directory
in the shared Redis (:mod:`.tier`). Entry point ``peer``."""

from __future__ import annotations

from lmtier.config import PeerConfig
from lmtier.config.secrets import read_secret_file
from lmtier.errors import ConfigError
from lmtier_backends.peer.tier import PeerTier

__all__ = ["PeerTier", "open_tier"]


async def open_tier(config: PeerConfig) -> PeerTier:
    """Entry point ``lmtier.backends: peer``: the peer tier ``config`` describes (with
    the directory and token filled in from the ``redis`` and ``sidecar`` sections by
    :func:`lmtier.storage.plugins.enabled_sections`). No I/O: the directory is
    reached on first use, so a Redis that is down at start costs misses only."""
    if config.directory_url is None:
        raise ConfigError("peer.directory_url (or redis.url) is not set", key="peer")
    token = config.token
    if token is None and config.token_file is not None:
        token = read_secret_file(config.token_file, "peer.token_file")
    if token is None:
        raise ConfigError(
            "the peer tier needs a node token for other sidecars: set peer.token, "
            "peer.token_file or sidecar.auth_token(_file)",
            key="peer",
        )
    tier = PeerTier(
        config.directory_url,
        token=token,
        key_prefix=config.key_prefix if config.key_prefix is not None else "lmtier:",
        node_id=config.node_id,
        tls_ca_file=config.tls_ca_file,
        ttl_s=config.ttl_s,
        publish_interval_s=config.publish_interval_s,
        timeout_s=config.timeout_s,
        min_bytes_per_s=config.min_bytes_per_s,
        max_keys_per_fetch=config.max_keys_per_fetch,
    )
    await tier.start()
    return tier
