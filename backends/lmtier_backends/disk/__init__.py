"""The local-disk tier: one file per chunk, an index rebuilt from file names, a
directory shared safely by several processes. Entry point ``disk``: :func:`open_tier`."""

from __future__ import annotations

from lmtier.config import DiskTierConfig
from lmtier_backends.disk.tier import DiskTier

__all__ = ["DiskTier", "open_tier"]


async def open_tier(config: DiskTierConfig) -> DiskTier:
    """Entry point ``lmtier.backends: disk``: open the disk tier ``config`` (the ``disk``
    section) describes."""
    return await DiskTier.open(
        config.path,
        config.capacity_bytes,
        fsync=config.fsync,
        o_direct=config.o_direct,
        io_threads=config.io_threads,
        file_mode=int(config.file_mode, 8),
        write_policy=config.write_policy,
        queue_depth=config.queue_depth,
        max_pinned_fraction=config.max_pinned_fraction,
    )
