"""What a failed sidecar call means to its client (lmtier/wire/status.py), and
where a client looks for a sidecar when it is given no address."""

from __future__ import annotations

import grpc
import pytest

from lmtier.config import LMTierConfig
from lmtier.errors import InvalidRequestError, PermissionDeniedError
from lmtier.remote.client import sidecar_target
from lmtier.wire.status import SidecarRefused, SidecarUnavailable, outcome

Code = grpc.StatusCode


def test_a_refused_namespace_is_an_error_of_that_call_and_no_outage() -> None:
    found = outcome(Code.PERMISSION_DENIED, "tenant-a may not use model 'm'", "unix:///s")
    assert isinstance(found.error, PermissionDeniedError)
    assert str(found.error) == "sidecar: tenant-a may not use model 'm'"
    assert found.answered and not found.forget and not found.complaint


def test_a_refused_token_is_a_miss_as_an_outage_is_and_is_complained_of() -> None:
    found = outcome(Code.UNAUTHENTICATED, "the bearer token is not one this sidecar accepts", "t")
    assert isinstance(found.error, SidecarRefused)
    assert isinstance(found.error, SidecarUnavailable)  # every caller answers it as a miss
    assert not found.answered
    assert found.complaint == (
        "sidecar t refused this client's token: the bearer token is not one this sidecar accepts"
    )


@pytest.mark.parametrize(
    ("code", "answered", "forget"),
    [
        (Code.UNAVAILABLE, False, False),
        (Code.DEADLINE_EXCEEDED, False, False),
        (Code.RESOURCE_EXHAUSTED, True, False),
        (Code.NOT_FOUND, True, True),
    ],
)
def test_misses(code: grpc.StatusCode, answered: bool, forget: bool) -> None:
    found = outcome(code, "why", "t")
    assert type(found.error) is SidecarUnavailable
    assert (found.answered, found.forget, found.complaint) == (answered, forget, "")


def test_the_callers_own_errors_raise() -> None:
    found = outcome(Code.INVALID_ARGUMENT, "a chunk of this namespace is too large", "t")
    assert isinstance(found.error, InvalidRequestError) and found.answered
    assert outcome(Code.DATA_LOSS, "?", "t").complaint == "sidecar t: unexpected DATA_LOSS: ?"


def test_a_client_without_an_address_looks_where_lmtier_serve_listens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert sidecar_target(LMTierConfig()) == "unix:///run/user/1000/lmtier/sidecar.sock"
    named = LMTierConfig(sidecar={"listen": "127.0.0.1:7000"})
    assert sidecar_target(named) == "127.0.0.1:7000"
