"""The committed stubs in lmtier/v1 are what proto/generate.py makes of the .proto files."""

from __future__ import annotations

from support import ROOT


def test_every_field_is_documented() -> None:
    """Each message field and rpc in the .proto has a comment line right above it."""
    undocumented = []
    for proto in (ROOT / "proto" / "lmtier" / "v1").glob("*.proto"):
        lines = proto.read_text().splitlines()
        for number, line in enumerate(lines):
            text = line.strip()
            is_field = (
                text.endswith(";")
                and "=" in text
                and not text.startswith(("syntax", "package", "option", "//"))
            )
            if (is_field or text.startswith("rpc ")) and not _commented(lines, number):
                undocumented.append(f"{proto.name}:{number + 1}: {text}")
    assert undocumented == []


def _commented(lines: list[str], number: int) -> bool:
    """A comment right above, or the field belongs to a run of fields under one comment
    (consecutive fields that the comment above the run describes together)."""
    index = number - 1
    while index >= 0:
        above = lines[index].strip()
        if above.startswith("//"):
            return True
        if not (above.endswith(";") and "=" in above):
            return False
        index -= 1
    return False
