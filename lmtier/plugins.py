"""Storage backends found by name through the ``lmtier.backends`` entry-point group.

The core never imports a backend: the disk, Redis and S3 tiers live in the
``lmtier_backends`` package (or a third party's) and register a factory::

    [project.entry-points."lmtier.backends"]
    disk = "lmtier_backends.disk:open_tier"

A factory is ``async def open_tier(section_config) -> Tier``. :func:`open_tiers`
opens the enabled ones in waterfall order: disk, then Redis, then S3.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from importlib.metadata import entry_points
from typing import Any

from lmtier.config import LMTierConfig
from lmtier.errors import ConfigError
from lmtier.tier import Tier

__all__ = ["backend_factory", "enabled_sections", "open_tiers"]

logger = logging.getLogger(__name__)

GROUP = "lmtier.backends"

TierFactory = Callable[[Any], Awaitable[Tier]]


def backend_factory(name: str) -> TierFactory:
    """The registered factory of backend ``name``; ConfigError naming what is installed."""
    found = entry_points(group=GROUP)
    for entry in found:
        if entry.name == name:
            factory: TierFactory = entry.load()
            return factory
    available = sorted(entry.name for entry in found)
    raise ConfigError(
        f"no storage backend named {name!r} is installed (available: {available}); "
        "is the lmtier package installed (pip install -e .)?"
    )


def enabled_sections(config: LMTierConfig) -> list[tuple[str, Any]]:
    """The enabled lower tiers of ``config`` as ``(backend name, section)``, in order."""
    sections: list[tuple[str, Any]] = []
    if config.disk.enabled:
        sections.append(("disk", config.disk))
    if config.redis.url is not None:
        sections.append(("redis", config.redis))
    if config.s3.bucket is not None:
        sections.append(("s3", config.s3))
    return sections


async def open_tiers(config: LMTierConfig) -> list[Tier]:
    """Open every enabled lower tier; on a failure, close those already opened."""
    tiers: list[Tier] = []
    try:
        for name, section in enabled_sections(config):
            tiers.append(await backend_factory(name)(section))
            logger.debug("opened %s tier", name)
    except BaseException:
        for tier in tiers:
            await tier.close()
        raise
    return tiers
