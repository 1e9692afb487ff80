"""A `lmtier route` process for the end-to-end tests, and an HTTP client of it that
reads the route header and streams."""

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

from support.demo_server import CHUNK, HANG_S, OPENER

READY = "lmtier route: listening on "


class RouterProcess:
    """``lmtier route --port 0`` in front of ``engines`` (name -> URL)."""

    def __init__(self, tmp_path: Path, engines: dict[str, str], *args: str) -> None:
        self.log = tmp_path / f"router-{os.urandom(4).hex()}.log"
        command = [sys.executable, "-m", "lmtier.cli", "route", "--port", "0"]
        command += ["--chunk-size", str(CHUNK), "--health-interval", "0.2", *args]
        for name, url in engines.items():
            command += ["--engine", f"{name}={url}"]
        env = {**os.environ, "LMTIER_CHUNK_SIZE": str(CHUNK)}
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                start_new_session=True,
            )  # fmt: skip
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.startswith(READY):
            self.process.kill()
            self.process.wait()
            pytest.fail(f"no ready line ({line!r}); router log:\n{self.log.read_text()[-6000:]}")
        self.url = line[len(READY) :].strip()

    def request(
        self,
        path: str,
        body: dict[str, Any] | bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with OPENER.open(request, timeout=HANG_S) as response:
                return int(response.status), dict(response.headers), bytes(response.read())
        except urllib.error.HTTPError as error:
            with error:
                return error.code, dict(error.headers), error.read()

    def complete(self, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the route header, the answer) of a completion that must succeed."""
        status, headers, raw = self.request("/v1/completions", body)
        assert status == 200, raw.decode()
        return json.loads(headers["x-lmtier-route"]), json.loads(raw)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=HANG_S)
        assert self.process.stdout is not None
        self.process.stdout.close()
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
