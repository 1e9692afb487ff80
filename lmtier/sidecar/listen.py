"""Where ``lmtier serve`` listens, and what keeps that listener private.

:func:`parse_listen` reads ``sidecar.listen`` (a unix socket or ``host:port``);
:func:`check_policy` refuses a TCP listener other machines can reach unless the config
says so (``allow_remote``) *and* a token is required; :func:`prepare_unix_socket` and
:func:`secure_unix_socket` keep a unix socket owner-only.

Why a unix socket by default: its access check is the file system's (0600 in a 0700
directory), so a single-user machine needs no token and no TLS, and no port can be
reached from elsewhere by a mistyped address.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from lmtier.config.model import cache_home
from lmtier.errors import ConfigError, brief

if TYPE_CHECKING:
    from lmtier.config.sidecar import SidecarConfig
    from lmtier.sidecar.auth import Authenticator

__all__ = [
    "HANDSHAKE_TIMEOUT_MS",
    "ListenAddress",
    "check_policy",
    "default_listen",
    "parse_listen",
    "prepare_unix_socket",
    "secure_unix_socket",
]

logger = logging.getLogger(__name__)

SOCKET_NAME = "sidecar.sock"
HANDSHAKE_TIMEOUT_MS = 10_000
"""gRPC listeners (the sidecar's, the peer's) close a connection that has not completed
its TLS and HTTP/2 handshakes by then: grpc's default, 120 s, let idle connections
that need no token hold the sidecar's descriptors that long."""
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


def check_policy(address: ListenAddress, sidecar: SidecarConfig, auth: Authenticator) -> None:
    """Refuse a TCP listener that other machines can reach unless ``sidecar.allow_remote``
    is set and ``auth`` requires a token; warn when such a listener has no TLS. Refuse
    a loopback TCP listener without a token unless ``sidecar.allow_tcp_without_token``
    (then warn): unlike a unix socket (0600), loopback is open to every local user.

    ``localhost`` and loopback addresses are local; ``0.0.0.0`` and ``::`` (every
    interface) are not; another host name is local when all its addresses are.
    """
    if address.kind == "unix":
        return
    if address.loopback or _resolves_to_loopback(address.host):
        _check_local_tcp(address, sidecar, auth)
        return
    missing = []
    if not sidecar.allow_remote:
        missing.append("set sidecar.allow_remote: true")
    if not auth.required:
        missing.append("configure a token (sidecar.auth_token_file or sidecar.tokens_file)")
    if missing:
        raise ConfigError(
            f"{_KEY}: {address} can be reached from other machines; to allow that, "
            f"{' and '.join(missing)}, or listen on 127.0.0.1 or a unix socket",
            key=_KEY,
        )
    if sidecar.tls_cert_file is None:
        logger.warning(
            "the sidecar listens on %s without TLS: tokens and KV travel in clear text; "
            "set sidecar.tls_cert_file and sidecar.tls_key_file",
            address,
        )


def _check_local_tcp(address: ListenAddress, sidecar: SidecarConfig, auth: Authenticator) -> None:
    if auth.required:
        return
    if not sidecar.allow_tcp_without_token:
        raise ConfigError(
            f"{_KEY}: {address} needs a token: every user of this machine can connect to "
            "a TCP port, loopback too; configure one (sidecar.auth_token_file or "
            "sidecar.tokens_file), listen on a unix socket, or set "
            "sidecar.allow_tcp_without_token: true",
            key=_KEY,
        )
    logger.warning(
        "sidecar.allow_tcp_without_token: %s takes calls without a token: every user of "
        "this machine can read and write every tenant's KV through it",
        address,
    )


def _resolves_to_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is loopback (False if none does)."""
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return False  # a literal: ListenAddress.loopback already answered
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    addresses = {str(info[4][0]).split("%", 1)[0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def prepare_unix_socket(path: Path) -> None:
    """Make ``path`` ready to bind: its folder exists, owner-only, and no stale socket.

    Creates a missing parent folder with mode 0700. Refuses a parent that another user
    (not root) owns, or that group or others may write and that is not sticky (anyone
    could replace the socket there). Removes a socket file left by a dead sidecar, but
    refuses a path that is not a socket or on which a live sidecar still answers.
    """
    parent = path.parent
    try:
        if not parent.exists():
            parent.mkdir(mode=0o700, parents=True)
            parent.chmod(0o700)  # mkdir's mode is masked by the umask
        info = parent.stat()
    except OSError as exc:
        raise ConfigError(f"{_KEY}: cannot create {parent}: {exc.strerror}", key=_KEY) from None
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{_KEY}: {parent} is not a directory", key=_KEY)
    if info.st_uid not in (os.getuid(), 0):
        raise ConfigError(
            f"{_KEY}: {parent} belongs to another user (uid {info.st_uid}); "
            "put the socket in a directory you own",
            key=_KEY,
        )
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise ConfigError(
            f"{_KEY}: {parent} is writable by group or others (mode "
            f"{stat.S_IMODE(info.st_mode):03o}), so anyone could replace the socket; "
            "chmod 700 it or pick another directory",
            key=_KEY,
        )
    _remove_stale_socket(path)


def _remove_stale_socket(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"{_KEY}: cannot inspect {path}: {exc.strerror}", key=_KEY) from None
    if not stat.S_ISSOCK(mode):
        raise ConfigError(
            f"{_KEY}: {path} exists and is not a socket; refusing to remove it", key=_KEY
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)  # a listener whose backlog is full may not answer at once
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # nobody listens: a socket left by a sidecar that died
    except OSError as exc:  # a timeout (busy listener) or no permission: leave it alone
        raise ConfigError(
            f"{_KEY}: cannot tell whether a sidecar still listens on {path} "
            f"({exc.strerror or type(exc).__name__}); remove it if none does",
            key=_KEY,
        ) from None
    else:
        raise ConfigError(
            f"{_KEY}: another sidecar is listening on {path}; stop it or pick another socket path",
            key=_KEY,
        )
    finally:
        probe.close()
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ConfigError(f"{_KEY}: cannot remove {path}: {exc.strerror}", key=_KEY) from None
    logger.info("removed the stale socket %s", path)


def secure_unix_socket(path: Path) -> None:
    """Make the bound socket ``path`` owner-only (0600).

    Call it right after the bind. Between the bind and the chmod the socket has the
    umask's mode, but its 0700 directory (:func:`prepare_unix_socket`) already keeps
    other users out.
    """
    try:
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ConfigError(f"{_KEY}: {path} is not a socket", key=_KEY)
        path.chmod(0o600)
    except OSError as exc:
        raise ConfigError(f"{_KEY}: cannot chmod {path}: {exc.strerror}", key=_KEY) from None
