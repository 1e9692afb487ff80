"""The command line and environment of each process of a local cluster.

The sidecar and the engine run the ``lmtier`` CLI of this interpreter with the
committed config files (``--config``); the per-cluster parts go in ``LMTIER_*`` and
``AWS_*`` variables, exactly the ones ``deploy/cluster/sidecar.yaml``'s comments list
and docker-compose.yml sets. Redis gets its password from a 0600 config file, never
the command line (which every user of the machine can read in ``ps``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from lmtier_apps.cluster.state import ClusterError, ClusterSecrets, write_private

__all__ = [
    "ENGINE_READY",
    "HOST",
    "LMTIER",
    "child_env",
    "engine_command",
    "free_port",
    "ready_url",
    "redis_command",
    "router_command",
    "s3_command",
    "sidecar_command",
    "sidecar_env",
]

HOST = "127.0.0.1"
LMTIER = (sys.executable, "-m", "lmtier.cli")
"""The ``lmtier`` command, run by this interpreter (so a virtualenv is kept)."""
ENGINE_READY = "lmtier demo serve: listening on "
"""The start of ``lmtier demo serve``'s ready line (``serve.READY``; a test checks)."""
ROUTER_READY = "lmtier route: listening on "
"""The start of ``lmtier route``'s ready line (``route.run.READY``)."""


def free_port() -> int:
    """A loopback port nobody listens on now (the kernel's pick)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without ``LMTIER_*`` and ``AWS_*`` (the cluster is
    configured by its files and the launcher only), loopback kept off any proxy from
    the environment, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMTIER_", "AWS_"))}
    for name in ("NO_PROXY", "no_proxy"):
        env[name] = ",".join(filter(None, (env.get(name), HOST, "localhost")))
    return {**env, **extra}


def redis_command(directory: Path, port: int, password: str) -> list[str]:
    """``redis-server`` on ``HOST:port`` without persistence, its data and config
    (with the password) in ``directory``."""
    server = shutil.which("redis-server")
    if server is None:
        raise ClusterError("redis-server is not on PATH (apt-get install redis-server)")
    conf = directory / "redis.conf"
    lines = [f"port {port}", f"bind {HOST}", 'save ""', "appendonly no", f'dir "{directory}"']
    write_private(conf, "\n".join([*lines, f"requirepass {password}"]) + "\n")
    return [server, str(conf)]


def s3_command(directory: Path, port: int) -> tuple[str, list[str]]:
    """The S3 endpoint's kind and command: ``minio server`` (data in ``directory``)
    when a ``minio`` binary is on PATH, else moto's server (in memory)."""
    address = f"{HOST}:{port}"
    minio = shutil.which("minio")
    if minio is not None:
        console = f"{HOST}:{free_port()}"
        command = [minio, "server", str(directory), "--address", address]
        return "minio", [*command, "--console-address", console, "--quiet"]
    if importlib.util.find_spec("moto") is not None:
        return "moto", [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)]
    moto = shutil.which("moto_server")
    if moto is not None:
        return "moto", [moto, "-H", HOST, "-p", str(port)]
    raise ClusterError(
        "no S3 endpoint to run: put a `minio` binary on PATH or pip install 'moto[server]'"
    )


def sidecar_command(config_file: Path, socket_path: Path) -> list[str]:
    """``lmtier --config <sidecar.yaml> serve --listen unix://<socket>``."""
    return [*LMTIER, "--config", str(config_file), "serve", "--listen", f"unix://{socket_path}"]


def sidecar_env(
    *,
    disk_path: Path,
    redis_url: str,
    s3_endpoint: str,
    keys: ClusterSecrets,
    token_file: Path,
    metrics_port: int,
    peer_port: int,
    node_name: str,
) -> dict[str, str]:
    """The variables ``deploy/cluster/sidecar.yaml`` expects for one node."""
    return {
        "LMTIER_PEER__LISTEN": f"{HOST}:{peer_port}",
        "LMTIER_PEER__NODE_ID": node_name,
        "LMTIER_FLEET__NODE_ID": node_name,
        "LMTIER_DISK__PATH": str(disk_path),
        "LMTIER_REDIS__URL": redis_url,
        "LMTIER_S3__ENDPOINT_URL": s3_endpoint,
        "AWS_ACCESS_KEY_ID": keys.s3_access_key,
        "AWS_SECRET_ACCESS_KEY": keys.s3_secret_key,
        "LMTIER_SIDECAR__AUTH_TOKEN_FILE": str(token_file),
        "LMTIER_SIDECAR__METRICS_LISTEN": f"{HOST}:{metrics_port}",
    }


def engine_command(config_file: Path, sidecar: str, token_file: Path) -> list[str]:
    """``lmtier demo serve`` on a free port over the node's sidecar, without a device
    tier of its own (the story is the sidecar's tiers)."""
    return [
        *LMTIER,
        *("--config", str(config_file), "demo", "serve", "--port", "0"),
        *("--sidecar", sidecar, "--sidecar-token-file", str(token_file), "--device-blocks", "0"),
    ]


def router_command(config_file: Path, engines: Mapping[str, str]) -> list[str]:
    """``lmtier route`` on a free loopback port in front of ``engines`` (node name ->
    URL), keyed as the engines key (their config; the demo model); the index's Redis
    comes from the environment (its password never on a command line)."""
    command = [*LMTIER, "--config", str(config_file), "route", "--port", "0"]
    command += ["--health-interval", "1"]
    for name, url in engines.items():
        command += ["--engine", f"{name}={url}"]
    return command


def ready_url(log: Path, offset: int, ready: str = ENGINE_READY) -> str | None:
    """The URL of the ready line ``ready`` (an engine's, the router's) in ``log``
    (read from ``offset``: a log of an earlier cluster in the same directory holds
    older lines), or None yet."""
    with log.open("rb") as stream:
        stream.seek(offset)
        for line in stream.read().decode(errors="replace").splitlines():
            if line.startswith(ready):
                return line[len(ready) :].strip()
    return None
