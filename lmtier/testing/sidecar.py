"""A real ``lmtier serve`` process for tests and benchmarks: started with its own
config on a unix socket in a private directory, waited for until its health service
answers SERVING, stopped by its pid.

    with SidecarProcess(tmp_path, {"cpu": {"capacity_bytes": "64MiB"}}) as sidecar:
        cache = lmtier.connect(sidecar.target, kv=spec, model_id="m")

Nothing is faked: the process is the CLI a user runs (``python -m lmtier.cli``), so a
test that kills it with SIGKILL kills a real sidecar.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

__all__ = ["SidecarProcess"]

START_TIMEOUT_S = 60.0


class SidecarProcess:
    """One sidecar process (module docstring). ``settings`` is the config as a dict
    (the ``sidecar.listen`` key is set here); ``env`` adds environment variables;
    ``args`` are more ``lmtier serve`` options (e.g. ``["--log-level", "DEBUG"]``)."""

    def __init__(
        self,
        directory: Path,
        settings: dict[str, Any] | None = None,
        *,
        listen: str | None = None,
        env: dict[str, str] | None = None,
        name: str = "sidecar",
        args: Sequence[str] = (),
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        settings = dict(settings or {})
        settings.setdefault("disk", {"enabled": False})
        self.socket = self.directory / "run" / f"{name}.sock"
        self.target = listen or f"unix://{self.socket}"
        self.config_path = self.directory / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(settings))
        self.log_path = self.directory / f"{name}.log"
        self._env = {**os.environ, **(env or {})}
        self._args = list(args)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def start(self) -> SidecarProcess:
        """Start the process and wait until it serves (RuntimeError with its log if it
        exits or does not serve within a minute)."""
        command = [
            sys.executable,
            "-m",
            "lmtier.cli",
            "--config",
            str(self.config_path),
            "serve",
            "--listen",
            self.target,
            *self._args,
        ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(  # noqa: S603 - our own CLI
                command, stdout=log, stderr=subprocess.STDOUT, env=self._env
            )
        self.wait_serving()
        return self

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Block until the health service says SERVING."""
        from lmtier.remote.probe import serving_problem  # noqa: PLC0415 - grpc extra

        deadline = time.monotonic() + timeout_s
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"the sidecar exited ({self.process.returncode}):\n{self.log()}")
            if serving_problem(self.target, 1.0) is None:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sidecar did not serve in {timeout_s} s:\n{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        """What the process has written so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the process."""
        os.kill(self.pid, sig)

    def wait(self, timeout_s: float = 60.0) -> int:
        """Its exit code, once it has exited."""
        assert self.process is not None
        return self.process.wait(timeout_s)

    def stop(self) -> int | None:
        """SIGTERM (drain), then SIGKILL if it lingers; the exit code. Idempotent."""
        process = self.process
        if process is None or process.poll() is not None:
            return None if process is None else process.returncode
        process.terminate()
        try:
            return process.wait(60.0)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()

    def __enter__(self) -> SidecarProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
