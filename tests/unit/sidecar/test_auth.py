"""Bearer tokens, their scopes and files, and the TLS credentials of the sidecar."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lmtier.config.secrets import Secret
from lmtier.config.sidecar import SidecarConfig
from lmtier.errors import AuthenticationError, ConfigError, LMTierError
from lmtier.sidecar import auth as auth_module
from lmtier.sidecar.auth import (
    ANONYMOUS,
    Authenticator,
    Principal,
    server_credentials,
)
from lmtier.wire.credentials import channel_credentials

TOKEN = "s3cr3t-token-value"
OTHER = "another-token-9f2"


def bearer(token: str) -> list[tuple[str, str]]:
    return [("user-agent", "test"), ("authorization", f"Bearer {token}")]


def write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


# --- principals and tokens ------------------------------------------------------------


def test_principal_scopes() -> None:
    assert ANONYMOUS.allows("any/model", "any-salt")
    scoped = Principal("t", frozenset({"m1"}), frozenset({"s1", ""}))
    assert scoped.allows("m1", "s1") and scoped.allows("m1", "")
    assert not scoped.allows("m2", "s1")
    assert not scoped.allows("m1", "s2")
    assert Principal("t", None, frozenset({"s"})).allows("whatever", "s")


def test_no_token_configured_lets_everyone_in() -> None:
    auth = Authenticator.from_config(SidecarConfig())
    assert not auth.required
    assert auth.authenticate(None) is ANONYMOUS
    assert auth.authenticate(bearer("anything")) is ANONYMOUS


def test_auth_token_is_required_and_checked() -> None:
    auth = Authenticator.from_config(SidecarConfig(auth_token=TOKEN))
    assert auth.required
    assert auth.authenticate(bearer(TOKEN)).name == "auth_token"
    assert auth.authenticate([("authorization", f"bearer   {TOKEN} ")]).models is None
    assert auth.authenticate([("authorization", f"Bearer {TOKEN}".encode())]).salts is None


@pytest.mark.parametrize(
    ("metadata", "words"),
    [
        (None, "requires a token"),
        ([], "requires a token"),
        ([("authorization", f"Basic {TOKEN}")], "not 'Bearer <token>'"),
        ([("authorization", "Bearer")], "not 'Bearer <token>'"),
        ([("authorization", TOKEN)], "not 'Bearer <token>'"),
        (bearer(TOKEN) + bearer(TOKEN), "more than one"),
        (bearer(TOKEN + "x"), "not one this sidecar accepts"),
        (bearer(TOKEN[:-1]), "not one this sidecar accepts"),
    ],
)
def test_bad_credentials_are_refused_without_quoting_tokens(
    metadata: list[tuple[str, str]] | None, words: str
) -> None:
    auth = Authenticator.from_config(SidecarConfig(auth_token=TOKEN))
    with pytest.raises(AuthenticationError, match=words) as caught:
        auth.authenticate(metadata)
    assert isinstance(caught.value, LMTierError)
    assert TOKEN[:6] not in str(caught.value)


def test_every_token_is_compared_whichever_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = [(Secret(f"token-number-{i}"), Principal(f"p{i}")) for i in range(5)]
    auth = Authenticator(tokens)
    calls: list[int] = []
    real = auth_module.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        assert len(a) == len(b) == 32  # digests: equal lengths whatever the tokens
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth_module.hmac, "compare_digest", counting)
    for index in (0, 4):
        calls.clear()
        assert auth.authenticate(bearer(f"token-number-{index}")).name == f"p{index}"
        assert len(calls) == 5
    calls.clear()
    with pytest.raises(AuthenticationError):
        auth.authenticate(bearer("x"))
    assert len(calls) == 5


def test_tokens_never_reach_reprs() -> None:
    auth = Authenticator.from_config(SidecarConfig(auth_token=TOKEN))
    assert TOKEN not in repr(auth)
    assert "auth_token" in repr(auth)
    assert TOKEN not in repr(auth._tokens)


@pytest.mark.parametrize("token", ["", "has space", "tab\there", "non-ascii-é"])
def test_unusable_tokens_are_refused(token: str) -> None:
    with pytest.raises(ConfigError, match=r"empty|printable ASCII"):
        Authenticator([(Secret(token), Principal("t"))])


def test_the_same_token_twice_is_refused() -> None:
    tokens = [(Secret(TOKEN), Principal("a")), (Secret(TOKEN), Principal("b"))]
    with pytest.raises(ConfigError, match="b and a carry the same token") as caught:
        Authenticator(tokens)
    assert TOKEN not in str(caught.value)


# --- token files ----------------------------------------------------------------------


def test_auth_token_file_first_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path / "token", f"  {TOKEN}  \nsecond line\n")
    with caplog.at_level(logging.WARNING):
        auth = Authenticator.from_config(SidecarConfig(auth_token_file=str(path)))
    assert caplog.records == []
    assert auth.authenticate(bearer(TOKEN)).name == "auth_token_file"


def test_shared_token_file_warns_without_the_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path / "token", TOKEN, mode=0o644)
    with caplog.at_level(logging.WARNING):
        Authenticator.from_config(SidecarConfig(auth_token_file=str(path)))
    assert len(caplog.records) == 1
    assert "chmod 600" in caplog.text and str(path) in caplog.text
    assert TOKEN not in caplog.text


@pytest.mark.parametrize("text", ["", "\n", "   \nsecond\n"])
def test_empty_token_file_is_refused(tmp_path: Path, text: str) -> None:
    path = write(tmp_path / "token", text)
    with pytest.raises(ConfigError, match=r"first line .* is empty"):
        Authenticator.from_config(SidecarConfig(auth_token_file=str(path)))


def test_unreadable_token_file_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=r"auth_token_file: cannot read .*nope") as caught:
        Authenticator.from_config(SidecarConfig(auth_token_file=str(missing)))
    assert caught.value.key == "sidecar.auth_token_file"
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="cannot read"):
        Authenticator.from_config(SidecarConfig(auth_token_file=str(binary)))


def test_tokens_file_scopes_and_token_files(tmp_path: Path) -> None:
    write(tmp_path / "t2", f"{OTHER}\n")
    path = write(
        tmp_path / "tokens.yaml",
        f"- token: {TOKEN}\n"
        "  models: [org/model-a, org/model-b]\n"
        "  salts: ['', team-1]\n"
        "- token_file: t2\n"
        "  name: batch jobs\n",
    )
    auth = Authenticator.from_config(SidecarConfig(tokens_file=str(path), auth_token="admin-tok"))
    first = auth.authenticate(bearer(TOKEN))
    assert first == Principal(
        "token 1", frozenset({"org/model-a", "org/model-b"}), frozenset({"", "team-1"})
    )
    assert auth.authenticate(bearer(OTHER)) == Principal("batch jobs")
    assert auth.authenticate(bearer("admin-tok")).name == "auth_token"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (f"- {{token: '{TOKEN}, models: [a]}}\n", "not valid YAML at line 2"),
        (f"token: {TOKEN}\n", "non-empty YAML list"),
        ("[]\n", "non-empty YAML list"),
        ("", "non-empty YAML list"),
        (f"- {TOKEN}\n", "entry 1 must be a mapping"),
        (f"- {{token: {TOKEN}, model: [a]}}\n", r"unknown key\(s\) \['model'\]"),
        (f"- {{token: {TOKEN}, token_file: x}}\n", "exactly one of"),
        ("- {models: [a]}\n", "exactly one of"),
        ("- {token: 12345}\n", "'token' must be a string"),
        (f"- {{token: {TOKEN}, models: []}}\n", "'models' is empty"),
        (f"- {{token: {TOKEN}, salts: a}}\n", "'salts' must be a list of strings"),
        (f"- {{token: {TOKEN}, name: ''}}\n", "'name' must be a non-empty string"),
        (f"- {{token: {TOKEN}}}\n- {{token: {TOKEN}}}\n", "same token"),
        ("- {token: ''}\n", "is empty"),
        ("- {token_file: missing}\n", "cannot read"),
    ],
)
def test_malformed_tokens_file_is_refused_without_quoting_tokens(
    tmp_path: Path, text: str, words: str
) -> None:
    path = write(tmp_path / "tokens.yaml", text)
    with pytest.raises(ConfigError, match=words) as caught:
        Authenticator.from_config(SidecarConfig(tokens_file=str(path)))
    assert TOKEN not in str(caught.value)


# --- TLS ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder = tmp_path_factory.mktemp("pki")
    now = datetime.datetime.now(datetime.timezone.utc)

    def issue(name: str, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None, **kw: object):  # type: ignore[no-untyped-def]
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        issuer_name, issuer_key = issuer if issuer else (subject, key)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True
            )
        )
        if kw.get("server"):
            names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(issuer_key, hashes.SHA256())
        (folder / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path = folder / f"{name}.key"
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        key_path.chmod(0o600)
        return subject, key

    ca = issue("ca", None)
    issue("server", ca, server=True)
    issue("client", ca)
    return {
        f"{n}_{kind}": folder / f"{n}.{kind}"
        for n in ("ca", "server", "client")
        for kind in ("crt", "key")
    }


def tls_config(pki: dict[str, Path], *, mutual: bool = False) -> SidecarConfig:
    extra = {"tls_client_ca_file": str(pki["ca_crt"])} if mutual else {}
    return SidecarConfig(
        tls_cert_file=str(pki["server_crt"]), tls_key_file=str(pki["server_key"]), **extra
    )


def test_credentials_build(pki: dict[str, Path]) -> None:
    assert server_credentials(SidecarConfig()) is None
    assert server_credentials(tls_config(pki)) is not None
    assert server_credentials(tls_config(pki, mutual=True)) is not None
    assert channel_credentials() is not None
    assert channel_credentials(pki["ca_crt"], pki["client_crt"], pki["client_key"]) is not None


def test_bad_credential_files_are_config_errors(pki: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="both cert_file and key_file"):
        channel_credentials(cert_file=pki["client_crt"])
    with pytest.raises(ConfigError, match="ca_file: cannot read"):
        channel_credentials(tmp_path / "missing.pem")
    not_pem = write(tmp_path / "cert.txt", "hello")
    config = SidecarConfig(tls_cert_file=str(not_pem), tls_key_file=str(pki["server_key"]))
    with pytest.raises(ConfigError, match=r"tls_cert_file: .* is not a PEM file"):
        server_credentials(config)


class _GuardedHealth(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """Health checks that need a token: what the sidecar's service does with auth."""

    def __init__(self, auth: Authenticator) -> None:
        self.auth = auth
        self.callers: list[str] = []

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        try:
            principal = self.auth.authenticate(context.invocation_metadata())
        except AuthenticationError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        self.callers.append(principal.name)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def _tls_round_trip(pki: dict[str, Path]) -> tuple[list[str], list[grpc.StatusCode]]:
    service = _GuardedHealth(Authenticator([(Secret(TOKEN), Principal("client-a"))]))
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(service, server)
    credentials = server_credentials(tls_config(pki, mutual=True))
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    codes: list[grpc.StatusCode] = []
    try:
        attempts = [
            (channel_credentials(pki["ca_crt"], pki["client_crt"], pki["client_key"]), TOKEN),
            (channel_credentials(pki["ca_crt"], pki["client_crt"], pki["client_key"]), "wrong"),
            (channel_credentials(pki["ca_crt"]), TOKEN),  # no client certificate
        ]
        for creds, token in attempts:
            async with grpc.aio.secure_channel(f"localhost:{port}", creds) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                try:
                    reply = await stub.Check(
                        health_pb2.HealthCheckRequest(), metadata=bearer(token), timeout=30
                    )
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
    finally:
        await server.stop(None)
    return service.callers, codes


def test_tls_handshake_and_token_over_grpc(pki: dict[str, Path]) -> None:
    callers, codes = asyncio.run(_tls_round_trip(pki))
    assert callers == ["client-a"]
    assert codes == [
        grpc.StatusCode.OK,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNAVAILABLE,  # the server refused the handshake
    ]
