"""Is each part of the cluster up? One probe per kind of process, and a wait.

Every probe returns a one-line problem, or None when the part answers as it should:
Redis a PING (with the password), the S3 endpoint a HEAD of the bucket, a sidecar
gRPC's health service (SERVING) and its ``/metrics``, an engine ``GET /health``.
:func:`wait_until` polls one with a deadline, giving up early when the process
exits; start-up and ``lmtier cluster status`` share them. Clients (redis-py, boto3,
grpc) are imported inside the probes: they are the extras of the tiers they check.

HTTP goes through an opener without proxies: every address here is the cluster's
own, and a proxy from the environment must not see (or break) those requests.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmtier.extras import install_command
from lmtier_apps.cluster.processes import Children, is_running
from lmtier_apps.cluster.state import (
    ClusterError,
    ClusterSecrets,
    ClusterState,
    NodeInfo,
    ProcessInfo,
)

__all__ = [
    "LOCAL_OPENER",
    "PartStatus",
    "Probe",
    "cluster_status",
    "engine_probe",
    "sidecar_probe",
    "ensure_bucket",
    "http_problem",
    "redis_problem",
    "s3_client",
    "s3_problem",
    "sidecar_problem",
    "wait_until",
]

LOCAL_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
PROBE_TIMEOUT_S = 2.0
_POLL_S = 0.1

Probe = Callable[[], "str | None"]
"""A check of one part: a one-line problem, or None when it answers as it should."""


def wait_until(
    probe: Callable[[], str | None],
    *,
    what: str,
    timeout_s: float,
    exited: Callable[[], int | None] = lambda: None,
    log: str = "",
) -> None:
    """Poll ``probe`` until it reports no problem; a ClusterError naming ``what``, the
    last problem and ``log`` when ``timeout_s`` passes or ``exited()`` returns an exit
    status (the process died: waiting longer is pointless)."""
    deadline = time.monotonic() + timeout_s
    while True:
        problem = probe()
        if problem is None:
            return
        code = exited()
        if code is not None:
            raise ClusterError(f"{what} exited with status {code} at start; see {log}")
        if time.monotonic() >= deadline:
            raise ClusterError(f"{what} not ready after {timeout_s:.0f} s ({problem}); see {log}")
        time.sleep(_POLL_S)


def http_problem(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when ``GET url`` answers 200."""
    try:
        with LOCAL_OPENER.open(url, timeout=timeout_s) as response:
            status = int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()  # its socket, now rather than by the garbage collector
        return f"{url} answered HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"{url} does not answer ({reason})"
    return None if status == 200 else f"{url} answered HTTP {status}"


def redis_problem(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when the Redis at ``url`` (password included) answers PING."""
    import redis  # noqa: PLC0415 - the redis extra

    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        client.ping()
    except redis.RedisError as exc:
        return f"redis: {type(exc).__name__}: {exc}"
    finally:
        client.close()
    return None


def s3_client(endpoint: str, access_key: str, secret_key: str) -> Any:
    """A boto3 S3 client of ``endpoint`` with short timeouts and no retries (a probe
    that fails is asked again by its caller, not by botocore for a minute)."""
    try:
        import boto3  # noqa: PLC0415 - the s3 extra
        from botocore.config import Config  # noqa: PLC0415
    except ImportError as exc:
        hint = install_command("s3")
        raise ClusterError(f"the cluster's S3 endpoint needs boto3: {hint}") from exc
    config = Config(
        connect_timeout=PROBE_TIMEOUT_S,
        read_timeout=PROBE_TIMEOUT_S,
        retries={"max_attempts": 1},
        proxies={},
    )
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name="us-east-1",
        config=config,
    )


def s3_problem(client: Any, bucket: str) -> str | None:
    """None when ``bucket`` exists on the client's endpoint (a HEAD)."""
    from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415

    try:
        client.head_bucket(Bucket=bucket)
    except ClientError as exc:
        return f"s3: bucket {bucket}: {exc.response.get('Error', {}).get('Code', exc)}"
    except BotoCoreError as exc:
        return f"s3: {exc}"
    return None


def ensure_bucket(client: Any, bucket: str) -> str | None:
    """Create ``bucket`` unless it exists; then None once a HEAD finds it."""
    from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415

    try:
        client.create_bucket(Bucket=bucket)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            return f"s3: cannot create bucket {bucket}: {code or exc}"
    except BotoCoreError as exc:
        return f"s3: {exc}"
    return s3_problem(client, bucket)


def sidecar_problem(target: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when the sidecar at ``target`` says SERVING (grpc.health.v1)."""
    from lmtier.remote.connection import serving_problem  # noqa: PLC0415 - the grpc extra

    return serving_problem(target, timeout_s)


def sidecar_probe(node: NodeInfo) -> Probe:
    """A node's sidecar is ready when its health service says SERVING and its
    ``/metrics`` answers (the metrics server starts last)."""
    return lambda: sidecar_problem(node.socket) or http_problem(node.metrics_url)


def engine_probe(url: str) -> Probe:
    """An engine is healthy when ``GET /health`` answers; one never ready has no URL."""
    if not url:
        return lambda: "it never became ready"
    return lambda: http_problem(f"{url}/health")


@dataclass(frozen=True, slots=True)
class PartStatus:
    """One process of a cluster as ``status`` sees it: running, and its probe's problem."""

    name: str
    pid: int
    running: bool
    address: str
    problem: str | None

    @property
    def healthy(self) -> bool:
        return self.running and self.problem is None


def cluster_status(
    state: ClusterState, keys: ClusterSecrets, children: Children | None = None
) -> list[PartStatus]:
    """Each process of ``state``: whether it runs, and whether it answers its probe
    (a process that does not run is not probed)."""

    def s3() -> str | None:
        return s3_problem(
            s3_client(state.s3_endpoint, keys.s3_access_key, keys.s3_secret_key), state.bucket
        )

    def redis() -> str | None:
        return redis_problem(state.redis_url(keys))

    parts: list[tuple[ProcessInfo | None, str, str, Probe]] = [
        (state.redis, "redis", state.redis_address, redis),
        (state.s3, f"s3 ({state.s3_kind})", state.s3_endpoint, s3),
    ]
    for node in state.nodes:
        parts.append((node.sidecar, f"{node.name} sidecar", node.socket, sidecar_probe(node)))
        url = node.engine_url or ""
        parts.append((node.engine, f"{node.name} engine", url, engine_probe(url)))
    if state.router is not None:
        url = state.router_url or ""
        parts.append((state.router, "router", url, engine_probe(url)))
    out = []
    for info, name, address, probe in parts:
        running = info is not None and is_running(info, children)
        problem = probe() if running else "not running"
        out.append(PartStatus(name, info.pid if info else 0, running, address, problem))
    return out
