"""Listen addresses, as both ends of the sidecar's wire read them.

:func:`parse_listen` reads ``sidecar.listen`` (a unix socket or ``host:port``) into a
:class:`ListenAddress`; :func:`default_listen` is the socket a server listens on and
a client dials when none is configured. The server (``lmtier serve``), its clients
(``lmtier.connect``, the ``--sidecar`` commands) and the peer tier all parse addresses
alike, so this lives below all of them; what keeps a listener private (the
remote-listener policy, the socket's permissions) is the server's own
(:mod:`lmtier.sidecar.listen`).
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lmtier.config.model import cache_home
from lmtier.errors import ConfigError, brief

__all__ = ["SOCKET_NAME", "ListenAddress", "default_listen", "parse_listen"]

SOCKET_NAME = "sidecar.sock"
# sun_path holds 108 bytes on Linux (104 on macOS), the final NUL included.
_MAX_SOCKET_PATH = 103 if sys.platform == "darwin" else 107
_HOSTNAME = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?$")
_NUMERIC_LABEL = re.compile(r"[0-9]+|0[xX][0-9a-fA-F]*")
_KEY = "sidecar.listen"


@dataclass(frozen=True, slots=True)
class ListenAddress:
    """A parsed listen address: a unix socket (``path``) or a TCP ``host`` and ``port``.

    ``host`` holds an IPv6 address without brackets; ``port`` 0 asks the system for a
    free port. For a unix socket ``host`` is ``""`` and ``port`` 0.
    """

    kind: Literal["unix", "tcp"]
    path: Path | None = None
    host: str = ""
    port: int = 0

    @property
    def grpc_target(self) -> str:
        """What grpc's ``add_*_port`` and a client channel take: ``unix:///abs/path``,
        ``host:port`` or ``[v6]:port``."""
        if self.kind == "unix":
            return f"unix://{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def loopback(self) -> bool:
        """Whether only this machine can reach the address, as far as can be told
        without DNS: a unix socket, ``localhost`` or a loopback IP address.
        (:func:`check_policy` also resolves other host names.)"""
        if self.kind == "unix":
            return True
        host = self.host.lower().rstrip(".")
        if host == "localhost" or host.endswith(".localhost"):
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    def __str__(self) -> str:
        return self.grpc_target


def parse_listen(text: str, *, key: str = _KEY) -> ListenAddress:
    """Parse ``unix:///abs/path``, ``unix:path`` (relative to the working directory, ``~``
    expanded), ``host:port``, ``[v6]:port`` or ``localhost:port``; port 0 = any free one.

    Raises ConfigError naming the accepted forms for anything else; its message starts
    with ``key``, the config key the text came from.
    """
    text = text.strip()
    if not text:
        raise ConfigError(f"{key} is empty: give unix:///path/to.sock or host:port", key=key)
    if text.startswith("unix:"):
        return _parse_unix(text, key)
    scheme, sep, _ = text.partition("://")
    if sep:
        raise ConfigError(
            f"{key}: scheme {brief(scheme)} is not supported; use unix:///path/to.sock "
            "or host:port",
            key=key,
        )
    return _parse_tcp(text, key)


def _parse_unix(text: str, key: str) -> ListenAddress:
    if text.startswith("unix://"):
        rest = text[len("unix://") :]
        if not rest.startswith("/"):
            raise ConfigError(
                f"{key}: {brief(text)} names a relative path; use unix:///absolute/path "
                "or unix:relative/path",
                key=key,
            )
    else:
        rest = text[len("unix:") :]
    if not rest.strip() or "\0" in rest:
        raise ConfigError(f"{key}: {brief(text)} names no socket path", key=key)
    path = Path(os.path.abspath(Path(rest).expanduser()))
    size = len(os.fsencode(path))
    if size > _MAX_SOCKET_PATH:
        raise ConfigError(
            f"{key}: the socket path {path} is {size} bytes long; the system allows "
            f"{_MAX_SOCKET_PATH}: pick a shorter one",
            key=key,
        )
    return ListenAddress("unix", path=path)


def _parse_tcp(text: str, key: str) -> ListenAddress:
    bracketed = re.fullmatch(r"\[([^\]]*)\]:(.*)", text)
    if bracketed:
        host, port_text = bracketed[1], bracketed[2]
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            raise ConfigError(
                f"{key}: {brief(host)} in brackets is not an IPv6 address", key=key
            ) from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ConfigError(
                f"{key}: {brief(text)} has no port; use host:port (port 0: any free "
                "port) or unix:///path/to.sock",
                key=key,
            )
        if ":" in host:
            raise ConfigError(
                f"{key}: put an IPv6 address in brackets: [{host}]:{port_text}", key=key
            )
        if not host:
            raise ConfigError(
                f"{key}: {brief(text)} names no host; use 127.0.0.1:PORT for this "
                "machine only, or 0.0.0.0:PORT for every interface",
                key=key,
            )
        if not _is_ipv4(host) and not _HOSTNAME.match(host):
            raise ConfigError(f"{key}: {brief(host)} is not a host name or address", key=key)
        if not _is_ipv4(host) and _NUMERIC_LABEL.fullmatch(host.rstrip(".").rsplit(".", 1)[-1]):
            # A name's last label is never a number: this is an address in a short or
            # hex form (127.1, 0x7f.1), which the resolver accepts and gRPC does not.
            raise ConfigError(
                f"{key}: {brief(host)} is not an IPv4 address; write four numbers "
                "from 0 to 255 (127.0.0.1)",
                key=key,
            )
    if not port_text.isdigit() or not port_text.isascii() or int(port_text) > 65535:
        raise ConfigError(
            f"{key}: port {brief(port_text)} must be a number from 0 to 65535", key=key
        )
    return ListenAddress("tcp", host=host, port=int(port_text))


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


def default_listen(env: Mapping[str, str]) -> str:
    """The listen address when ``sidecar.listen`` is empty: ``unix://`` a socket named
    ``sidecar.sock`` in ``$XDG_RUNTIME_DIR/lmtier`` when that variable is an absolute
    path (a per-user tmpfs the login manager makes 0700), else in
    ``$XDG_CACHE_HOME/lmtier/run`` (``~/.cache/lmtier/run``), beside the disk tier.
    """
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime):
        folder = Path(runtime) / "lmtier"
    else:
        folder = cache_home(env) / "lmtier" / "run"
    return f"unix://{folder / SOCKET_NAME}"
