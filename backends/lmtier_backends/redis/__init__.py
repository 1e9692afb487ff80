"""The Redis tier (standalone, Redis Cluster, TLS, unix sockets) with a zero-copy wire
path. Entry point ``redis``: :func:`open_tier`."""

from __future__ import annotations

from lmtier.config import RedisTierConfig
from lmtier.errors import ConfigError
from lmtier_backends.redis.tier import RedisTier

__all__ = ["RedisTier", "open_tier"]


async def open_tier(config: RedisTierConfig) -> RedisTier:
    """Entry point ``lmtier.backends: redis``: open the Redis tier ``config`` (the
    ``redis`` section) describes. Cluster mode is detected at open (``INFO cluster``)."""
    if config.url is None:
        raise ConfigError("redis.url is not set: the Redis tier is disabled")
    return await RedisTier.open(
        config.url,
        key_prefix=config.key_prefix,
        ttl_s=config.ttl_s,
        refresh_ttl_on_hit=config.refresh_ttl_on_hit,
        timeout_s=config.timeout_s,
        min_bytes_per_s=config.min_bytes_per_s,
        lookup_key_s=config.lookup_key_s,
        max_connections=config.max_connections,
        write_policy=config.write_policy,
        queue_depth=config.queue_depth,
    )
