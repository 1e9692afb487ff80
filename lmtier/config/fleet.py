"""The ``fleet`` section: this node's chunks, by tier, in the fleet index that
``lmtier route`` asks where a prompt's prefix is cached (:mod:`lmtier_backends.fleet`,
docs/fleet.md).

The index lives in a Redis the nodes already share (``index_url``, by default the
Redis tier's ``redis.url``): no coordinator of its own. A node writes what its tiers
gain and lose (:mod:`lmtier.storage.events`) every ``interval_s``, renews its
heartbeat every third of ``ttl_s``, and keeps at most ``max_keys`` chunks there (the
least recently written go first), so a dead node's entries stop counting after
``ttl_s`` and no node can fill the Redis.
"""

from __future__ import annotations

import re
import socket
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, Field, model_validator

from lmtier.config.section import Section
from lmtier.config.types import Bool, Count, PositiveFloat, SecretUrl, Text, Timeout

__all__ = ["NODE_ID", "FleetConfig"]

_SCHEMES = ("redis", "rediss", "unix")
NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
"""What a node id may be: it is part of Redis keys and of the router's answers."""


def _node_id(value: str) -> str:
    if not NODE_ID.fullmatch(value):
        raise ValueError(
            "a node id is 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return value


def _default_node_id() -> str:
    name = socket.gethostname().split(".")[0]
    return name if NODE_ID.fullmatch(name) else "node"


class FleetConfig(Section):
    """This node in the fleet index (module docstring)."""

    SECTION: ClassVar[str] = "fleet"
    enabled: Bool = False
    """Publish this node's chunks in the fleet index."""
    node_id: Annotated[Text, AfterValidator(_node_id)] = Field(default_factory=_default_node_id)
    """This node's name in the index: the name ``lmtier route --engine NAME=URL`` gives
    the engine this node's cache serves (default: the host name)."""
    index_url: SecretUrl | None = None
    """The Redis of the index (``redis://``, ``rediss://``, ``unix://``); empty: the
    Redis tier's ``redis.url``."""
    key_prefix: Text = "lmtier:"
    """Prefix of the index's Redis keys (all under the hash tag ``{fleet}``)."""
    ttl_s: PositiveFloat = 10.0
    """How long the index trusts this node without a heartbeat."""
    entry_ttl_s: PositiveFloat = 3600.0
    """How long a chunk's entry outlives its last update (bounds what a dead node
    leaves behind)."""
    max_keys: Count = 262_144
    """Most chunks this node keeps in the index (about 150 bytes of Redis each)."""
    interval_s: PositiveFloat = 0.05
    """Seconds between two writes of this node's changes (the index lags this much)."""
    timeout_s: Timeout = 1.0
    """Deadline of one call to the index's Redis."""

    @model_validator(mode="after")
    def _checked(self) -> FleetConfig:
        url = self.index_url
        if url is not None and url.scheme not in _SCHEMES:
            raise ValueError(f"index_url: scheme must be one of {', '.join(_SCHEMES)}")
        if self.interval_s * 2 > self.ttl_s:
            raise ValueError("interval_s must be at most half of ttl_s")
        return self

    def check_index(self) -> None:
        """ValueError when the section is on without an index to write to."""
        if self.enabled and self.index_url is None:
            raise ValueError("fleet.enabled needs fleet.index_url or redis.url")

    def resolved(self, redis_url: Any) -> FleetConfig:
        """This section with ``index_url`` from the Redis tier's URL where it has none."""
        if self.index_url is not None or redis_url is None:
            return self
        return self.replace(index_url=redis_url)
