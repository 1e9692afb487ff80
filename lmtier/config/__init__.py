"""The one typed configuration of lmtier, built once at the edge.

:class:`LMTierConfig` and its sections (:mod:`.model`, pydantic), where values come
from (:mod:`.sources`: a YAML file, ``LMTIER_*`` variables, overrides; LMCache's key
names through :mod:`.lmcache`), byte sizes written for people (:mod:`.sizes`) and
values that never reach a log (:mod:`.secrets`).

Example file::

    chunk_size: 256
    model_id: meta-llama/Llama-3.1-8B-Instruct
    cpu:
      capacity_bytes: 16GiB
    disk:
      path: /mnt/nvme/lmtier
      capacity_bytes: 500GB
    redis:
      url: rediss://default:secret@cache.internal:6380/0
      ttl_s: 86400
    s3:
      bucket: kv-cache
      region: eu-west-1
"""

from lmtier.config.events import EventsConfig
from lmtier.config.fleet import FleetConfig
from lmtier.config.model import (
    MAX_CHUNK_SIZE,
    CPUTierConfig,
    DiskTierConfig,
    ExtraTierConfig,
    IntegrityConfig,
    LMTierConfig,
    RedisTierConfig,
    S3TierConfig,
    chunk_size_problem,
    default_disk_path,
)
from lmtier.config.peer import PeerConfig
from lmtier.config.secrets import Secret, SecretURL, redact_url
from lmtier.config.sizes import format_size, parse_size
from lmtier.config.sources import (
    CONFIG_ENV_VAR,
    ENV_PREFIX,
    LMCACHE_CONFIG_ENV_VAR,
    config_from_dict,
    load_config,
)
from lmtier.config.types import MAX_BYTES

__all__ = [
    "CONFIG_ENV_VAR",
    "ENV_PREFIX",
    "LMCACHE_CONFIG_ENV_VAR",
    "MAX_BYTES",
    "MAX_CHUNK_SIZE",
    "CPUTierConfig",
    "DiskTierConfig",
    "ExtraTierConfig",
    "IntegrityConfig",
    "LMTierConfig",
    "EventsConfig",
    "FleetConfig",
    "PeerConfig",
    "RedisTierConfig",
    "S3TierConfig",
    "Secret",
    "SecretURL",
    "chunk_size_problem",
    "config_from_dict",
    "default_disk_path",
    "format_size",
    "load_config",
    "parse_size",
    "redact_url",
]
