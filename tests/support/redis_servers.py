"""Real ``redis-server`` processes for integration tests: a standalone server that can
be killed, stopped (SIGSTOP, a hang) and restarted on its port, and a 3-master Redis
Cluster. No fakes: these run the Redis that CI installs.

A missing ``redis-server`` FAILS the test that needs it, with a message: a silent skip
would hide that CI lost its Redis. The classes are context managers; the
module-scoped :func:`redis_server` fixture is one standalone server per test module
(import it: ``from redis_servers import redis_server``), and a module that needs
another kind (a unix socket, TLS, a fresh server per test) makes its own from them.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

__all__ = [
    "RedisClusterProcesses",
    "RedisServer",
    "free_port",
    "make_certificate",
    "redis_server",
    "require_redis",
]

HOST = "127.0.0.1"
START_TIMEOUT_S = 60.0
CLUSTER_BUS_OFFSET = 10000  # Redis Cluster's bus listens on port + 10000


def require_redis() -> tuple[str, str]:
    """Paths of ``redis-server`` and ``redis-cli``; fails the test when either is missing."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        pytest.fail(
            "redis-server and redis-cli must be on PATH for the Redis integration tests "
            "(apt-get install redis-server; .ci/run installs it)",
            pytrace=False,
        )
    return server, cli


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(*, cluster_bus: bool = False) -> int:
    """A free loopback port (and its cluster bus port, when asked)."""
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            port: int = sock.getsockname()[1]
        if not cluster_bus:
            return port
        if port + CLUSTER_BUS_OFFSET < 65536 and _port_is_free(port + CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair found for a cluster node")


class RedisServer:
    """One ``redis-server`` on a loopback port, without persistence, in ``directory``."""

    def __init__(
        self,
        directory: Path,
        *extra_args: str,
        port: int | None = None,
        password: str | None = None,
        unix_socket: bool = False,
        tls: bool = False,
    ) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port if port is not None else free_port()
        self.password = password
        self.unix_socket = str(directory / "redis.sock") if unix_socket else None
        self.cert = make_certificate(directory) if tls else None
        """A self-signed certificate for 127.0.0.1 (TLS only: the port speaks nothing else)."""
        self.extra_args = extra_args
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.cert is not None:
            return f"rediss://{auth}{HOST}:{self.port}/0?ssl_ca_certs={self.cert}"
        return f"redis://{auth}{HOST}:{self.port}/0"

    @property
    def unix_url(self) -> str:
        if self.unix_socket is None:
            raise ValueError("this server has no unix socket")
        return f"unix://{self.unix_socket}"

    def start(self) -> RedisServer:
        server, _ = require_redis()
        args = [server, "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly"]
        args += ["no", "--dir", str(self.directory), "--logfile", str(self.log_path)]
        if self.cert is not None:
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no"]
            args += ["--tls-cert-file", self.cert, "--tls-key-file", self.cert]
        if self.password:
            args += ["--requirepass", self.password]
        if self.unix_socket:
            args += ["--unixsocket", self.unix_socket, "--unixsocketperm", "700"]
        args += list(self.extra_args)
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_ready()
        return self

    @property
    def log_path(self) -> Path:
        return self.directory / "redis.log"

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited at start:\n{self._log_tail()}")
            if self.ping():
                return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server not answering after {START_TIMEOUT_S} s")

    def _log_tail(self) -> str:
        log = self.log_path.read_text() if self.log_path.exists() else ""
        err = self.process.stderr.read().decode() if self.process and self.process.stderr else ""
        return (log + err)[-2000:]

    def ping(self) -> bool:
        """Whether the server answers (a NOAUTH error counts: it is up)."""
        try:
            with contextlib.ExitStack() as stack:
                sock = stack.enter_context(socket.create_connection((HOST, self.port), 0.5))
                if self.cert is not None:
                    context = ssl.create_default_context(cafile=self.cert)
                    sock = stack.enter_context(context.wrap_socket(sock, server_hostname=HOST))
                sock.sendall(b"PING\r\n")
                return sock.recv(64)[:1] in (b"+", b"-")
        except OSError:
            return False

    def client(self) -> redis.Redis:
        """A plain synchronous redis-py client, for inspecting what the tier wrote."""
        return redis.Redis.from_url(self.url, protocol=2)

    def kill(self) -> None:
        """SIGKILL: the server vanishes without closing anything gracefully."""
        self._signal_and_wait(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing answers (a hang)."""
        if self.process is not None:
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Stop (if running) and start again on the same port, empty."""
        self.stop()
        self.start()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; resumes a stopped server first."""
        if self.process is None or self.process.poll() is not None:
            self.process = None
            return
        self.resume()
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._signal_and_wait(signal.SIGKILL)
        self._close_pipes()

    def _signal_and_wait(self, sig: signal.Signals) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(sig)
        self.process.wait(timeout=10)
        self._close_pipes()

    def _close_pipes(self) -> None:
        if self.process is not None and self.process.stderr is not None:
            self.process.stderr.close()
        self.process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def make_certificate(directory: Path) -> str:
    """A self-signed certificate and its key for 127.0.0.1, in one PEM file (openssl CLI)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the TLS tests need the openssl command to make a certificate")
    path = directory / "tls.pem"
    key = directory / "tls.key"
    subprocess.run(
        [
            *(openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"),
            *("-subj", f"/CN={HOST}", "-addext", f"subjectAltName=IP:{HOST}"),
            *("-keyout", str(key), "-out", str(path)),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    path.write_bytes(path.read_bytes() + key.read_bytes())
    return str(path)


class RedisClusterProcesses:
    """Three masters, no replicas, slots split by ``redis-cli --cluster create``."""

    def __init__(self, directory: Path, num_masters: int = 3) -> None:
        self.servers = [
            RedisServer(
                directory / f"node{i}",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(directory / f"node{i}" / "nodes.conf"),
                "--cluster-node-timeout",
                "5000",
                port=free_port(cluster_bus=True),
            )
            for i in range(num_masters)
        ]

    @property
    def url(self) -> str:
        """A plain redis:// URL of the first master: the tier detects the cluster."""
        return self.servers[0].url

    def start(self) -> RedisClusterProcesses:
        _, cli = require_redis()
        try:
            for server in self.servers:
                server.start()
            addresses = [f"{HOST}:{server.port}" for server in self.servers]
            subprocess.run(
                [
                    cli,
                    "--cluster",
                    "create",
                    *addresses,
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
            self._wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all(self._node_ok(server) for server in self.servers):
                return
            time.sleep(0.05)
        raise RuntimeError("the Redis Cluster did not reach cluster_state:ok in 30 s")

    def _node_ok(self, server: RedisServer) -> bool:
        with server.client() as client:
            info = client.cluster("info")
        return (
            info.get("cluster_state") == "ok"
            and int(info.get("cluster_slots_ok", 0)) == 16384
            and int(info.get("cluster_known_nodes", 0)) == len(self.servers)
        )

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> RedisClusterProcesses:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One standalone server shared by a test module's tests."""
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server
