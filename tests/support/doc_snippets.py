"""The Python blocks of README.md and docs/*.md, as test_doc_snippets.py runs them.

Conventions a page follows (they are the contract a doc writer keeps):

* A page's ```` ```python ```` blocks run in order in one interpreter, as a reader
  following the page runs them: a later block uses the names an earlier one made.
* The line right before a block may say what it needs, in a comment the test reads:
  ``<!-- snippet: sidecar -->`` (it talks to ``lmtier serve`` on its default socket:
  the page runs once with one serving there and once with none, since a sidecar that
  is down costs misses, never an error).
* A block that is not meant to run alone (an excerpt of a class, a fragment of a
  call) says so where every reader sees it, on its first line: ``# fragment: why``.
  The test skips it; there are to be few (:data:`MAX_FRAGMENTS`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from support import ROOT

__all__ = ["MAX_FRAGMENTS", "NEEDS", "Block", "blocks_of", "pages"]

PYTHON = frozenset({"python", "py", "python3"})
NEEDS = frozenset({"sidecar"})
"""What a ``<!-- snippet: ... -->`` comment may name."""
MAX_FRAGMENTS = 3
_FENCE = re.compile(r"^(```+|~~~+)\s*([^\s`]*)")
_MARKER = re.compile(r"^<!--\s*snippet:\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True, slots=True)
class Block:
    """One fenced Python block: where it is, its code, what it needs."""

    page: Path
    line: int
    """The line of its first code line (1-based), for tracebacks."""
    code: str
    needs: frozenset[str]

    @property
    def fragment(self) -> bool:
        return self.code.lstrip().startswith("# fragment:")

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """README.md and every page of docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks_of(page: Path) -> list[Block]:
    """The Python blocks of ``page``, in order (blocks of other languages are passed
    over whole, so a fence inside one is not mistaken for a block of its own)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        fence, info = opening.group(1), opening.group(2).lower()
        end = index + 1
        closing = re.compile(rf"{re.escape(fence[0])}{{{len(fence)},}}\s*")
        while end < len(lines) and not closing.fullmatch(lines[end].strip()):
            end += 1
        if info in PYTHON:
            marker = _MARKER.match(lines[index - 1]) if index > 0 else None
            needs = frozenset(marker.group(1).split()) if marker else frozenset()
            code = "\n".join(lines[index + 1 : end]) + "\n"
            found.append(Block(page, index + 2, code, needs))
        index = end + 1
    return found
