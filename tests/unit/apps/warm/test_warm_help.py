"""``lmtier warm`` and ``unpin``'s parsers: each --help names only its own flags."""

from __future__ import annotations

import pytest

from lmtier.cli import main


def help_of(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_unpin_help_mentions_only_flags_it_has(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of("unpin", capsys)
    for absent in ("--via", "--prefetch", "--threads"):
        assert absent not in text
    assert "--model DIR" in text and "no weights are read" in text


def test_warm_help_keeps_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of("warm", capsys)
    for flag in ("--via", "--prefetch", "--threads", "--model DIR"):
        assert flag in text
