"""A local cluster's state on disk: what runs where (``cluster.json``) and its secrets.

``lmtier cluster up`` returns while the cluster keeps running, so whatever a later
``down``, ``status`` or ``demo`` needs is written down as it starts: each process's
pid (with its start time, so a pid the kernel has since reused is never signalled),
its log and its address. ``cluster.json`` holds no secret; the secrets live beside it
in ``secrets.env`` (0600), under the variable names of ``deploy/cluster/example.env``,
so the local cluster and docker-compose's are described the same way, and in
``sidecar.token`` (0600), the file every sidecar and engine reads its token from.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from lmtier.errors import LMTierError

__all__ = [
    "SCHEMA",
    "ClusterError",
    "ClusterSecrets",
    "ClusterState",
    "NodeInfo",
    "ProcessInfo",
    "forget_state",
    "read_state",
    "write_private",
]

SCHEMA = "lmtier.cluster/1"
STATE_FILE = "cluster.json"
SECRETS_FILE = "secrets.env"
TOKEN_FILE = "sidecar.token"  # noqa: S105 - a file name


class ClusterError(LMTierError):
    """The local cluster cannot do what was asked: its config files are missing, a
    process did not start or did not stop, an engine did not answer. The message
    says which, and where its log is."""


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600 from creation: the
    file never exists with wider permissions), atomically replacing what was there."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
    os.replace(temp, path)


@dataclass(frozen=True, slots=True)
class ClusterSecrets:
    """The cluster's credentials, generated per cluster (never a default): Redis's
    password, the S3 endpoint's keys (MinIO's root user; moto accepts any) and the
    token every sidecar requires."""

    redis_password: str
    s3_access_key: str
    s3_secret_key: str
    sidecar_token: str

    _NAMES: ClassVar[tuple[tuple[str, str], ...]] = (
        ("REDIS_PASSWORD", "redis_password"),
        ("MINIO_ROOT_USER", "s3_access_key"),
        ("MINIO_ROOT_PASSWORD", "s3_secret_key"),
        ("SIDECAR_TOKEN", "sidecar_token"),
    )

    @classmethod
    def generate(cls) -> ClusterSecrets:
        # URL-safe alphabet: the password goes into a redis:// URL unencoded.
        return cls(
            redis_password=secrets.token_urlsafe(24),
            s3_access_key=f"lmtier-{secrets.token_hex(4)}",
            s3_secret_key=secrets.token_urlsafe(24),
            sidecar_token=secrets.token_urlsafe(32),
        )

    def save(self, directory: Path) -> None:
        """``secrets.env`` (the names of ``deploy/cluster/example.env``) and the token file."""
        lines = [f"{name}={getattr(self, attribute)}" for name, attribute in self._NAMES]
        write_private(directory / SECRETS_FILE, "\n".join(lines) + "\n")
        write_private(directory / TOKEN_FILE, self.sidecar_token + "\n")

    @classmethod
    def load(cls, directory: Path) -> ClusterSecrets:
        """The secrets :meth:`save` wrote in ``directory``; a ClusterError without them."""
        path = directory / SECRETS_FILE
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ClusterError(
                f"cannot read the cluster's secrets {path}: {exc.strerror}"
            ) from None
        values = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
        missing = [name for name, _ in cls._NAMES if not values.get(name)]
        if missing:
            raise ClusterError(f"{path} lacks {', '.join(missing)}")
        return cls(**{attribute: values[name] for name, attribute in cls._NAMES})

    def __repr__(self) -> str:
        return "ClusterSecrets(***)"


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """One process of the cluster: a session leader (its pid is its process group's
    id), its start time in clock ticks since boot (``/proc/<pid>/stat``; None where
    there is no /proc) and its log file."""

    role: str
    pid: int
    start_time: int | None
    log: str


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A node: its sidecar (socket, metrics, disk tier) and its demo engine."""

    name: str
    sidecar: ProcessInfo
    socket: str
    """The sidecar's address, ``unix://<dir>/<name>/sidecar.sock``."""
    metrics_url: str
    disk_path: str
    engine: ProcessInfo | None = None
    engine_url: str | None = None
    peer_address: str = ""
    """``host:port`` of the sidecar's peer listener (other nodes fetch from it)."""


@dataclass(slots=True)
class ClusterState:
    """Everything ``cluster.json`` says; the processes in the order they started."""

    directory: str
    deploy_dir: str
    chunk_size: int
    redis_address: str = ""
    """``host:port``; the password is in ``secrets.env``."""
    s3_kind: str = ""
    """``minio`` or ``moto``."""
    s3_endpoint: str = ""
    bucket: str = ""
    redis: ProcessInfo | None = None
    s3: ProcessInfo | None = None
    nodes: list[NodeInfo] = field(default_factory=list)
    router: ProcessInfo | None = None
    """``lmtier route`` in front of the engines (docs/fleet.md)."""
    router_url: str | None = None
    sidecar_env: dict[str, str] = field(default_factory=dict)
    """More variables every sidecar got (``LocalCluster(sidecar_env=...)``: no secrets),
    so that a sidecar restarted by another process gets them too."""
    schema: str = SCHEMA

    def processes(self) -> list[ProcessInfo]:
        """Every process, in the order to stop them: the router and the engines (the
        clients), then the sidecars (they drain their writes to Redis and S3), then S3
        and Redis."""
        engines = [node.engine for node in self.nodes if node.engine is not None]
        shared = [info for info in (self.s3, self.redis) if info is not None]
        router = [self.router] if self.router is not None else []
        return [*router, *engines, *(node.sidecar for node in self.nodes), *shared]

    def redis_url(self, cluster_secrets: ClusterSecrets) -> str:
        """The Redis URL with the password, for clients that connect."""
        return f"redis://:{cluster_secrets.redis_password}@{self.redis_address}/0"

    def save(self) -> None:
        path = Path(self.directory) / STATE_FILE
        write_private(path, json.dumps(asdict(self), indent=2) + "\n")


def forget_state(directory: Path) -> None:
    """Remove ``cluster.json`` from ``directory`` (a start that failed: its processes
    are stopped, and no later ``status``, ``demo`` or ``down`` may find them)."""
    (directory / STATE_FILE).unlink(missing_ok=True)


def read_state(directory: Path) -> ClusterState:
    """The state of the cluster in ``directory``; a ClusterError when there is none."""
    path = directory / STATE_FILE
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ClusterError(f"no cluster in {directory} (no {STATE_FILE})") from None
    except (OSError, ValueError) as exc:
        raise ClusterError(f"cannot read {path}: {exc}") from None
    if data.get("schema") != SCHEMA:
        raise ClusterError(f"{path} is not a {SCHEMA} file")

    try:
        return _parse(data)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ClusterError(f"{path} is damaged ({type(exc).__name__}: {exc})") from None


def _parse(data: dict[str, Any]) -> ClusterState:
    def process(value: dict[str, Any] | None) -> ProcessInfo | None:
        return ProcessInfo(**value) if value is not None else None

    nodes = []
    for node in data.pop("nodes"):
        sidecar = ProcessInfo(**node.pop("sidecar"))
        engine = process(node.pop("engine"))
        nodes.append(NodeInfo(**node, sidecar=sidecar, engine=engine))
    redis, s3 = process(data.pop("redis")), process(data.pop("s3"))
    router = process(data.pop("router", None))
    return ClusterState(**data, redis=redis, s3=s3, nodes=nodes, router=router)
