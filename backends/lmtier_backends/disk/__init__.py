"""The local-disk tier: one file per chunk, an index rebuilt from file names, a
directory shared safely by several processes. Entry point ``disk``."""

from lmtier_backends.disk.tier import DiskTier, open_tier

__all__ = ["DiskTier", "open_tier"]
