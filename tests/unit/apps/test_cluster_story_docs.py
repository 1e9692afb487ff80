"""What the cluster demo is said to do matches what it does (lmtier_apps.cluster.demo's
PHASES): the phase list of docs/cluster.md and ``lmtier cluster demo --help`` tell the
peer step too (they told the story without it), and no page says peer-to-peer is not
done."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmtier.cli import main
from lmtier_apps.cluster.demo import PHASES
from support import ROOT


def demo_section() -> str:
    text = (ROOT / "docs" / "cluster.md").read_text()
    return text.split("## The demo: `lmtier cluster demo`", 1)[1].split("\n## ", 1)[0]


def test_the_docs_list_every_phase_in_order() -> None:
    phases = re.findall(r"^(\d)\. \*\*(.+?)\*\*", demo_section(), flags=re.M | re.S)
    assert [int(number) for number, _ in phases] == list(range(1, len(PHASES) + 1))
    told = " ".join(" ".join(title.split()) for _, title in phases)
    positions = [told.find(tier) for tier in ("A's memory", "Redis", "S3", "own CPU tier")]
    assert -1 not in positions and positions == sorted(positions), told


def test_the_demo_help_tells_the_peer_step(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["cluster", "--help"])
    summary = " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["cluster", "demo", "--help"])
    description = " ".join(capsys.readouterr().out.split())
    assert "B is served from A's memory (peer), then Redis, then S3, then its own" in summary
    story = description.split("B gets P1 from A's memory", 1)[1]
    positions = [story.find(step) for step in ("P2 from Redis", "P3 from S3", "own CPU tier")]
    assert -1 not in positions and positions == sorted(positions), description


@pytest.mark.parametrize("path", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_no_page_says_peer_to_peer_is_not_done(path: Path) -> None:
    text = " ".join(path.read_text().split()).lower()
    assert "peer-to-peer between sidecars is the cluster issue" not in text
    assert "peer-to-peer sharing is not supported" not in text
