"""A `lmtier route` process for the end-to-end tests, and an HTTP client of it that
reads the route header and streams."""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from support.demo_server import CHUNK, HANG_S, OPENER, ReadyProcess

READY = "lmtier route: listening on "


class RouterProcess(ReadyProcess):
    """``lmtier route --port 0`` in front of ``engines`` (name -> URL)."""

    def __init__(self, tmp_path: Path, engines: dict[str, str], *args: str) -> None:
        command = [sys.executable, "-m", "lmtier.cli", "route", "--port", "0"]
        command += ["--chunk-size", str(CHUNK), "--health-interval", "0.2", *args]
        for name, url in engines.items():
            command += ["--engine", f"{name}={url}"]
        env = {**os.environ, "LMTIER_CHUNK_SIZE": str(CHUNK)}
        log = tmp_path / f"router-{os.urandom(4).hex()}.log"
        super().__init__(command, env, log, READY)

    def request(
        self,
        path: str,
        body: dict[str, Any] | bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        sent = {"Content-Type": "application/json", **(headers or {})}
        request = urllib.request.Request(self.url + path, data=data, headers=sent)
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
