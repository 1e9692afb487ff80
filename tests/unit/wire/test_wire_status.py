"""The wire's error contract (lmtier/wire/status.py) walked both ways: every error the
server answers with a code comes back to the client as that code's meaning, and an
error that is the caller's own comes back as the same lmtier error."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.message import DecodeError

from lmtier.errors import (
    AuthenticationError,
    CacheClosedError,
    CapacityError,
    ConfigError,
    InvalidRequestError,
    InvalidTokensError,
    PermissionDeniedError,
)
from lmtier.wire.status import (
    MAX_DETAILS,
    TABLE,
    Draining,
    Meaning,
    NotOffered,
    SessionNotFound,
    SidecarRefused,
    SidecarUnavailable,
    meaning_of,
    outcome,
    status_of,
)

Code = grpc.StatusCode
SENT = [(meaning, kind) for meaning in TABLE for kind in meaning.sent_for]


@pytest.mark.parametrize(
    ("meaning", "kind"), SENT, ids=[f"{m.code.name}-{k.__name__}" for m, k in SENT]
)
def test_every_error_the_server_sends_comes_back_as_its_rows_meaning(
    meaning: Meaning, kind: type[BaseException]
) -> None:
    code, text = status_of(kind("why it failed"), "Load")
    assert (code, text) == (meaning.code, "why it failed")
    found = outcome(code, text, "unix:///s")
    assert type(found.error) is meaning.raised
    assert (found.answered, found.forget) == (meaning.up, meaning.forget)


@pytest.mark.parametrize(
    ("sent", "code", "back"),
    [
        (InvalidRequestError("bad"), Code.INVALID_ARGUMENT, InvalidRequestError),
        (InvalidTokensError("bad"), Code.INVALID_ARGUMENT, InvalidRequestError),
        (ConfigError("bad"), Code.INVALID_ARGUMENT, InvalidRequestError),
        (DecodeError("bad"), Code.INVALID_ARGUMENT, InvalidRequestError),
        (PermissionError("bad"), Code.PERMISSION_DENIED, PermissionDeniedError),
        (AuthenticationError("bad"), Code.UNAUTHENTICATED, SidecarRefused),
        (SessionNotFound("bad"), Code.NOT_FOUND, SidecarUnavailable),
        (CapacityError("bad"), Code.RESOURCE_EXHAUSTED, SidecarUnavailable),
        (Draining("bad"), Code.UNAVAILABLE, SidecarUnavailable),
        (CacheClosedError("bad"), Code.UNAVAILABLE, SidecarUnavailable),
        (NotOffered("bad"), Code.FAILED_PRECONDITION, SidecarUnavailable),
        (RuntimeError("bad"), Code.INTERNAL, SidecarUnavailable),
    ],
)
def test_the_round_trip(sent: BaseException, code: grpc.StatusCode, back: type) -> None:
    """The contract as a user sees it: the caller's own errors raise as the same lmtier
    error with the sidecar's message; everything else is a miss."""
    answered, text = status_of(sent, "Lookup")
    assert answered == code
    error = outcome(answered, text, "t").error
    assert type(error) is back
    if back is InvalidRequestError or back is PermissionDeniedError:
        assert str(error) == "sidecar: bad"


def test_the_table_names_each_code_once_and_unlisted_codes_are_outages() -> None:
    codes = [meaning.code for meaning in TABLE]
    assert len(codes) == len(set(codes))
    assert Code.OK not in codes
    unlisted = meaning_of(Code.DATA_LOSS)
    assert unlisted.raised is SidecarUnavailable and not unlisted.up
    assert outcome(Code.DATA_LOSS, "?", "t").complaint == "sidecar t: unexpected DATA_LOSS: ?"


def test_an_unexpected_error_is_internal_with_an_incident_and_long_details_are_cut() -> None:
    code, text = status_of(KeyError("secret detail"), "Load")
    assert code is Code.INTERNAL and "incident" in text and "secret" not in text
    code, text = status_of(InvalidRequestError("x" * 5000), "Load")
    assert code is Code.INVALID_ARGUMENT
    assert text == "x" * (MAX_DETAILS - 20) + "... (5000 characters)"
