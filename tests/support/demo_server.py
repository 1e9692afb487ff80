"""A `lmtier demo serve` process for the end-to-end tests (the engine of
test_demo_serve.py and the target of `lmtier warm --via` in test_warm.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

CHUNK = 256
READY = "lmtier demo serve: listening on "
HANG_S = 600
"""How long one demo process (a `lmtier demo` run, an HTTP request, a shutdown) may
take before a test calls it hung. A hang guard, never a speed check: such a run takes
seconds on an idle machine, and minutes at a load of 12 on 2 cores."""
# Several chunks of 256 tokens: the demo tokenizer gives one token per byte, plus <s>.
LONG_TEXT = " ".join(f"Paragraph {i}: the cache serves what it stored before." for i in range(24))
MAX_LOGIT_DIFF = 1e-5
"""The cached prefill attends to the same K/V as a full one, but runs its matmuls over
the suffix only: a different shape, which BLAS may sum in a different order, so the
logits can differ in the last bits (~1e-6 here), as in `lmtier demo`."""

# The proxy from the environment must never see requests to the loopback server.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ReadyProcess:
    """A `lmtier` command that prints ``ready`` and its URL on stdout once it serves,
    in its own session (so that no process it might leave behind can hide), its
    stderr in ``log``."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path, ready: str) -> None:
        self.log = log
        with self.log.open("w") as stream:
            self.process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=stream,
                text=True,
                env=env,
                start_new_session=True,
            )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # blocks until ready, or EOF if it died
        if not line.startswith(ready):
            self.process.kill()
            self.process.wait()
            pytest.fail(f"no ready line ({line!r}); log:\n{self.log.read_text()[-6000:]}")
        self.url = line[len(ready) :].strip()

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        """Send ``sig``; the exit status, once no process of the session is left."""
        self.process.send_signal(sig)
        code = self.process.wait(timeout=HANG_S)
        assert self.process.stdout is not None
        self.process.stdout.close()
        with pytest.raises(ProcessLookupError):
            os.killpg(self.process.pid, 0)  # nothing left in the process's session
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


class Server(ReadyProcess):
    """A `lmtier demo serve --port 0` process with its disk tier under ``cache_dir``."""

    def __init__(
        self, tmp_path: Path, cache_dir: Path, *args: str, env: dict[str, str] | None = None
    ) -> None:
        environ = {
            **os.environ,
            "LMTIER_CHUNK_SIZE": str(CHUNK),
            "XDG_CACHE_HOME": str(tmp_path / "xdg"),
            **(env or {}),
        }
        command = [sys.executable, "-m", "lmtier.cli", "demo", "serve", "--port", "0"]
        command += ["--cache-dir", str(cache_dir), "--cpu-capacity", "256MiB", *args]
        log = tmp_path / f"server-{os.urandom(4).hex()}.log"
        super().__init__(command, environ, log, READY)

    def request(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with OPENER.open(request, timeout=HANG_S) as response:
                return int(response.status), bytes(response.read())
        except urllib.error.HTTPError as error:
            with error:  # its socket, closed now rather than by the garbage collector
                return error.code, error.read()

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        status, raw = self.request(path, body)
        assert status == 200, raw.decode()
        parsed: dict[str, Any] = json.loads(raw)
        return parsed

    def stream(self, path: str, body: dict[str, Any]) -> list[str]:
        """The SSE events' data fields, in order."""
        status, raw = self.request(path, {**body, "stream": True})
        assert status == 200, raw.decode()
        text = raw.decode()
        assert text.endswith("\n\n")
        events = text[:-2].split("\n\n")
        assert all(event.startswith("data: ") for event in events), text
        return [event.removeprefix("data: ") for event in events]
