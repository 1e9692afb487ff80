"""What keeps ``lmtier serve``'s listener private.

:func:`check_policy` refuses a TCP listener other machines can reach unless the config
says so (``allow_remote``) *and* a token is required; :func:`prepare_unix_socket` and
:func:`secure_unix_socket` keep a unix socket owner-only. Parsing the address itself
is the wire's (:mod:`lmtier.wire.address`): clients read addresses too.

Why a unix socket by default: its access check is the file system's (0600 in a 0700
directory), so a single-user machine needs no token and no TLS, and no port can be
reached from elsewhere by a mistyped address.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from lmtier.errors import ConfigError

if TYPE_CHECKING:
    from lmtier.config.sidecar import SidecarConfig
    from lmtier.sidecar.auth import Authenticator
    from lmtier.wire.address import ListenAddress

__all__ = ["check_policy", "prepare_unix_socket", "secure_unix_socket"]

logger = logging.getLogger(__name__)

_KEY = "sidecar.listen"


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
