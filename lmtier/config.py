"""The one typed configuration of lmtier, built once at the edge.

The CLI, the sidecar and the engine connector call :func:`load_config` once and pass
the resulting :class:`LMTierConfig` down; nothing below them reads the environment
or a file. ``LMTierConfig()`` is the embedded default: a CPU tier and a disk tier
under the user's cache directory, no servers.

Precedence, lowest first: field defaults < the YAML file < ``LMTIER_*`` environment
variables < ``overrides`` passed by code. Each layer replaces single keys, not whole
sections. The file is the ``path`` argument, else ``$LMTIER_CONFIG``, else none.

Environment names are ``LMTIER_`` plus the dotted key in capitals with ``__`` for the
dot: ``LMTIER_CHUNK_SIZE=512``, ``LMTIER_CPU__CAPACITY_BYTES=8GiB``,
``LMTIER_REDIS__URL=redis://:pw@cache:6379/0``. An empty value sets an optional
field to None (``LMTIER_REDIS__URL=`` disables Redis). Booleans accept true/false,
yes/no, 1/0. Any other ``LMTIER_*`` name is an error, like an unknown key in a file.

Sizes (``*_bytes``) take an int or a string such as ``"5GB"`` (decimal) or ``"8GiB"``
/ ``"8G"`` (binary); see :mod:`lmtier.sizes`. Unknown keys are errors that name the
dotted key and suggest the closest valid one. Secrets (the Redis URL, AWS keys) are
wrapped in :class:`~lmtier.secrets.Secret` / :class:`~lmtier.secrets.SecretURL` and
never appear in a repr, a log line or ``to_dict()`` unless asked with ``redact=False``.

LMCache's key names are accepted at the top level of a file and in ``overrides`` (not
in the environment), logged at DEBUG; one file may not set a field both ways::

    chunk_size            chunk_size (the same key)
    local_cpu             cpu.enabled
    max_local_cpu_size    cpu.capacity_bytes = value * 1024**3 (LMCache's "GB")
    local_disk            disk.enabled + disk.path ("file:///p/" or "/p/"); null/false: off
    max_local_disk_size   disk.capacity_bytes = value * 1024**3
    remote_url            redis://, rediss://, unix:// -> redis.url;
                          s3://bucket/prefix -> s3.bucket + s3.prefix ("prefix/")

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

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import SplitResult, urlsplit

from lmtier.config_fields import (
    NOT_EMPTY,
    POSITIVE,
    at_least,
    coerce,
    expand_home,
    home_dir,
    rules,
    to_plain,
    validate,
)
from lmtier.config_fields import problem as check_field
from lmtier.config_sources import (
    CONFIG_ENV_VAR,
    ENV_PREFIX,
    REDIS_SCHEMES,
    Setting,
    flatten,
    from_environment,
    read_yaml,
)
from lmtier.errors import ConfigError, brief
from lmtier.secrets import Secret, SecretURL, redact_url
from lmtier.sizes import format_size, parse_size

__all__ = [
    "CONFIG_ENV_VAR",
    "ENV_PREFIX",
    "GPU_BLOCK_SIZE",
    "CPUTierConfig",
    "DiskTierConfig",
    "HashAlgorithm",
    "IntegrityConfig",
    "LMTierConfig",
    "RedisTierConfig",
    "MAX_BYTES",
    "MAX_CHUNK_SIZE",
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

logger = logging.getLogger(__name__)

GPU_BLOCK_SIZE = 16
"""Tokens per GPU KV block; a chunk must hold a whole number of blocks."""
MAX_CHUNK_SIZE = 65536
"""Most tokens per chunk: one chunk is one slab of host memory and one object."""
MAX_BYTES = 1 << 60
"""Largest size any ``*_bytes`` setting may name (1 EiB): beyond it, a typo."""
HashAlgorithm = Literal["xxh3", "vllm"]
_GIB = 1024**3
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


# --- rules of single fields ---------------------------------------------------------


def chunk_size_problem(value: int) -> str | None:
    """What is wrong with a chunk size, or None (also used by ``lmtier keys``)."""
    if 0 < value <= MAX_CHUNK_SIZE and value % GPU_BLOCK_SIZE == 0:
        return None
    return (
        f"must be a positive multiple of {GPU_BLOCK_SIZE} (the GPU block size) and at most "
        f"{MAX_CHUNK_SIZE}, got {value}"
    )


def _bytes_problem(value: int) -> str | None:
    if value < 0:
        return f"must be >= 0, got {value}"
    if value > MAX_BYTES:
        return f"must be at most 2**60 bytes (1 EiB): {value} is surely a typo"
    return None


_BYTES = rules(check=_bytes_problem)


def _file_mode_problem(value: str) -> str | None:
    try:
        mode = int(value, 8)
    except ValueError:
        mode = -1
    if 0 <= mode <= 0o777 and mode & 0o600 == 0o600:
        return None
    return (
        "must be an octal mode like '0600' or '0640' that the owner can read and "
        f"write, got {brief(value)}"
    )


def _log_level_problem(value: str) -> str | None:
    ok = value in _LOG_LEVELS
    return None if ok else f"must be one of {', '.join(_LOG_LEVELS)}, got {value!r}"


def _parsed(url: str) -> SplitResult | None:
    """``urlsplit(url)``, or None if the URL or its port does not parse."""
    try:
        parts = urlsplit(url)
        _ = parts.port  # a property that raises on a port not a number in range
    except ValueError:
        return None
    return parts


def _unencoded_password(url: str) -> bool:
    """Whether a ``/``, ``?`` or ``#`` seems to cut the user info short: URL parsers
    (redis-py's too) would then connect with a truncated password to the wrong host.
    That is when the URL's last ``@`` comes after such a delimiter and what precedes
    the delimiter is no plain ``host[:port]``."""
    rest = url.partition("://")[2]
    at = rest.rfind("@")
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    if at < cut:
        return False
    host, colon, port = rest[:cut].rpartition(":") if ":" in rest[:cut] else (rest[:cut], "", "")
    return "@" in rest[:cut] or not host or bool(colon and not port.isdigit())


def _redis_url_problem(url: SecretURL) -> str | None:
    shown, parts = redact_url(url.reveal()), _parsed(url.reveal())
    if _unencoded_password(url.reveal()):
        return (
            f"the password in {shown!r} holds '/', '?' or '#' unencoded: percent-encode "
            "them (%2F, %3F, %23)"
        )
    if url.scheme not in REDIS_SCHEMES:
        return f"scheme must be one of {', '.join(REDIS_SCHEMES)}, got {shown!r}"
    if parts is None:
        return f"not a valid URL: {shown!r}"
    if url.scheme == "unix" and not parts.path:
        return f"a unix:// URL needs a socket path, got {shown!r}"
    return None


def _endpoint_problem(url: str) -> str | None:
    parts = _parsed(url)
    if parts is not None and parts.scheme in ("http", "https") and parts.hostname:
        return None
    return f"must be an http:// or https:// URL, got {redact_url(url)!r}"


# --- the configuration ------------------------------------------------------------


def default_disk_path(env: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/lmtier/chunks``, else ``~/.cache/lmtier/chunks``, from ``env``.

    A relative ``XDG_CACHE_HOME`` is ignored, as the XDG spec requires.
    """
    cache_home = env.get("XDG_CACHE_HOME", "")
    if cache_home and Path(cache_home).is_absolute():
        return Path(cache_home) / "lmtier" / "chunks"
    return home_dir(env) / ".cache" / "lmtier" / "chunks"


def _process_default_disk_path() -> Path:
    # A direct ``DiskTierConfig()`` is built at the edge too (tests, the embedded
    # default), so it resolves the cache dir the way load_config() does without env=.
    return default_disk_path(os.environ)


@dataclass(frozen=True, slots=True)
class CPUTierConfig:
    """Host-memory tier, preallocated once as slabs (pinned when CUDA is present).

    - ``enabled``: keep chunks in host memory. Default True.
    - ``capacity_bytes``: bytes of host memory for cached chunks, >= 0. Default 4 GiB.
    - ``staging_bytes``: bytes of host memory for chunks in flight (loads being copied
      out, stores waiting for their writes), >= 0; at least one chunk. With the CPU
      tier off, a load holds at most this much at once. Default 256 MiB.

    The host memory lmtier allocates (and pins under CUDA) at open is
    ``capacity_bytes + staging_bytes`` (each rounded down to whole chunks), and never
    more; an amount beyond the machine's memory is a CapacityError at open.
    """

    SECTION: ClassVar[str] = "cpu"
    enabled: bool = True
    capacity_bytes: int = field(default=4 * _GIB, metadata=_BYTES)
    staging_bytes: int = field(default=256 * 1024**2, metadata=_BYTES)

    def __post_init__(self) -> None:
        validate(self, self.SECTION)


@dataclass(frozen=True, slots=True)
class DiskTierConfig:
    """Local-disk tier: one file per chunk under ``path``, with an index that survives restarts.

    - ``enabled``: use the disk tier. Default True.
    - ``path``: directory for chunk files. Default ``$XDG_CACHE_HOME/lmtier/chunks`` or
      ``~/.cache/lmtier/chunks`` (see :func:`default_disk_path`); ``~`` is expanded.
    - ``capacity_bytes``: bytes of chunk files kept before LRU eviction, >= 0. Default 32 GiB.
    - ``fsync``: fsync each chunk file before it counts as stored. Default True.
    - ``o_direct``: read and write with O_DIRECT (bypass the page cache). Default False.
    - ``io_threads``: worker threads for file I/O, >= 1. Default 4.
    - ``file_mode``: octal permissions of chunk files (directories get the matching
      search bits), whatever the umask: KV can reveal prompts. Default ``"0600"``
      (owner only); ``"0640"`` lets a group read a shared cache.
    """

    SECTION: ClassVar[str] = "disk"
    enabled: bool = True
    path: Path = field(default_factory=_process_default_disk_path)
    capacity_bytes: int = field(default=32 * _GIB, metadata=_BYTES)
    fsync: bool = True
    o_direct: bool = False
    io_threads: int = field(default=4, metadata=at_least(1))
    file_mode: str = field(default="0600", metadata=rules(check=_file_mode_problem))

    def __post_init__(self) -> None:
        validate(self, self.SECTION)


@dataclass(frozen=True, slots=True)
class RedisTierConfig:
    """Redis tier, shared between nodes. Disabled unless ``url`` is set.

    - ``url``: ``redis://``, ``rediss://`` (TLS) or ``unix://`` URL; may carry a password,
      so it is a SecretURL. Default None (tier disabled).
    - ``key_prefix``: prepended to every Redis key. Default ``"lmtier:"``.
    - ``ttl_s``: seconds a chunk lives in Redis, > 0; None keeps it until Redis evicts it.
      Default None.
    - ``refresh_ttl_on_hit``: reset the TTL when a chunk is read. Default False.
    - ``timeout_s``: seconds allowed per Redis call before it counts as a miss, > 0. Default 0.5.
    - ``max_connections``: size of the connection pool, >= 1. Default 16.
    """

    SECTION: ClassVar[str] = "redis"
    url: SecretURL | None = field(default=None, metadata=rules(check=_redis_url_problem))
    key_prefix: str = "lmtier:"
    ttl_s: float | None = field(default=None, metadata=POSITIVE)
    refresh_ttl_on_hit: bool = False
    timeout_s: float = field(default=0.5, metadata=POSITIVE)
    max_connections: int = field(default=16, metadata=at_least(1))

    def __post_init__(self) -> None:
        validate(self, self.SECTION)


@dataclass(frozen=True, slots=True)
class S3TierConfig:
    """S3 (or S3-compatible) tier, shared between nodes. Disabled unless ``bucket`` is set.

    - ``bucket``: bucket name. Default None (tier disabled).
    - ``prefix``: prepended to every object key. Default ``"lmtier/"``.
    - ``endpoint_url``: http(s) URL of an S3-compatible server (MinIO); None means AWS.
      Default None.
    - ``region``: AWS region; None lets boto3 decide. Default None.
    - ``access_key_id`` / ``secret_access_key``: credentials, set together; None lets boto3
      find them (environment, profile, instance role). Default None.
    - ``ttl_s``: seconds after which lmtier treats an object as expired, > 0; None never.
      Default None.
    - ``timeout_s``: seconds allowed per S3 call before it counts as a miss, > 0. Default 2.0.
    - ``max_concurrency``: S3 requests in flight at once, >= 1. Default 16.
    """

    SECTION: ClassVar[str] = "s3"
    bucket: str | None = field(default=None, metadata=NOT_EMPTY)
    prefix: str = "lmtier/"
    endpoint_url: str | None = field(default=None, metadata=rules(check=_endpoint_problem))
    region: str | None = field(default=None, metadata=NOT_EMPTY)
    access_key_id: Secret | None = None
    secret_access_key: Secret | None = None
    ttl_s: float | None = field(default=None, metadata=POSITIVE)
    timeout_s: float = field(default=2.0, metadata=POSITIVE)
    max_concurrency: int = field(default=16, metadata=at_least(1))

    def __post_init__(self) -> None:
        validate(self, self.SECTION)
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError(
                "s3.access_key_id and s3.secret_access_key: set both or neither, got only one"
            )


@dataclass(frozen=True, slots=True)
class IntegrityConfig:
    """Keyed integrity (an HMAC per chunk) for tiers others can write to; see
    :mod:`lmtier.integrity`. Off unless a key is set.

    - ``key``: the secret key, at least 16 bytes. Default None.
    - ``key_file``: a file holding the key (read at open; a trailing newline is
      dropped). Default None. Set ``key`` or ``key_file``, not both.
    """

    SECTION: ClassVar[str] = "integrity"
    key: Secret | None = None
    key_file: Path | None = None

    def __post_init__(self) -> None:
        validate(self, self.SECTION)
        if self.key is not None and self.key_file is not None:
            raise ConfigError("integrity.key and integrity.key_file: set one, not both")


@dataclass(frozen=True, slots=True)
class LMTierConfig:
    """Everything lmtier needs to run, one section per tier.

    - ``chunk_size``: tokens per chunk; a positive multiple of 16 (the GPU block size).
      Default 256.
    - ``hash_algorithm``: ``"xxh3"`` (fast chained xxh3-128) or ``"vllm"`` (keys equal to
      vLLM's block hashes). Default ``"xxh3"``.
    - ``model_id`` / ``model_revision``: the model and its revision, part of every key's
      namespace so that another model never matches. Default ``""``.
    - ``cpu``, ``disk``, ``redis``, ``s3``: the tier sections (see their classes).
    - ``integrity``: keyed integrity of chunks on shared tiers (see its class).
    - ``log_level``: level for lmtier's loggers, one of DEBUG, INFO, WARNING, ERROR,
      CRITICAL (any case in files and env). Default ``"WARNING"``.
    """

    SECTION: ClassVar[str] = ""
    chunk_size: int = field(default=256, metadata=rules(check=chunk_size_problem))
    hash_algorithm: HashAlgorithm = field(default="xxh3", metadata=rules(normalize=str.lower))
    model_id: str = ""
    model_revision: str = ""
    cpu: CPUTierConfig = field(default_factory=CPUTierConfig)
    disk: DiskTierConfig = field(default_factory=DiskTierConfig)
    redis: RedisTierConfig = field(default_factory=RedisTierConfig)
    s3: S3TierConfig = field(default_factory=S3TierConfig)
    integrity: IntegrityConfig = field(default_factory=IntegrityConfig)
    log_level: str = field(
        default="WARNING", metadata=rules(check=_log_level_problem, normalize=str.upper)
    )

    def __post_init__(self) -> None:
        validate(self, self.SECTION)

    def to_dict(self, redact: bool = True) -> dict[str, Any]:
        """Plain nested dict of every field, for printing (``lmtier config show``).

        Paths become strings and secrets are redacted unless ``redact=False``; with
        ``redact=False`` the result loads back through :func:`config_from_dict`.
        """
        return to_plain(self, redact)


_Section = CPUTierConfig | DiskTierConfig | RedisTierConfig | S3TierConfig | IntegrityConfig
_SECTIONS: dict[str, type[_Section]] = {
    "cpu": CPUTierConfig,
    "disk": DiskTierConfig,
    "redis": RedisTierConfig,
    "s3": S3TierConfig,
    "integrity": IntegrityConfig,
}


# --- public entry points ------------------------------------------------------------

_KEYS: dict[str, Field[Any]] = {  # every valid dotted key and its field
    **{f.name: f for f in fields(LMTierConfig) if f.name not in _SECTIONS},
    **{f"{name}.{f.name}": f for name, cls in _SECTIONS.items() for f in fields(cls)},
}


def _build(settings: Mapping[str, Setting], env: Mapping[str, str] | None) -> LMTierConfig:
    values: dict[str, dict[str, Any]] = {"": {}, **{name: {} for name in _SECTIONS}}
    for key, setting in settings.items():
        f = _KEYS[key]
        try:
            value = coerce(f, setting.value, env)
            problem = check_field(f, value)
        except ValueError as exc:  # parse_size raises ConfigError, a ValueError
            problem = str(exc)
        if problem is not None:
            raise ConfigError(f"{key}: {problem}{setting.note}")
        values[key.rpartition(".")[0]][f.name] = value
    if env is not None and "path" not in values["disk"]:
        values["disk"]["path"] = default_disk_path(env)
    sections: dict[str, Any] = {name: cls(**values[name]) for name, cls in _SECTIONS.items()}
    return LMTierConfig(**values[""], **sections)


def config_from_dict(
    data: Mapping[str, Any], *, env: Mapping[str, str] | None = None
) -> LMTierConfig:
    """Build a config from a mapping shaped like the YAML file (LMCache keys allowed).

    ``env`` is used only for defaults that depend on the user (``XDG_CACHE_HOME`` and
    ``HOME``, for the disk path and ``~``), never for ``LMTIER_*`` values; None means
    the process environment, as for ``LMTierConfig()``.
    """
    return _build(flatten(data, _KEYS, "", dotted=False), env)


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> LMTierConfig:
    """Load the config: defaults < YAML file < ``LMTIER_*`` in ``env`` < ``overrides``.

    ``path`` defaults to ``env["LMTIER_CONFIG"]``; with neither, there is no file.
    ``env`` defaults to ``os.environ``: this is the one place that reads it. Keys in
    ``overrides`` are nested like the file's or dotted (``"cpu.capacity_bytes"``).
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    if path is None:
        path = environ.get(CONFIG_ENV_VAR) or None
    settings: dict[str, Setting] = {}
    if path is not None:
        file_path = expand_home(Path(path), environ)
        settings.update(flatten(read_yaml(file_path), _KEYS, f" (in {file_path})", dotted=False))
    settings.update(from_environment(environ, _KEYS))
    if overrides:
        settings.update(flatten(overrides, _KEYS, " (in overrides)", dotted=True))
    config = _build(settings, environ)
    logger.debug("loaded config from %s: %r", path or "defaults and environment", config)
    return config
