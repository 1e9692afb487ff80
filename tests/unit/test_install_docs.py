"""The install commands of the README and docs work from a checkout: lmtier is on no
package index, so each installs it from the checkout (``-e '.[extras]'``), with extras
pyproject.toml has, and the README's first command installs every extra an ``lmtier``
command needs (but the cluster's servers)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import tomllib

from lmtier.extras import EXTRA_MODULES
from support import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS += [ROOT / "deploy" / "README.md", ROOT / "benchmarks" / "README.md"]
EXTRAS = set(
    tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
)
_PIP = re.compile(r"pip install [^`\n&#|]*")


def install_commands(path: Path) -> list[str]:
    """Every ``pip install ...`` of ``path`` (in code blocks and inline code)."""
    return [match.group(0).strip() for match in _PIP.finditer(path.read_text())]


def words(command: str) -> list[str]:
    return shlex.split(command.replace("\\", " "))  # a line continued on the next


def lmtier_targets(command: str) -> list[str]:
    """The words of ``command`` that name lmtier: ``.``, ``.[...]`` or ``lmtier[...]``."""
    return [w for w in words(command) if w == "." or w.startswith((".[", "lmtier[", "lmtier=="))]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_install_of_lmtier_is_from_the_checkout(path: Path) -> None:
    for command in install_commands(path):
        for target in lmtier_targets(command):
            assert not target.startswith("lmtier"), f"{path.name}: {command!r} (not on PyPI)"
            assert "-e" in words(command), f"{path.name}: {command!r} is not editable"
            extras = set(re.findall(r"\[(.*)\]", target)[0].split(",")) if "[" in target else set()
            assert extras <= EXTRAS, f"{path.name}: {command!r} names {extras - EXTRAS}"


def test_the_readme_first_command_installs_what_every_command_needs() -> None:
    first = install_commands(ROOT / "README.md")[0]
    (target,) = lmtier_targets(first)
    extras = set(re.findall(r"\[(.*)\]", target)[0].split(","))
    # `lmtier cluster` needs the same, plus servers no pip extra gives (redis-server, moto).
    assert extras >= {"hf", "serve", "grpc", "redis", "s3"}
    assert extras >= set(EXTRA_MODULES) - {"plot", "vllm", "cuda"}
