"""The Redis tier (standalone, Redis Cluster, TLS, unix sockets) with a zero-copy wire
path. Entry point ``redis``."""

from lmtier_backends.redis.tier import RedisTier, open_tier

__all__ = ["RedisTier", "open_tier"]
