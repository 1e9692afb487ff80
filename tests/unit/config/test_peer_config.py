"""The ``peer`` section's address policy: which addresses named by the shared directory
a node may dial (peer.allowed_peers), and what a directory entry may look like."""

from __future__ import annotations

import pytest

from lmtier.config import LMTierConfig
from lmtier.config.peer import AddressPolicy, split_address
from lmtier.errors import ConfigError


def test_the_default_allows_loopback_only() -> None:
    policy = LMTierConfig().peer.policy
    assert policy.allows("127.0.0.1:7070") and policy.allows("[::1]:7070")
    assert policy.allows("localhost:7070")
    for address in ("10.0.0.5:7070", "sidecar-a:7070", "evil.example:443"):
        assert not policy.allows(address)


@pytest.mark.parametrize(
    "address",
    [
        "unix:/tmp/x.sock",
        "unix:///tmp/x.sock",
        "unix-abstract:x",
        "dns:///sidecar-a:7070",
        "ipv4:127.0.0.1:7070,127.0.0.2:7070",
        "127.0.0.1:7070,evil:1",
        "127.0.0.1",
        "127.0.0.1:0",
        "127.0.0.1:65536",
        "127.0.0.1:+80",
        "user@127.0.0.1:80",
        "127.0.0.1:80/path",
        " 127.0.0.1:80",
        "[127.0.0.1]:80",
        "[::1:80",
        "-bad-.example:80",
        "a" * 300 + ":80",
        "",
    ],
)
def test_anything_but_a_plain_host_and_port_is_never_dialled(address: str) -> None:
    policy = AddressPolicy.parse(["0.0.0.0/0", "::/0", "*.example", "localhost"])
    assert not policy.allows(address)
    with pytest.raises(ValueError, match=r"host|address"):
        split_address(address)


def test_networks_names_and_domains() -> None:
    config = LMTierConfig(peer={"allowed_peers": "10.0.0.0/8, sidecar-a ,*.lmtier.svc"})
    policy = config.peer.policy
    assert policy.allows("10.1.2.3:7070") and not policy.allows("11.0.0.1:7070")
    assert policy.allows("sidecar-a:7070") and policy.allows("SIDECAR-A:1")
    assert not policy.allows("sidecar-b:7070")
    assert policy.allows("node-1.lmtier.svc:7070")
    assert not policy.allows("lmtier.svc:7070") and not policy.allows("evil-lmtier.svc:1")
    assert not policy.allows("127.0.0.1:7070")  # the list replaces the default
    yaml_list = LMTierConfig(peer={"allowed_peers": ["::1/128"]}).peer.policy
    assert yaml_list.allows("[::1]:7070")


@pytest.mark.parametrize("entry", ["unix:/x", "10.0.0.0/33", "*.", "a b", "http://x"])
def test_a_bad_entry_is_a_config_error(entry: str) -> None:
    with pytest.raises(ConfigError, match=r"peer\.allowed_peers") as refused:
        LMTierConfig(peer={"allowed_peers": [entry]})
    assert "\n" not in str(refused.value)


def test_tls_certificate_and_key_come_together() -> None:
    with pytest.raises(ConfigError, match="tls_cert_file and tls_key_file"):
        LMTierConfig(peer={"tls_cert_file": "/x.pem"})
