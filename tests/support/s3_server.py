"""A real S3 endpoint for integration tests: moto in server mode on a loopback port.

Tests talk HTTP to a separate ``python -m moto.server`` process, exactly as the S3
tier talks to AWS or MinIO; nothing is mocked in-process. The server can be paused
(SIGSTOP: connections are accepted by the kernel but never answered, a hang) and
resumed, or killed and restarted on the same port. Moto keeps everything in memory,
so a restart loses every bucket and object: recreate what a test needs.

Import the fixtures into a test module::

    from support.s3_server import MotoServer, s3_credentials, s3_endpoint, s3_server  # noqa: F401
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

__all__ = [
    "DUMMY_CREDENTIALS",
    "MotoServer",
    "dummy_credentials",
    "free_port",
    "s3_credentials",
    "s3_endpoint",
    "s3_server",
]

DUMMY_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_CLEARED = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL")
_START_TIMEOUT_S = 120.0
_INSTALL_HINT = 'install it with: pip install "moto[server]"'


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class MotoServer:
    """One ``moto.server`` process on ``127.0.0.1:port``; :meth:`start` waits until it answers."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port if port is not None else free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - the server's output; close()
        self.paused = False

    def start(self) -> None:
        """Start the server and wait until it answers an S3 request (ListBuckets)."""
        if importlib.util.find_spec("flask") is None:
            pytest.fail(f"moto's server mode needs flask, which is missing; {_INSTALL_HINT}")
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self._process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                pytest.fail(
                    f"moto server exited with {self._process.returncode} at start; "
                    f"{_INSTALL_HINT}. Its output:\n{self._output()}"
                )
            if self._answers():
                return
            time.sleep(0.05)
        self.stop()
        pytest.fail(f"moto server on port {self.port} did not answer within {_START_TIMEOUT_S} s")

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/", timeout=1.0) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def pause(self) -> None:
        """SIGSTOP: the server hangs; the kernel still accepts connections."""
        self._signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        self._signal(signal.SIGCONT)
        self.paused = False

    def kill(self) -> None:
        """SIGKILL and reap: connections are refused until :meth:`start` (same port)."""
        if self._process is None:
            return
        self._process.kill()
        self._process.wait()
        self._process = None
        self.paused = False

    def restart(self) -> None:
        """Kill and start again on the same port: every bucket and object is gone."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Terminate (resuming first if paused: a stopped process ignores SIGTERM)."""
        if self._process is None:
            return
        if self.paused:
            self.resume()
        self._process.terminate()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    def close(self) -> None:
        self.stop()
        self._log.close()

    def _signal(self, signum: int) -> None:
        if self._process is None:
            raise RuntimeError("moto server is not running")
        os.kill(self._process.pid, signum)


@contextlib.contextmanager
def dummy_credentials() -> Iterator[None]:
    """Set DUMMY_CREDENTIALS (and clear tokens and profiles) for boto3; restore after."""
    names = (*DUMMY_CREDENTIALS, *_CLEARED)
    saved = {name: os.environ.get(name) for name in names}
    for name in _CLEARED:
        os.environ.pop(name, None)
    os.environ.update(DUMMY_CREDENTIALS)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def s3_credentials() -> Iterator[None]:
    """Dummy AWS credentials in the environment for the whole module."""
    with dummy_credentials():
        yield


@pytest.fixture(scope="module")
def s3_server(s3_credentials: None) -> Iterator[MotoServer]:
    """A moto S3 server for the module; ``.endpoint`` is its URL."""
    server = MotoServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def s3_endpoint(s3_server: MotoServer) -> str:
    """The module's moto server URL, for tests that only need an endpoint."""
    return s3_server.endpoint
