"""``lmtier cluster up``: docker-compose.yml's topology as local processes.

One ``redis-server`` (a generated password, a free loopback port), one S3 endpoint
(``minio server`` when a ``minio`` binary is on PATH, else moto's server, with the
bucket created), and N nodes, each a sidecar (``lmtier serve`` on
``unix://<dir>/node-<i>/sidecar.sock``) and a demo engine (``lmtier demo serve``
over that sidecar). The processes read the same config files as docker-compose.yml
(:data:`CONFIG_FILES`); what differs between the two (addresses, paths, secrets)
reaches them as ``LMTIER_*`` and ``AWS_*`` variables, as the files' comments say
(:mod:`.commands`).

Everything lives in one directory: ``cluster.json`` (pids, addresses), the
secrets (:mod:`.state`), ``trust/`` (the peers' node secret, the integrity key and
the peer TLS certificates, made at the first start and kept: :mod:`.trust`),
``logs/`` (one file per process), Redis's and MinIO's data, each node's socket and
disk tier. Each process runs in its own session; readiness is
waited for by probing (:mod:`.health`), never by sleeping; :meth:`LocalCluster.down`
stops the processes by their recorded pids (:mod:`.processes`) and removes nothing
unless asked (``clean``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from lmtier.errors import ConfigError
from lmtier.extras import require
from lmtier_apps.cluster import commands, health
from lmtier_apps.cluster.processes import is_running, spawn, stop_processes
from lmtier_apps.cluster.state import (
    TOKEN_FILE,
    ClusterError,
    ClusterSecrets,
    ClusterState,
    NodeInfo,
    ProcessInfo,
    forget_state,
    read_state,
)
from lmtier_apps.cluster.trust import TrustFiles, ensure_trust

__all__ = ["CLUSTER_EXTRAS", "CONFIG_FILES", "LocalCluster", "default_directory", "find_deploy_dir"]

CONFIG_FILES = {
    "sidecar": Path("deploy/cluster/sidecar.yaml"),
    "engine": Path("deploy/cluster/engine.yaml"),
}
"""The config files of a node's sidecar and engine, relative to the repository root:
the ones docker-compose.yml mounts (a test compares the two)."""
CLUSTER_EXTRAS = ("grpc", "serve", "hf", "redis", "s3", "route", "cluster")
"""What the processes import: the sidecars (grpc; their Redis and S3 tiers), the
engines (serve, hf) and the launcher's probes (redis, s3)."""
START_TIMEOUT_S = 60.0
"""Redis, S3 and the sidecars; an engine gets three times this (torch and the model)."""
STOP_TIMEOUT_S = {"engine": 30.0, "sidecar": 40.0, "shared": 15.0}
"""SIGTERM to SIGKILL, per stage: a sidecar drains within ``drain_timeout_s`` (20 s)."""
_UNIX_PATH_MAX = 107  # sun_path holds 108 bytes with its NUL
TRUST_DIR = "trust"
"""Where the peers' node secret, integrity key and TLS files live (:mod:`.trust`)."""


def default_directory() -> Path:
    """Where a cluster lives without ``--dir``: ``$XDG_CACHE_HOME/lmtier/cluster``."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(cache) if cache and Path(cache).is_absolute() else Path.home() / ".cache"
    return base / "lmtier" / "cluster"


def find_deploy_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The repository root holding :data:`CONFIG_FILES`: ``explicit`` (``--deploy-dir``),
    else the checkout this package runs from. A ConfigError when the files are not there."""
    candidate = (
        Path(explicit).expanduser().resolve()
        if explicit is not None
        else Path(__file__).resolve().parents[3]  # <root>/apps/lmtier_apps/cluster/
    )
    missing = [str(path) for path in CONFIG_FILES.values() if not (candidate / path).is_file()]
    if missing:
        hint = "" if explicit is not None else " (lmtier is not run from a checkout)"
        raise ConfigError(
            f"the cluster's config files {', '.join(missing)} are not under {candidate}"
            f"{hint}: pass --deploy-dir, the lmtier checkout with deploy/cluster/"
        )
    return candidate


class LocalCluster:
    """The cluster of the module docstring, in ``directory``. ``engine_args`` are more
    ``lmtier demo serve`` options (``--check-logits``); ``sidecar_env`` more variables
    for every sidecar (``LMTIER_CPU__CAPACITY_BYTES`` for a smaller pool)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        nodes: int = 2,
        deploy_dir: str | os.PathLike[str] | None = None,
        engine_args: Sequence[str] = (),
        sidecar_env: Mapping[str, str] | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        if nodes < 1:
            raise ConfigError(f"a cluster needs at least one node, got {nodes}")
        self.directory = Path(directory).expanduser().resolve()
        self.num_nodes = nodes
        self._deploy_dir = deploy_dir
        self.engine_args = list(engine_args)
        self.sidecar_env = dict(sidecar_env or {})
        self.start_timeout_s = start_timeout_s
        self._state: ClusterState | None = None
        self._secrets: ClusterSecrets | None = None
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    @classmethod
    def attach(cls, directory: str | os.PathLike[str]) -> LocalCluster:
        """The cluster an earlier ``start`` (maybe another process's) left in ``directory``."""
        cluster = cls(directory)
        cluster._state = read_state(cluster.directory)
        cluster.num_nodes = len(cluster._state.nodes)
        return cluster

    @property
    def state(self) -> ClusterState:
        """What runs where (``cluster.json``); a ClusterError before :meth:`start`."""
        if self._state is None:
            raise ClusterError(f"the cluster in {self.directory} was not started")
        return self._state

    @property
    def secrets(self) -> ClusterSecrets:
        """The cluster's credentials (``secrets.env``)."""
        if self._secrets is None:
            self._secrets = ClusterSecrets.load(self.directory)
        return self._secrets

    @property
    def redis_url(self) -> str:
        """Redis's URL, password included."""
        return self.state.redis_url(self.secrets)

    @property
    def trust(self) -> TrustFiles:
        """The peers' node secret, the integrity key and the peer TLS files (:mod:`.trust`)."""
        return TrustFiles.in_directory(self.directory / TRUST_DIR)

    @property
    def token_file(self) -> Path:
        """The file holding the sidecars' token (first line)."""
        return self.directory / TOKEN_FILE

    def running(self) -> list[ProcessInfo]:
        """The recorded processes that still run."""
        return [info for info in self.state.processes() if is_running(info, self._children)]

    def status(self) -> list[health.PartStatus]:
        """Each process: whether it runs, and whether it answers its probe."""
        return health.cluster_status(self.state, self.secrets, self._children)

    # --- start -----------------------------------------------------------------------

    def start(self) -> ClusterState:
        """Start every process and wait until each is ready; on any failure, stop what
        started, remove ``cluster.json`` (no later command may take the dead processes
        for a cluster) and raise ClusterError (naming the log to read). The extras the
        processes need are checked first, before anything is written."""
        require(*CLUSTER_EXTRAS, what="a local cluster")
        deploy_dir = find_deploy_dir(self._deploy_dir)
        self._refuse_running_cluster()
        settings = yaml.safe_load((deploy_dir / CONFIG_FILES["sidecar"]).read_text()) or {}
        # From here on a cluster.json in the directory is this start's, or a dead one's.
        try:
            self._prepare(deploy_dir, settings)
            self._start_redis()
            self._start_s3()
            self._start_sidecars(deploy_dir / CONFIG_FILES["sidecar"])
            self._start_engines(deploy_dir / CONFIG_FILES["engine"])
            self._start_router(deploy_dir / CONFIG_FILES["engine"])
        except BaseException:
            self.down()
            forget_state(self.directory)
            raise
        return self.state

    def _prepare(self, deploy_dir: Path, settings: dict[str, Any]) -> None:
        """The directory (owner-only), fresh secrets and the first ``cluster.json``."""
        try:
            for sub in ("logs", "redis", "s3"):
                (self.directory / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
            self.directory.chmod(0o700)  # secrets, sockets and KV inside
        except OSError as exc:
            raise ClusterError(f"cannot use {self.directory}: {exc.strerror}") from None
        self._secrets = ClusterSecrets.generate()
        self._secrets.save(self.directory)
        ensure_trust(self.directory / TRUST_DIR)  # kept from an earlier cluster here
        self._state = ClusterState(
            directory=str(self.directory),
            deploy_dir=str(deploy_dir),
            chunk_size=int(settings.get("chunk_size", 256)),
            bucket=str(settings.get("s3", {}).get("bucket", "lmtier")),
        )
        self._state.save()

    def _refuse_running_cluster(self) -> None:
        try:
            earlier = LocalCluster.attach(self.directory)
        except ClusterError:
            return  # none, or a damaged file of a dead one: start afresh
        if earlier.running():
            raise ClusterError(
                f"a cluster already runs in {self.directory}: "
                f"`lmtier cluster down --dir {self.directory}` first"
            )

    def _spawn(
        self, role: str, name: str, command: Sequence[str], env: Mapping[str, str]
    ) -> tuple[subprocess.Popen[bytes], ProcessInfo]:
        """Start one process, logging to ``logs/<name>.log``; it is reaped as it exits."""
        log = self.directory / "logs" / f"{name}.log"
        environ = commands.child_env(env)
        process, info = spawn(role, command, env=environ, log=log, cwd=self.directory)
        self._children[process.pid] = process
        return process, info

    def _wait(
        self,
        probe: health.Probe,
        what: str,
        process: subprocess.Popen[bytes],
        *,
        slow: bool = False,
    ) -> None:
        timeout_s = self.start_timeout_s * (3 if slow or "engine" in what else 1)
        log = next(info.log for info in self.state.processes() if info.pid == process.pid)
        health.wait_until(probe, what=what, timeout_s=timeout_s, exited=process.poll, log=log)

    def _start_redis(self) -> None:
        state, port = self.state, commands.free_port()
        command = commands.redis_command(
            self.directory / "redis", port, self.secrets.redis_password
        )
        process, state.redis = self._spawn("redis", "redis", command, {})
        state.redis_address = f"{commands.HOST}:{port}"
        state.save()
        self._wait(lambda: health.redis_problem(self.redis_url), "redis-server", process)

    def _start_s3(self) -> None:
        state, port, keys = self.state, commands.free_port(), self.secrets
        state.s3_kind, command = commands.s3_command(self.directory / "s3", port)
        env = {"MINIO_ROOT_USER": keys.s3_access_key, "MINIO_ROOT_PASSWORD": keys.s3_secret_key}
        process, state.s3 = self._spawn("s3", "s3", command, env)
        state.s3_endpoint = f"http://{commands.HOST}:{port}"
        state.save()
        client = health.s3_client(state.s3_endpoint, keys.s3_access_key, keys.s3_secret_key)

        def probe() -> str | None:
            return health.ensure_bucket(client, state.bucket)

        self._wait(probe, f"the S3 endpoint ({state.s3_kind})", process)

    def _start_sidecars(self, config_file: Path) -> None:
        state, started = self.state, []
        state.sidecar_env = dict(self.sidecar_env)
        for index in range(self.num_nodes):
            name = f"node-{index}"
            node_dir = self.directory / name
            node_dir.mkdir(mode=0o700, exist_ok=True)
            sock = node_dir / "sidecar.sock"
            if len(f"{sock}.lane".encode()) > _UNIX_PATH_MAX:
                raise ClusterError(f"{sock} is too long for a unix socket: use a shorter --dir")
            metrics = f"http://{commands.HOST}:{commands.free_port()}/metrics"
            planned = NodeInfo(
                name,
                ProcessInfo("sidecar", 0, None, ""),  # not started yet
                f"unix://{sock}",
                metrics,
                str(node_dir / "disk"),
                peer_address=f"{commands.HOST}:{commands.free_port()}",
            )
            process, info = self._spawn_sidecar(planned, config_file)
            node = replace(planned, sidecar=info)
            state.nodes.append(node)
            started.append((node, process))
            state.save()
        for node, process in started:
            self._wait(health.sidecar_probe(node), f"{node.name}'s sidecar", process)

    def _spawn_sidecar(
        self, node: NodeInfo, config_file: Path
    ) -> tuple[subprocess.Popen[bytes], ProcessInfo]:
        """Start ``node``'s sidecar on its recorded socket and ports."""
        state = self.state
        env = commands.sidecar_env(
            disk_path=Path(node.disk_path),
            redis_url=self.redis_url,
            s3_endpoint=state.s3_endpoint,
            keys=self.secrets,
            token_file=self.token_file,
            metrics_port=int(node.metrics_url.rsplit(":", 1)[1].split("/", 1)[0]),
            peer_port=int(node.peer_address.rsplit(":", 1)[1]),
            node_name=node.name,
        )
        env.update(self.trust.sidecar_env())
        env.update(state.sidecar_env)
        command = commands.sidecar_command(config_file, Path(node.socket.removeprefix("unix://")))
        return self._spawn("sidecar", f"{node.name}-sidecar", command, env)

    def restart_sidecar(self, index: int) -> None:
        """Stop node ``index``'s sidecar (SIGTERM: it drains and leaves the peer
        directory) and start it again on the same socket and ports: the node's CPU tier
        is empty afterwards, its disk tier kept; its engine reconnects by itself."""
        node = self.state.nodes[index]
        problems = stop_processes([([node.sidecar], STOP_TIMEOUT_S["sidecar"])], self._children)
        if problems:
            raise ClusterError("; ".join(problems))
        config_file = Path(self.state.deploy_dir) / CONFIG_FILES["sidecar"]
        process, info = self._spawn_sidecar(node, config_file)
        self.state.nodes[index] = node = replace(node, sidecar=info)
        self.state.save()
        self._wait(health.sidecar_probe(node), f"{node.name}'s sidecar", process)

    def _start_engines(self, config_file: Path) -> None:
        state, started = self.state, []
        for index, node in enumerate(state.nodes):
            log = self.directory / "logs" / f"{node.name}-engine.log"
            offset = log.stat().st_size if log.exists() else 0
            command = commands.engine_command(config_file, node.socket, self.token_file)
            command += self.engine_args
            process, info = self._spawn("engine", f"{node.name}-engine", command, {})
            state.nodes[index] = replace(node, engine=info)
            started.append((index, process, log, offset))
            state.save()
        for index, process, log, offset in started:
            found: list[str] = []

            def probe(
                log: Path = log, offset: int = offset, found: list[str] = found
            ) -> str | None:
                url = commands.ready_url(log, offset)
                if url is None:
                    return "no ready line yet"
                found.append(url)
                return None

            self._wait(probe, f"{state.nodes[index].name}'s engine", process)
            state.nodes[index] = replace(state.nodes[index], engine_url=found[0])
            state.save()

    def _start_router(self, config_file: Path) -> None:
        """``lmtier route`` in front of the engines, the fleet index in the cluster's
        Redis (which every sidecar keeps: ``fleet`` in sidecar.yaml)."""
        state = self.state
        engines = {node.name: node.engine_url for node in state.nodes if node.engine_url}
        log = self.directory / "logs" / "router.log"
        offset = log.stat().st_size if log.exists() else 0
        command = commands.router_command(config_file, engines)
        env = {"LMTIER_FLEET__INDEX_URL": self.redis_url}
        process, info = self._spawn("router", "router", command, env)
        state.router = info
        state.save()
        found: list[str] = []

        def probe() -> str | None:
            url = commands.ready_url(log, offset, commands.ROUTER_READY)
            if url is None:
                return "no ready line yet"
            found.append(url)
            return None

        self._wait(probe, "the router", process, slow=True)  # torch, the demo model
        state.router_url = found[0]
        state.save()

    # --- stop --------------------------------------------------------------------------

    def down(self, *, clean: bool = False) -> list[str]:
        """Stop every process (module docstring); the problems, one line each. With
        ``clean`` and no problem, the cluster's directory is removed too."""
        if self._state is None:
            return []
        state = self._state
        clients = [n.engine for n in state.nodes if n.engine is not None]
        clients += [state.router] if state.router is not None else []
        stages = [
            (clients, STOP_TIMEOUT_S["engine"]),
            ([n.sidecar for n in state.nodes], STOP_TIMEOUT_S["sidecar"]),
            ([p for p in (state.s3, state.redis) if p is not None], STOP_TIMEOUT_S["shared"]),
        ]
        problems = stop_processes(stages, self._children)
        for child in self._children.values():  # reap every child, restarted ones' too
            child.poll()
        self._remove_pool_files(state)
        if clean and not problems:
            shutil.rmtree(self.directory, ignore_errors=True)
        return problems

    def _remove_pool_files(self, state: ClusterState) -> None:
        """The shared-memory pool file of a sidecar that was killed (SIGKILL leaves it; a
        drained sidecar removes its own), named by its pid, so no other file is touched."""
        shm_dir = Path(self.sidecar_env.get("LMTIER_SIDECAR__SHM_DIR", "/dev/shm"))  # noqa: S108
        for node in state.nodes:
            if not is_running(node.sidecar, self._children):
                for path in shm_dir.glob(f"lmtier-{node.sidecar.pid}-*.pool"):
                    path.unlink(missing_ok=True)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        problems = self.down()
        if problems and exc is None:
            raise ClusterError("; ".join(problems))
