"""The ``events`` section: KV events from every tier, published as vLLM publishes its
own (:mod:`lmtier.events`), so that an indexer that reads vLLM's events (llm-d's,
Dynamo's, lmtier's fleet index) reads lmtier's unchanged.

The keys are vLLM's ``--kv-events-config`` keys (``endpoint``, ``replay_endpoint``,
``buffer_steps``, ``hwm``, ``max_queue_size``, ``topic``, and ``enabled`` for
``enable_kv_cache_events``, which is accepted too, as is ``publisher: zmq|null``), so
one JSON object configures both. Two differ on purpose:

* ``endpoint`` defaults to loopback (``tcp://127.0.0.1:5557``), not vLLM's
  ``tcp://*:5557``: the events name every chunk this node holds, and a ZMQ PUB socket
  has no token. A TCP endpoint that other machines can reach is refused unless
  ``curve_secret_key_file`` is set (ZMQ CURVE: only subscribers that know the
  server's public key can connect, and the traffic is encrypted);
* ``interval_s``: how often queued events go out as one batch (vLLM sends one per
  engine step).
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any, ClassVar
from urllib.parse import urlsplit

from pydantic import Field, Strict, model_validator

from lmtier.config.section import Section
from lmtier.config.types import Bool, Count, PathValue, PositiveFloat, Text

__all__ = ["EventsConfig", "local_endpoint"]

_SCHEMES = ("tcp", "ipc", "inproc")
_LOCAL_NAMES = ("localhost",)


def local_endpoint(endpoint: str) -> bool:
    """Whether a ZMQ ``endpoint`` can only be reached from this machine: ``ipc://``,
    ``inproc://``, or TCP on a loopback address."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = urlsplit(f"//{rest}").hostname or ""
    if host in _LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # '*', a name, an interface: reachable from elsewhere


def _check_endpoint(endpoint: str, what: str) -> None:
    scheme = endpoint.partition("://")[0]
    if scheme not in _SCHEMES or "://" not in endpoint:
        raise ValueError(f"{what} {endpoint!r} is not a ZMQ endpoint (tcp://, ipc://)")


class EventsConfig(Section):
    """KV events of every tier, on ZMQ (module docstring)."""

    SECTION: ClassVar[str] = "events"
    enabled: Bool = False
    """Publish KV events (vLLM's ``enable_kv_cache_events``)."""
    endpoint: Text = "tcp://127.0.0.1:5557"
    """The PUB socket's endpoint (bound)."""
    replay_endpoint: Text | None = None
    """A ROUTER socket where a subscriber asks for the batches from a sequence number
    on (8 bytes, big-endian), as vLLM's replay socket answers; none when empty."""
    buffer_steps: Count = 10_000
    """Batches kept for replay."""
    hwm: Count = 100_000
    """The PUB socket's high-water mark (messages queued per subscriber)."""
    max_queue_size: Count = 100_000
    """Events queued while waiting to be published; past it the oldest are lost, and
    the next batch starts with ``AllBlocksCleared`` and what the node's memory holds,
    so that a subscriber's view is whole again."""
    topic: Text = ""
    """The topic every message is sent under."""
    interval_s: PositiveFloat = 0.05
    """Seconds between batches."""
    data_parallel_rank: Annotated[int, Strict(), Field(ge=0, le=4095)] = 0
    """Stamped on every batch (vLLM's ``data_parallel_rank``)."""
    int_block_hashes: Bool = False
    """Block hashes as the low 64 bits, an integer (vLLM's
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), not bytes."""
    curve_secret_key_file: PathValue | None = None
    """A file with the server's Z85 CURVE secret key (40 characters, as
    ``zmq.curve_keypair()`` makes): turns on CURVE on both sockets, and with it lets
    ``endpoint`` be reachable from other machines."""

    @model_validator(mode="before")
    @classmethod
    def _vllm_keys(cls, data: Any) -> Any:
        """vLLM's ``enable_kv_cache_events`` and ``publisher`` as lmtier's ``enabled``."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "enable_kv_cache_events" in data:
            data.setdefault("enabled", data.pop("enable_kv_cache_events"))
        publisher = data.pop("publisher", None)
        if publisher not in (None, "zmq", "null"):
            raise ValueError(f"publisher {publisher!r}: lmtier publishes with 'zmq' (or 'null')")
        if publisher == "null":
            data["enabled"] = False
        return data

    @model_validator(mode="after")
    def _endpoints(self) -> EventsConfig:
        for what, endpoint in (
            ("endpoint", self.endpoint),
            ("replay_endpoint", self.replay_endpoint),
        ):
            if endpoint is None:
                continue
            _check_endpoint(endpoint, what)
            if self.enabled and self.curve_secret_key_file is None and not local_endpoint(endpoint):
                raise ValueError(
                    f"{what} {endpoint!r} is reachable from other machines and ZMQ has no "
                    "token: bind a loopback or ipc:// endpoint, or set curve_secret_key_file"
                )
        if self.replay_endpoint is not None and self.replay_endpoint == self.endpoint:
            raise ValueError("replay_endpoint must differ from endpoint")
        return self
