"""A gRPC client run as another local user (``nobody``), for the attacks that need one:
what any user of the machine can do to a sidecar that another user runs.

The tests run as root (else :func:`other_user` says why it cannot, and the test
skips). The other user cannot read root's Python installation (``/root`` is 0700), so
its client gets a folder of its own, readable by all, holding what it imports (grpc,
protobuf and lmtier's generated stubs, hard-linked or copied) and is run (through
``setpriv``) by an interpreter that user can execute: this one if it can, else the
system's Python of the same version. Nothing else of lmtier is there: the client
speaks the wire protocol, as any program would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import google.protobuf
import grpc
import typing_extensions

import lmtier.v1

__all__ = ["NOBODY", "OtherUser", "other_user"]

NOBODY = 65534
"""``nobody``'s uid and gid on Debian-like systems."""
RUN_TIMEOUT_S = 120.0
SETPRIV = shutil.which("setpriv") or "setpriv"

_CLIENT = """
import json, os, sys
import grpc
from lmtier.v1 import sidecar_pb2 as pb, sidecar_pb2_grpc as pb_grpc

ask = json.load(sys.stdin)
out = {"uid": os.getuid(), "code": None, "data": ""}
if "target" in ask:
    with grpc.insecure_channel(ask["target"]) as channel:
        stub = pb_grpc.SidecarStub(channel)
        space = pb.Namespace.FromString(bytes.fromhex(ask["namespace"]))
        call = stub.OpenSession(pb.OpenSessionRequest(namespace=space), timeout=30)
        try:
            info = next(call).opened
            request = pb.LoadRequest(session_id=info.session_id, keys=bytes.fromhex(ask["keys"]))
            out["data"] = b"".join(p.data for p in stub.LoadStream(request, timeout=30)).hex()
            out["code"] = "OK"
        except grpc.RpcError as exc:
            out["code"] = exc.code().name
        finally:
            call.cancel()
print(json.dumps(out))
"""


def _package_dir(module: Any) -> Path:
    return Path(module.__file__).parent


def _link_tree(source: Path, target: Path) -> None:
    """``source`` at ``target``, hard-linked where the file system allows (fast, and the
    files keep their 0644), else copied."""

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, target, copy_function=link)


class OtherUser:
    """The other user's client folder (module docstring); :meth:`close` removes it."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="lmtier-other-user-"))
        self.python = ""
        try:
            self.folder.chmod(0o755)
            _link_tree(_package_dir(grpc), self.folder / "grpc")
            _link_tree(_package_dir(google.protobuf), self.folder / "google" / "protobuf")
            upb = _package_dir(google.protobuf).parent / "_upb"
            if upb.is_dir():
                _link_tree(upb, self.folder / "google" / "_upb")
            _link_tree(_package_dir(lmtier.v1), self.folder / "lmtier" / "v1")
            (self.folder / "lmtier" / "__init__.py").write_text("")
            shutil.copy2(typing_extensions.__file__, self.folder)
            (self.folder / "client.py").write_text(_CLIENT)
            for path in [self.folder, *self.folder.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
        except BaseException:
            self.close()
            raise

    def run(self, ask: dict[str, Any], python: str | None = None) -> dict[str, Any]:
        """Run the client as ``nobody`` with ``ask`` (``target``, ``namespace`` and
        ``keys`` in hex: open a session without a token and stream those keys); what
        it reports: its ``uid``, the call's ``code`` and the ``data`` it read (hex)."""
        # setpriv changes the user, not subprocess's user=: with that, Python forks
        # (not vfork) a process that runs gRPC's threads, and the child crashed at times.
        command = [
            SETPRIV,
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            python or self.python,
            "-s",
            str(self.folder / "client.py"),
        ]
        done = subprocess.run(
            command,
            input=json.dumps(ask),
            capture_output=True,
            text=True,
            cwd=self.folder,
            env={"PATH": "/usr/bin:/bin"},
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"the other user's client failed ({done.returncode}): {done.stderr}")
        result: dict[str, Any] = json.loads(done.stdout)
        return result

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _interpreters() -> list[str]:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    found = [sys.executable, f"/usr/bin/python{version}", shutil.which(f"python{version}")]
    return [path for path in dict.fromkeys(found) if path]


def other_user() -> OtherUser | str:
    """A client folder for ``nobody`` and an interpreter it runs there; or why not."""
    if os.getuid() != 0:
        return "needs root, to run a client as another user"
    if shutil.which("setpriv") is None:
        return "needs setpriv (util-linux), to run a client as another user"
    user = OtherUser()
    for python in _interpreters():
        try:
            if user.run({}, python)["uid"] == NOBODY:
                user.python = python
                return user
        except (OSError, RuntimeError, ValueError):
            continue  # that user cannot run this interpreter, or its grpc
    user.close()
    return f"no Python that uid {NOBODY} can run with this grpc ({', '.join(_interpreters())})"
