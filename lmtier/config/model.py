"""The one typed configuration of lmtier: pydantic models, one section per tier.

``LMTierConfig()`` is the embedded default: a CPU tier and a disk tier under the
user's cache directory, no servers. Every field is typed and documented where it is
declared (its docstring is its description); a section built directly
(``CPUTierConfig(capacity_bytes=-1)``) is checked exactly as a file would be, and a
bad value is a :class:`~lmtier.errors.ConfigError` naming the dotted key. Configs
are frozen. Secrets (the Redis URL, AWS keys, the integrity key) are wrapped in
:class:`~lmtier.config.secrets.Secret` / :class:`~lmtier.config.secrets.SecretURL`
and never appear in a repr, a log line or :meth:`LMTierConfig.to_dict` unless asked.

Where the values come from (a YAML file, ``LMTIER_*`` variables, LMCache's keys,
overrides from code) is :mod:`lmtier.config.sources`.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar
from urllib.parse import SplitResult, urlsplit

from pydantic import AfterValidator, Field, field_validator, model_validator

from lmtier.chunks.keys import BLOCK_SIZE, HASH_ALGORITHMS, HashAlgorithm
from lmtier.config.events import EventsConfig
from lmtier.config.fleet import FleetConfig
from lmtier.config.peer import PeerConfig
from lmtier.config.policy import DEFAULT_QUEUE_DEPTH, ConfiguredWritePolicy
from lmtier.config.secrets import MASK, Secret, SecretURL, redact_url
from lmtier.config.section import Section as _Section
from lmtier.config.sidecar import SidecarConfig
from lmtier.config.types import (
    Bool,
    Count,
    Int,
    NonEmptyText,
    PathValue,
    PinFraction,
    PositiveFloat,
    SecretText,
    SecretUrl,
    Size,
    Text,
    Timeout,
    Wait,
)
from lmtier.errors import ConfigError, brief

__all__ = [
    "MAX_CHUNK_SIZE",
    "REDIS_SCHEMES",
    "CPUTierConfig",
    "DiskTierConfig",
    "ExtraTierConfig",
    "IntegrityConfig",
    "LMTierConfig",
    "RedisTierConfig",
    "S3TierConfig",
    "chunk_size_problem",
    "cache_home",
    "default_disk_path",
    "home_dir",
]

MAX_CHUNK_SIZE = 65536
"""Most tokens per chunk: one chunk is one slab of host memory and one object."""
MAX_IO_THREADS = 256
"""Most disk I/O threads: past a few dozen a disk only queues them."""
MAX_CONNECTIONS = 1024
"""Most connections (or requests in flight) to one Redis or S3 endpoint."""
MAX_LOOKUP_KEY_S = 1.0
"""Most seconds a lookup's deadline grows per key."""
REDIS_SCHEMES = ("redis", "rediss", "unix")
_GIB = 1024**3
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


# --- rules of single fields ----------------------------------------------------------


def chunk_size_problem(value: int) -> str | None:
    """What is wrong with a chunk size, or None (also used by ``lmtier keys``)."""
    if 0 < value <= MAX_CHUNK_SIZE and value % BLOCK_SIZE == 0:
        return None
    return (
        f"must be a positive multiple of {BLOCK_SIZE} (the GPU block size) and at most "
        f"{MAX_CHUNK_SIZE}, got {value}"
    )


def _rule(problem: Any) -> AfterValidator:
    """An AfterValidator from a ``problem(value) -> str | None`` function."""

    def check(value: Any) -> Any:
        found = problem(value)
        if found is not None:
            raise ValueError(found)
        return value

    return AfterValidator(check)


def _one_of(choices: tuple[str, ...], shown: str) -> Any:
    def problem(value: str) -> str | None:
        return None if value in choices else f"must be one of {shown}, got {brief(value)}"

    return problem


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


_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_BUCKET_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_BUCKET_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--table-s3")
_REGION = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
MAX_PREFIX_BYTES = 512
"""Longest key prefix (Redis, S3): an S3 key holds at most 1024 bytes, and every
key of every chunk carries the prefix."""


def _bucket_problem(name: str) -> str | None:
    """What AWS's naming rules for general purpose buckets say against ``name`` (they
    also hold for S3-compatible servers such as MinIO), or None."""
    reserved = name.startswith(_BUCKET_PREFIXES) or name.endswith(_BUCKET_SUFFIXES)
    ip_like = True
    try:
        ipaddress.IPv4Address(name)
    except ValueError:
        ip_like = False
    if _BUCKET.fullmatch(name) and ".." not in name and not reserved and not ip_like:
        return None
    return (
        "must be an S3 bucket name: 3-63 lowercase letters, digits, '.' and '-', "
        "starting and ending with a letter or digit, no '..', not an IP address, "
        f"not a reserved prefix or suffix (xn--, -s3alias, ...); got {brief(name)}"
    )


def _region_problem(name: str) -> str | None:
    if _REGION.fullmatch(name):
        return None
    return f"must be a region name like 'us-east-1', got {brief(name)}"


def _prefix_problem(prefix: str) -> str | None:
    if len(prefix.encode()) <= MAX_PREFIX_BYTES:
        return None
    return f"must be at most {MAX_PREFIX_BYTES} bytes, got {len(prefix.encode())}"


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


def home_dir(env: Mapping[str, str] | None) -> Path:
    """``$HOME`` from ``env``; the account's home if ``env`` has none (or is None)."""
    home = env.get("HOME", "") if env is not None else ""
    return Path(home) if home else Path.home()


def cache_home(env: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME``, else ``~/.cache``, from ``env``: where lmtier keeps its
    files (``lmtier/`` below it). A relative ``XDG_CACHE_HOME`` is ignored, as the
    XDG spec requires."""
    value = env.get("XDG_CACHE_HOME", "")
    if value and Path(value).is_absolute():
        return Path(value)
    return home_dir(env) / ".cache"


def default_disk_path(env: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/lmtier/chunks``, else ``~/.cache/lmtier/chunks``, from ``env``."""
    return cache_home(env) / "lmtier" / "chunks"


# --- the sections -------------------------------------------------------------------


class _ByteTierSection(_Section):
    """What every tier below host memory takes: how it receives new chunks."""

    write_policy: ConfiguredWritePolicy = "write_through"
    """``write_through``: every new chunk is written here in the background;
    ``write_back``: only chunks the CPU tier evicts are."""
    queue_depth: Count = DEFAULT_QUEUE_DEPTH
    """Chunks that may wait for a background write here; at most half the host pool's
    slabs are used, whatever this says (queued writes hold their slabs). A store that
    finds it full waits for room (``write_wait_s``); a promotion drops and counts."""


class CPUTierConfig(_Section):
    """Host-memory tier, preallocated once as slabs (pinned when CUDA is present).

    The host memory lmtier allocates at open is ``capacity_bytes + staging_bytes``
    (each rounded down to whole chunks), and never more; an amount beyond the
    machine's memory is a CapacityError at open.
    """

    SECTION: ClassVar[str] = "cpu"
    enabled: Bool = True
    """Keep chunks in host memory."""
    capacity_bytes: Size = 4 * _GIB
    """Host memory for cached chunks."""
    staging_bytes: Size = 256 * 1024**2
    """Host memory for chunks in flight (loads being copied out, stores waiting for
    their writes); at least one chunk. With the CPU tier off, a load holds at most
    this much at once."""
    max_pinned_fraction: PinFraction = 0.5
    """Part of ``capacity_bytes`` that pinned chunks (``lmtier warm --pin``) may take;
    pins past it are refused, so the rest of the tier always stays evictable."""


def _process_default_disk_path() -> Path:
    # A direct ``DiskTierConfig()`` is built at the edge too (tests, the embedded
    # default), so it resolves the cache dir the way load_config() does without env=.
    return default_disk_path(os.environ)


class DiskTierConfig(_ByteTierSection):
    """Local-disk tier: one file per chunk under ``path``, with an index that survives
    restarts; processes sharing ``path`` keep it within ``capacity_bytes`` together."""

    SECTION: ClassVar[str] = "disk"
    enabled: Bool = True
    """Use the disk tier."""
    path: PathValue = Field(default_factory=_process_default_disk_path)
    """Directory for chunk files; ``$XDG_CACHE_HOME/lmtier/chunks`` or
    ``~/.cache/lmtier/chunks`` by default; ``~`` is expanded."""
    capacity_bytes: Size = 32 * _GIB
    """Bytes of chunk files kept before LRU eviction."""
    max_pinned_fraction: PinFraction = 0.5
    """Part of ``capacity_bytes`` that pinned chunks (``lmtier warm --pin``) may take;
    pins are kept in ``<path>/v1/pins`` and survive restarts."""
    fsync: Bool = False
    """Make each batch of writes durable (one ``syncfs``: data and file names) before
    its chunks count as stored. Off: the kernel writes them back in its own time
    (~30 s); a crash of the process loses nothing, a power loss can lose or zero the
    newest chunks, and their checksums make those misses. On costs every byte a trip
    to the disk, which small chunks stored faster than the disk syncs cannot afford."""
    o_direct: Bool = False
    """Read and write with O_DIRECT (bypass the page cache)."""
    io_threads: Annotated[Count, Field(le=MAX_IO_THREADS)] = 4
    """Worker threads for the files of one batch of writes, at most 256; a batch of
    reads runs on twice as many (cold reads wait on the device, not the CPU)."""
    file_mode: Annotated[Text, _rule(_file_mode_problem)] = "0600"
    """Octal permissions of chunk files, the ledger and the pins list (directories,
    ``path`` and the parents the tier creates included, get the matching search bits),
    whatever the umask: KV can reveal prompts. ``"0640"`` lets a group read."""


class RedisTierConfig(_ByteTierSection):
    """Redis tier, shared between nodes. Disabled unless ``url`` is set."""

    SECTION: ClassVar[str] = "redis"
    url: Annotated[SecretUrl, _rule(_redis_url_problem)] | None = None
    """``redis://``, ``rediss://`` (TLS) or ``unix://`` URL; may carry a password (percent-
    encode ``/ ? #`` in it)."""
    key_prefix: Annotated[Text, _rule(_prefix_problem)] = "lmtier:"
    """Prepended to every Redis key (at most 512 bytes)."""
    ttl_s: PositiveFloat | None = None
    """Seconds a chunk lives in Redis; None keeps it until Redis evicts it."""
    refresh_ttl_on_hit: Bool = False
    """Reset the TTL when a chunk is read."""
    timeout_s: Timeout = 0.5
    """Seconds a Redis call may go without moving a byte before it counts as a miss (a
    hung server), and the fixed part of every call's deadline (at most 3600)."""
    min_bytes_per_s: Size = 64 * 1024**2
    """Slowest transfer counted as healthy: a call's deadline is ``timeout_s`` plus its
    bytes at this rate (a 512-chunk load of 2 MiB chunks: 0.5 s + 16 s), so large
    batches are not lost on a busy machine; a hang still ends a call after ``timeout_s``.
    0: every call gets ``timeout_s``, whatever its size."""
    lookup_key_s: Annotated[Timeout, Field(le=MAX_LOOKUP_KEY_S)] = 0.0001
    """Seconds added to a lookup's deadline per key asked about (at most 1)."""
    max_connections: Annotated[Count, Field(le=MAX_CONNECTIONS)] = 16
    """Size of the connection pool (at most 1024)."""


class S3TierConfig(_ByteTierSection):
    """S3 (or S3-compatible) tier, shared between nodes. Disabled unless ``bucket`` is set."""

    SECTION: ClassVar[str] = "s3"
    bucket: Annotated[Text, _rule(_bucket_problem)] | None = None
    """Bucket name, as AWS's naming rules allow (3-63 lowercase letters, digits, dots
    and hyphens)."""
    prefix: Annotated[Text, _rule(_prefix_problem)] = "lmtier/"
    """Prepended to every object key (at most 512 bytes)."""
    endpoint_url: Annotated[Text, _rule(_endpoint_problem)] | None = None
    """http(s) URL of an S3-compatible server (MinIO); None means AWS."""
    region: Annotated[Text, _rule(_region_problem)] | None = None
    """AWS region (``us-east-1``); None lets boto3 decide."""
    access_key_id: SecretText | None = None
    """Access key id, set together with ``secret_access_key``; None lets boto3 find
    credentials (environment, profile, instance role)."""
    secret_access_key: SecretText | None = None
    """Secret access key (see ``access_key_id``)."""
    ttl_s: PositiveFloat | None = None
    """Seconds after which lmtier treats an object as expired; None never."""
    timeout_s: Timeout = 2.0
    """Seconds an S3 call may go without an answer or a byte moving before it counts as
    a miss (a hung endpoint), the fixed part of every call's deadline, and botocore's
    connect and read timeouts (at most 3600)."""
    min_bytes_per_s: Size = 16 * 1024**2
    """Slowest transfer counted as healthy: a call's deadline is ``timeout_s`` plus its
    bytes at this rate (a 512-chunk load of 2 MiB chunks: 2 s + 64 s), so large
    batches are not lost on a busy machine; a hang still ends a call after ``timeout_s``.
    0: every call gets ``timeout_s``, whatever its size."""
    lookup_key_s: Annotated[Timeout, Field(le=MAX_LOOKUP_KEY_S)] = 0.01
    """Seconds added to a lookup's deadline per key asked about (one HEAD each,
    ``max_concurrency`` at a time: moto on a loaded 2-core machine answers ~200/s); at
    most 1."""
    max_concurrency: Annotated[Count, Field(le=MAX_CONNECTIONS)] = 16
    """S3 requests in flight at once (at most 1024)."""

    def model_post_init(self, context: Any) -> None:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError(
                "s3.access_key_id and s3.secret_access_key: set both or neither, got only one"
            )


class IntegrityConfig(_Section):
    """Keyed integrity (an HMAC per chunk) for tiers others can write to; see
    :mod:`lmtier.chunks.integrity`. Off unless a key is set."""

    SECTION: ClassVar[str] = "integrity"
    key: SecretText | None = None
    """The secret key, at least 16 bytes."""
    key_file: PathValue | None = None
    """A file holding the key (read at open; a trailing newline is dropped)."""

    def model_post_init(self, context: Any) -> None:
        if self.key is not None and self.key_file is not None:
            raise ConfigError("integrity.key and integrity.key_file: set one, not both")


class ExtraTierConfig(_Section):
    """A tier from a third-party backend (an ``lmtier.backends`` entry point), asked
    after disk, Redis and S3, in list order."""

    SECTION: ClassVar[str] = "extra_tiers"
    backend: NonEmptyText
    """The entry point's name."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Settings handed to the backend as they are; the backend checks them."""

    def __hash__(self) -> int:
        # Frozen configs are dictionary keys (the vLLM connector's caches per process);
        # ``options`` is a plain dict, so the hash names the backend and equality
        # compares the rest.
        return hash((type(self), self.backend))


# --- the whole configuration ---------------------------------------------------------


class LMTierConfig(_Section):
    """Everything lmtier needs to run, one section per tier.

    ``LMTierConfig()`` never reads the environment or a file:
    :func:`lmtier.config.load_config` adds a file, ``LMTIER_*`` variables (read with
    pydantic-settings) and overrides, at the edge.
    """

    chunk_size: Annotated[Int, _rule(chunk_size_problem)] = 256
    """Tokens per chunk: a positive multiple of 16 (the GPU block size)."""
    hash_algorithm: HashAlgorithm = "xxh3"
    """``xxh3`` (fast chained xxh3-128) or ``vllm`` (keys equal to vLLM's block hashes)."""
    model_id: Text = ""
    """The model, part of every key's namespace so that another model never matches;
    a cache needs it (or ``model_revision``)."""
    model_revision: Text = ""
    """The model's revision or weights fingerprint (a new one invalidates every key)."""
    cpu: CPUTierConfig = Field(default_factory=CPUTierConfig)
    """The host-memory tier."""
    disk: DiskTierConfig = Field(default_factory=DiskTierConfig)
    """The local-disk tier."""
    redis: RedisTierConfig = Field(default_factory=RedisTierConfig)
    """The Redis tier."""
    s3: S3TierConfig = Field(default_factory=S3TierConfig)
    """The S3 tier."""
    peer: PeerConfig = Field(default_factory=PeerConfig)
    """Chunks fetched from (and served to) other nodes' CPU tiers, after disk."""
    events: EventsConfig = Field(default_factory=EventsConfig)
    """KV events of every tier on ZMQ, in vLLM's format (:mod:`lmtier.events`)."""
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    """This node's chunks in the fleet index that ``lmtier route`` asks (docs/fleet.md)."""
    extra_tiers: tuple[ExtraTierConfig, ...] = ()
    """Tiers of third-party backends, after the others, in order."""
    integrity: IntegrityConfig = Field(default_factory=IntegrityConfig)
    """Keyed integrity of chunks on shared tiers."""
    sidecar: SidecarConfig = Field(default_factory=SidecarConfig)
    """``lmtier serve``: listener, security, shared host pool."""
    log_level: Annotated[str, _rule(_one_of(_LOG_LEVELS, ", ".join(_LOG_LEVELS)))] = "WARNING"
    """Level of lmtier's loggers: DEBUG, INFO, WARNING, ERROR or CRITICAL (any case)."""
    close_flush_s: Wait = 30.0
    """Seconds ``close()``, or the end of a program that did not call it, waits for
    the background writes still queued to reach the tiers below host memory (at most
    3600; 0: none). What is queued then is dropped, counted in ``queue_drops``, with
    one warning."""
    write_wait_s: Wait = 5.0
    """Back-pressure on stores: when a write-through tier's queue is full (or every
    free slab is held by writes still pending), ``store()`` waits for room as long as
    writes keep landing, and gives up once this many seconds pass with none landing;
    the chunks it could not queue then are dropped and counted in the tier's
    ``queue_drops``. A tier that is down (its breaker open) is never waited for. 0:
    never wait (drop at once). Promotions never wait."""

    @field_validator("hash_algorithm", mode="before")
    @classmethod
    def _algorithm(cls, value: Any) -> Any:
        value = value.strip().lower() if isinstance(value, str) else value
        if value not in HASH_ALGORITHMS:
            choices = ", ".join(repr(a) for a in HASH_ALGORITHMS)
            raise ValueError(f"must be one of {choices}, got {brief(value)}")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _level(cls, value: Any) -> Any:
        return value.strip().upper() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _fleet_index(self) -> LMTierConfig:
        self.fleet.resolved(self.redis.url).check_index()
        return self

    def to_dict(self, redact: bool = True) -> dict[str, Any]:
        """Plain nested dict of every field, for printing (``lmtier config show``).

        Paths become strings and secrets are redacted unless ``redact=False``; with
        ``redact=False`` the result loads back through
        :func:`lmtier.config.config_from_dict`.
        """
        data: dict[str, Any] = self.model_dump(mode="json")
        sections = [(n, s) for n, s in self if isinstance(s, _Section)] if redact else []
        for name, section in sections:  # every section's secrets, whichever holds one
            for field_name, value in section:
                if isinstance(value, SecretURL):
                    data[name][field_name] = str(value)
                elif isinstance(value, Secret):
                    data[name][field_name] = MASK
        return data
