"""How the operations commands print for people: aligned tables and readable values.

Tables go through ``rich`` when it is installed (it draws them, and ``--watch``
redraws them in place with ``rich.live``), else through a plain-text fallback with
the same cells, so the commands need no extra to work. Every formatter turns a
missing value (None: a tier that cannot tell) into ``-``, never into a zero.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from lmtier.config.sizes import format_size

__all__ = [
    "MISSING",
    "counted",
    "format_bytes",
    "format_count",
    "format_latency",
    "format_ratio",
    "have_rich",
    "print_table",
    "rich_table",
    "text_table",
]

MISSING = "-"
"""What a cell shows for a value the source does not report."""


def have_rich() -> bool:
    """Whether ``rich`` can be imported (it draws tables when it can)."""
    try:
        import rich  # noqa: F401, PLC0415 - optional
    except ImportError:
        return False
    return True


def format_bytes(value: int | None) -> str:
    """``1.5 GiB``, or ``-``."""
    return MISSING if value is None else format_size(max(value, 0))


def counted(count: int, noun: str) -> str:
    """``1 chunk``, ``12,345 chunks``: a count and its noun, plural unless one."""
    return f"{count:,} {noun if count == 1 else noun + 's'}"


def format_count(value: int | None) -> str:
    """``12,345``, or ``-``."""
    return MISSING if value is None else f"{value:,}"


def format_ratio(value: float | None) -> str:
    """``93.1%``, or ``-``."""
    return MISSING if value is None else f"{value:.1%}"


def format_latency(p50_s: float | None, p99_s: float | None) -> str:
    """``0.256 / 4.1 ms`` (p50 / p99), or ``-`` when nothing was measured."""
    if p50_s is None or p99_s is None:
        return MISSING
    return f"{p50_s * 1e3:.3g} / {p99_s * 1e3:.3g} ms"


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """The plain-text table: the first column left-aligned, the others right-aligned,
    a rule under the headers."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        first, *rest = cells
        parts = [
            first.ljust(widths[0]),
            *(c.rjust(w) for c, w in zip(rest, widths[1:], strict=True)),
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def rich_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> Any:
    """The same table as a ``rich.table.Table`` (for printing, or ``rich.live``)."""
    from rich import box  # noqa: PLC0415 - optional
    from rich.table import Table  # noqa: PLC0415

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    first, *rest = headers
    table.add_column(first, justify="left", no_wrap=True)
    for header in rest:
        table.add_column(header, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def print_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    title: str = "",
    stream: TextIO | None = None,
) -> None:
    """Print ``title`` (lines of text), then a table, to ``stream`` (stdout): with
    ``rich`` when installed, else plain."""
    out = stream if stream is not None else sys.stdout
    if title:
        out.write(title + "\n")
    if not have_rich():
        out.write(text_table(headers, rows) + "\n")
        return
    from rich.console import Console  # noqa: PLC0415 - optional

    # Not a terminal (a pipe, a file): no colours, and no wrapping at 80 columns.
    width = None if out.isatty() else max(shutil.get_terminal_size().columns, 200)
    Console(file=out, width=width, highlight=False).print(rich_table(headers, rows))
