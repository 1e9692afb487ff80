"""Listen addresses, the remote-listener policy and owner-only unix sockets."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmtier.config.secrets import Secret
from lmtier.config.sidecar import SidecarConfig
from lmtier.errors import ConfigError
from lmtier.sidecar import listen as listen_module
from lmtier.sidecar.auth import Authenticator, Principal
from lmtier.sidecar.listen import check_policy, prepare_unix_socket, secure_unix_socket
from lmtier.wire.address import ListenAddress, default_listen, parse_listen

NO_TOKEN = Authenticator()
WITH_TOKEN = Authenticator([(Secret("a-token"), Principal("t"))])


# --- parsing --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "kind", "host", "port", "target"),
    [
        ("127.0.0.1:50051", "tcp", "127.0.0.1", 50051, "127.0.0.1:50051"),
        ("localhost:0", "tcp", "localhost", 0, "localhost:0"),
        ("[::1]:9000", "tcp", "::1", 9000, "[::1]:9000"),
        ("[::]:9000", "tcp", "::", 9000, "[::]:9000"),
        ("0.0.0.0:65535", "tcp", "0.0.0.0", 65535, "0.0.0.0:65535"),
        (" cache-1.example.com:8080 ", "tcp", "cache-1.example.com", 8080, None),
    ],
)
def test_parse_tcp(text: str, kind: str, host: str, port: int, target: str | None) -> None:
    address = parse_listen(text)
    assert (address.kind, address.host, address.port, address.path) == (kind, host, port, None)
    assert address.grpc_target == (target or text.strip())


def test_parse_unix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    absolute = parse_listen(f"unix://{tmp_path}/s.sock")
    assert absolute == ListenAddress("unix", path=tmp_path / "s.sock")
    assert absolute.grpc_target == f"unix://{tmp_path}/s.sock"
    assert absolute.grpc_target.startswith("unix:///")
    assert parse_listen(f"unix:{tmp_path}/s.sock") == absolute
    monkeypatch.chdir(tmp_path)
    assert parse_listen("unix:s.sock") == absolute
    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse_listen("unix:~/s.sock") == absolute


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "is empty"),
        ("unix://relative.sock", "relative path"),
        ("unix:", "names no socket path"),
        ("unix:///" + "x" * 200, "pick a shorter one"),
        ("http://localhost:80", "scheme 'http' is not supported"),
        ("dns:///localhost:80", "scheme 'dns' is not supported"),
        ("localhost", "has no port"),
        (":50051", "names no host"),
        ("::1:50051", "in brackets"),
        ("[localhost]:1", "not an IPv6 address"),
        ("localhost:http", "must be a number"),
        ("localhost:65536", "must be a number from 0 to 65535"),
        ("localhost:-1", "must be a number"),
        ("bad_host!:1", "not a host name"),
        # Short and hex IPv4 forms: the resolver takes them as loopback, gRPC cannot
        # bind them (the sidecar died with a traceback after the policy passed).
        ("127.1:1", "'127.1' is not an IPv4 address"),
        ("127.0.1:1", "is not an IPv4 address"),
        ("0x7f.0.0.1:1", "is not an IPv4 address"),
        ("2130706433:1", "is not an IPv4 address"),
        ("127.0.0.256:1", "is not an IPv4 address"),
    ],
)
def test_parse_refuses_with_a_clear_message(text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as caught:
        parse_listen(text)
    assert caught.value.key == "sidecar.listen"
    assert str(caught.value).startswith("sidecar.listen")


def test_parse_names_the_key_it_was_given() -> None:
    with pytest.raises(ConfigError, match=r"^sidecar.metrics_listen: ") as caught:
        parse_listen("nonsense", key="sidecar.metrics_listen")
    assert caught.value.key == "sidecar.metrics_listen"


@pytest.mark.parametrize(
    ("text", "loopback"),
    [
        ("127.0.0.1:1", True),
        ("127.8.9.1:1", True),
        ("localhost:1", True),
        ("LOCALHOST.:1", True),
        ("[::1]:1", True),
        ("0.0.0.0:1", False),
        ("[::]:1", False),
        ("10.1.2.3:1", False),
        ("example.com:1", False),
        ("unix:///tmp/x.sock", True),
    ],
)
def test_loopback(text: str, loopback: bool) -> None:
    assert parse_listen(text).loopback is loopback


def test_default_listen(tmp_path: Path) -> None:
    runtime = {"XDG_RUNTIME_DIR": "/run/user/1000", "HOME": "/home/u"}
    assert default_listen(runtime) == "unix:///run/user/1000/lmtier/sidecar.sock"
    relative = {"XDG_RUNTIME_DIR": "run", "HOME": "/home/u"}
    assert default_listen(relative) == "unix:///home/u/.cache/lmtier/run/sidecar.sock"
    assert default_listen({"HOME": "/home/u"}) == default_listen(relative)
    bare = default_listen({})
    assert bare == f"unix://{Path.home()}/.cache/lmtier/run/sidecar.sock"
    assert parse_listen(bare).kind == "unix"
    # Without a runtime directory, the socket goes where the cache goes (it ignored
    # XDG_CACHE_HOME, as the disk tier does not); a relative one is ignored.
    cache = {"XDG_CACHE_HOME": "/srv/cache", "HOME": "/home/u"}
    assert default_listen(cache) == "unix:///srv/cache/lmtier/run/sidecar.sock"
    relative_cache = {"XDG_CACHE_HOME": "cache", "HOME": "/home/u"}
    assert default_listen(relative_cache) == default_listen(relative)
    assert default_listen({**cache, **runtime}) == default_listen(runtime)


# --- the remote-listener policy --------------------------------------------------------


def test_a_unix_socket_needs_no_token() -> None:
    check_policy(parse_listen("unix:///tmp/x.sock"), SidecarConfig(), NO_TOKEN)


@pytest.mark.parametrize("text", ["127.0.0.1:0", "localhost:0", "[::1]:0", "127.8.9.1:1"])
def test_a_loopback_tcp_listener_needs_a_token(text: str, caplog: pytest.LogCaptureFixture) -> None:
    """Every local user can dial loopback (a unix socket is 0600): without a token it
    served every tenant's KV to any of them."""
    address = parse_listen(text)
    with pytest.raises(ConfigError, match="needs a token: every user of this machine") as caught:
        check_policy(address, SidecarConfig(), NO_TOKEN)
    assert "sidecar.allow_tcp_without_token: true" in str(caught.value)
    check_policy(address, SidecarConfig(), WITH_TOKEN)
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        check_policy(address, SidecarConfig(allow_tcp_without_token=True), NO_TOKEN)
    assert "every user of this machine can read and write" in caplog.text


@pytest.mark.parametrize("text", ["0.0.0.0:50051", "[::]:50051", "10.0.0.5:1"])
def test_remote_listener_needs_allow_remote_and_a_token(text: str) -> None:
    address = parse_listen(text)
    with pytest.raises(ConfigError, match="allow_remote: true and configure a token"):
        check_policy(address, SidecarConfig(), NO_TOKEN)
    with pytest.raises(ConfigError, match="allow_remote") as caught:
        check_policy(address, SidecarConfig(), WITH_TOKEN)
    assert "configure a token" not in str(caught.value)
    with pytest.raises(ConfigError, match="configure a token"):
        check_policy(address, SidecarConfig(allow_remote=True), NO_TOKEN)
    check_policy(address, SidecarConfig(allow_remote=True), WITH_TOKEN)


def test_remote_listener_without_tls_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        check_policy(parse_listen("0.0.0.0:1"), SidecarConfig(allow_remote=True), WITH_TOKEN)
    assert "without TLS" in caplog.text


def fake_resolver(addresses: dict[str, list[str]]) -> Any:
    def getaddrinfo(host: str, *_args: Any, **_kwargs: Any) -> list[Any]:
        if host not in addresses:
            raise socket.gaierror(socket.EAI_NONAME, "not found")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in addresses[host]]

    return getaddrinfo


def test_host_names_are_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    names = {"me": ["127.0.1.1"], "lan": ["127.0.0.1", "192.168.1.9"], "v6": ["::1"]}
    monkeypatch.setattr(listen_module.socket, "getaddrinfo", fake_resolver(names))
    for local in ("me:1", "v6:1"):
        check_policy(parse_listen(local), SidecarConfig(), WITH_TOKEN)
        with pytest.raises(ConfigError, match="needs a token"):  # local, but TCP
            check_policy(parse_listen(local), SidecarConfig(), NO_TOKEN)
    for remote in ("lan:1", "unknown:1"):
        with pytest.raises(ConfigError, match="reached from other machines"):
            check_policy(parse_listen(remote), SidecarConfig(), NO_TOKEN)


# --- unix sockets -----------------------------------------------------------------------


@pytest.fixture
def short_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder whose paths fit in sun_path (pytest's tmp_path can be long)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="lmt") as folder:
        yield Path(folder)


def bound_socket(path: Path, *, listening: bool) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    if listening:
        sock.listen(1)
    return sock


def test_prepare_creates_an_owner_only_folder(short_dir: Path) -> None:
    path = short_dir / "a" / "b" / "s.sock"
    prepare_unix_socket(path)
    assert path.parent.is_dir()
    assert path.parent.stat().st_mode & 0o777 == 0o700
    prepare_unix_socket(path)  # again: the folder is fine now


def test_prepare_refuses_a_folder_others_may_write(short_dir: Path) -> None:
    shared = short_dir / "shared"
    shared.mkdir()
    for mode in (0o777, 0o770):
        shared.chmod(mode)
        with pytest.raises(ConfigError, match="writable by group or others"):
            prepare_unix_socket(shared / "s.sock")
    shared.chmod(0o1777)  # sticky, like /tmp: nobody can replace another's file
    prepare_unix_socket(shared / "s.sock")


@pytest.mark.skipif(os.getuid() != 0, reason="only root can give a folder away")
def test_prepare_refuses_a_folder_another_user_owns(short_dir: Path) -> None:
    theirs = short_dir / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 4242, 4242)
    with pytest.raises(ConfigError, match=r"belongs to another user \(uid 4242\)"):
        prepare_unix_socket(theirs / "s.sock")


def test_prepare_removes_a_stale_socket(short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = short_dir / "s.sock"
    bound_socket(path, listening=False).close()  # closing leaves the file behind
    assert path.is_socket()
    with caplog.at_level(logging.INFO):
        prepare_unix_socket(path)
    assert not path.exists()
    assert "stale socket" in caplog.text


def test_prepare_refuses_a_live_socket(short_dir: Path) -> None:
    path = short_dir / "s.sock"
    with bound_socket(path, listening=True):
        with pytest.raises(ConfigError, match="another sidecar is listening on"):
            prepare_unix_socket(path)
        assert path.is_socket()


def test_prepare_refuses_what_is_not_a_socket(short_dir: Path) -> None:
    regular = short_dir / "s.sock"
    regular.write_text("keep me")
    with pytest.raises(ConfigError, match="is not a socket; refusing to remove it"):
        prepare_unix_socket(regular)
    assert regular.read_text() == "keep me"
    link = short_dir / "link.sock"
    link.symlink_to(regular)
    with pytest.raises(ConfigError, match="is not a socket"):
        prepare_unix_socket(link)
    assert link.is_symlink()


def test_prepare_refuses_a_parent_that_is_a_file(short_dir: Path) -> None:
    (short_dir / "file").write_text("")
    with pytest.raises(ConfigError, match="not a directory"):
        prepare_unix_socket(short_dir / "file" / "s.sock")


def test_secure_makes_the_socket_owner_only(short_dir: Path) -> None:
    path = short_dir / "s.sock"
    old = os.umask(0o022)
    try:
        sock = bound_socket(path, listening=True)
    finally:
        os.umask(old)
    with sock:
        secure_unix_socket(path)
        assert path.stat().st_mode & 0o777 == 0o600
    regular = short_dir / "file"
    regular.write_text("")
    with pytest.raises(ConfigError, match="is not a socket"):
        secure_unix_socket(regular)
    with pytest.raises(ConfigError, match="cannot chmod"):
        secure_unix_socket(short_dir / "missing")
