"""Storage backends found by name through the ``lmtier.backends`` entry-point group.

The core never imports a backend: the disk, peer, Redis and S3 tiers live in the
``lmtier_backends`` package (or a third party's) and register a factory::

    [project.entry-points."lmtier.backends"]
    disk = "lmtier_backends.disk:open_tier"

A factory is ``async def open_tier(section) -> Tier``, given its config section as
its one argument (each of lmtier_backends' is its package's ``open_tier``).
:func:`open_tiers` opens the enabled ones in waterfall order: disk, then peer, then
Redis, then S3, then the config's ``extra_tiers`` (third-party backends, each given
its :class:`~lmtier.config.ExtraTierConfig`: the entry point's name and its options).
A factory that raises BackendError (the server is down) does not stop the cache from
opening: a :class:`~lmtier.storage.reopening_tier.ReopeningTier` stands in and
retries. Any other error (a bad configuration, a missing bucket) does, and so does
a factory that returns something that is not a Tier.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from lmtier.config import LMTierConfig, PeerConfig
from lmtier.errors import BackendError, ConfigError
from lmtier.extras import missing_extra
from lmtier.storage.events import NodeFeed
from lmtier.storage.reopening_tier import ReopeningTier
from lmtier.storage.tier import Tier

__all__ = [
    "Service",
    "backend_factory",
    "enabled_sections",
    "open_services",
    "open_tiers",
    "peer_section",
]

logger = logging.getLogger(__name__)

GROUP = "lmtier.backends"
SERVICES = "lmtier.services"
"""Entry points of what follows a node's tiers without being one (the fleet index's
writer): ``async def open_service(section, feed: NodeFeed) -> Service``."""


@runtime_checkable
class Service(Protocol):
    """Something a node runs beside its tiers, fed by their events (:data:`SERVICES`)."""

    async def close(self) -> None:
        """Stop, and withdraw what it published."""


TierFactory = Callable[[Any], Awaitable[Tier]]


def backend_factory(name: str, group: str = GROUP) -> Any:
    """The registered factory of backend ``name`` (or of service ``name``, with
    ``group`` :data:`SERVICES`); ConfigError naming what is installed,
    MissingExtraError naming the extra to install when its client library is not."""
    found = entry_points(group=group)
    for entry in found:
        if entry.name == name:
            try:
                factory: Any = entry.load()
            except ModuleNotFoundError as exc:  # redis-py or boto3 not installed
                missing = missing_extra(exc)
                if missing is None:
                    raise
                raise missing from exc
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
    if config.peer.enabled:
        sections.append(("peer", peer_section(config)))
    if config.redis.url is not None:
        sections.append(("redis", config.redis))
    if config.s3.bucket is not None:
        sections.append(("s3", config.s3))
    sections.extend((extra.backend, extra) for extra in config.extra_tiers)
    return sections


async def open_tiers(config: LMTierConfig) -> list[Tier]:
    """Open every enabled lower tier; on a failure, close those already opened.

    A tier whose server is unreachable is replaced by a ReopeningTier (module docstring).
    """
    tiers: list[Tier] = []
    try:
        for name, section in enabled_sections(config):
            factory = backend_factory(name)
            try:
                tier = await factory(section)
            except BackendError as exc:
                logger.warning(
                    "%s tier unreachable at start (%s); retrying in the background", name, exc
                )
                tiers.append(ReopeningTier(name, _opener(factory, section), section))
                continue
            if not isinstance(tier, Tier):
                raise ConfigError(
                    f"storage backend {name!r} returned {type(tier).__name__}, not a Tier"
                )
            tiers.append(tier)
            logger.debug("opened %s tier", name)
    except BaseException:
        for tier in tiers:
            await tier.close()
        raise
    return tiers


async def open_services(config: LMTierConfig, feed: NodeFeed) -> list[Service]:
    """Start the enabled services (the fleet index's writer, ``fleet.enabled``), each
    given its section and ``feed``; on a failure, close those already started."""
    sections: list[tuple[str, Any]] = []
    if config.fleet.enabled:
        fleet = config.fleet.resolved(config.redis.url)
        if fleet.index_url is None:
            raise ConfigError("fleet.enabled needs fleet.index_url or redis.url", key="fleet")
        sections.append(("fleet", fleet))
    services: list[Service] = []
    try:
        for name, section in sections:
            service = await backend_factory(name, SERVICES)(section, feed)
            if not isinstance(service, Service):
                raise ConfigError(f"service {name!r} returned {type(service).__name__}")
            services.append(service)
    except BaseException:
        for service in services:
            await service.close()
        raise
    return services


def peer_section(config: LMTierConfig, *, directory: bool = True) -> PeerConfig:
    """The ``peer`` section with its directory and certificate filled from the ``redis``
    and ``sidecar`` sections where it leaves them empty. The peer listener and the
    peer tier both read it; the tier needs a directory (``directory``: ConfigError
    without one)."""
    side = config.sidecar
    peer = config.peer.resolved(
        config.redis.url, config.redis.key_prefix, side.tls_cert_file, side.tls_key_file
    )
    if directory and peer.directory_url is None:
        raise ConfigError(
            "peer.enabled needs a directory: set peer.directory_url or redis.url", key="peer"
        )
    return peer


def _opener(factory: TierFactory, section: Any) -> Callable[[], Awaitable[Tier]]:
    """A retry of ``factory(section)`` for a ReopeningTier."""

    async def reopen() -> Tier:
        return await factory(section)

    return reopen
