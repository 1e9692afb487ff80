"""``sidecar_problem``: what a model command (warm, demo, demo serve) says before it
runs when its ``--sidecar`` cannot be used, from what the client's ``check`` raised."""

from __future__ import annotations

import argparse

import pytest

from lmtier.errors import AuthenticationError, BackendUnavailable, PermissionDeniedError
from lmtier_apps.command_cache import sidecar_problem


class Client:
    """A sidecar client's ``check``: raises ``error`` (None: the sidecar lets it in)."""

    def __init__(self, error: Exception | None) -> None:
        self.error, self.salts = error, []

    def check(self, cache_salt: str = "") -> Client:
        self.salts.append(cache_salt)
        if self.error is not None:
            raise self.error
        return self


ARGS = argparse.Namespace(sidecar="unix:///run/s.sock")
DENIED = PermissionDeniedError("tenant-a may not use model 'm' under cache_salt ''")


def test_the_command_checks_the_salt_it_works_under() -> None:
    """A token of one salt: warm --cache-salt salt-a was refused, because the check
    (stats()) opened the unsalted namespace."""
    client = Client(None)
    assert sidecar_problem(ARGS, client, command="lmtier warm", cache_salt="salt-a") is None  # type: ignore[arg-type]
    assert client.salts == ["salt-a"]


@pytest.mark.parametrize(
    ("error", "salt", "words"),
    [
        (BackendUnavailable("no"), "", "does not answer"),
        (AuthenticationError("the bearer token is not one"), "", "refused the token"),
        (DENIED, "", "tenant-a may not use"),
        (DENIED, None, None),  # demo serve: each request's salt decides
    ],
)
def test_each_refusal_is_one_line(error: Exception, salt: str | None, words: str | None) -> None:
    problem = sidecar_problem(ARGS, Client(error), command="lmtier x", cache_salt=salt)  # type: ignore[arg-type]
    if words is None:
        assert problem is None
    else:
        assert problem is not None and words in problem and "\n" not in problem


def test_an_embedded_cache_has_no_sidecar_problem() -> None:
    args = argparse.Namespace(sidecar=None)
    assert sidecar_problem(args, Client(DENIED), command="lmtier x") is None  # type: ignore[arg-type]
