"""How ``lmtier cluster demo`` shows its story: a table, one JSON object, a PNG.

The plot is ``lmtier demo --plot``'s (:func:`lmtier_apps.demo.plot.write_ttft_plot`:
TTFT with and without the cache per row, coloured by the serving tier), given the
rows as :class:`~lmtier_apps.demo.rows.DemoRow`; the plot module and matplotlib are
imported only when a plot is drawn.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any, TextIO

from lmtier_apps.cluster.demo import Row, StoryResult

__all__ = ["SCHEMA", "print_table", "story_json", "write_plot"]

SCHEMA = "lmtier.cluster_demo/1"


def _tiers(row: Row) -> str:
    return ", ".join(f"{tier} {tokens}" for tier, tokens in row.tiers.items()) or "-"


def _diff(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def print_table(result: StoryResult, out: TextIO) -> None:
    """The story as a table, the nodes first and the notes last."""
    for node in result.nodes:
        metrics = f", metrics {node.metrics_url}" if node.metrics_url else ""
        print(f"node {node.name}: engine {node.engine_url}{metrics}", file=out)
    print(f"chunks of {result.chunk_size} tokens\n", file=out)
    header = (
        f"{'#':>1} {'step':<34} {'node':<4} {'prompt':<6} {'tokens':>6} {'cached':>6}  "
        f"{'served by':<12} {'TTFT ms':>8} {'no cache':>8} {'speedup':>7} {'max |dlogit|':>12}"
    )
    print(header, file=out)
    print("-" * len(header), file=out)
    for row in result.rows:
        print(
            f"{row.phase:>1} {row.step:<34} {row.node:<4} {row.prompt:<6} "
            f"{row.prompt_tokens:>6} {row.cached_tokens:>6}  {_tiers(row):<12} "
            f"{row.ttft_ms:>8.1f} {row.ttft_no_cache_ms:>8.1f} {row.speedup:>6.1f}x "
            f"{_diff(row.max_logit_diff):>12}",
            file=out,
        )
    print("-" * len(header), file=out)
    for note in result.notes:
        print(f"note: {note}", file=out)


def story_json(result: StoryResult) -> dict[str, Any]:
    """The story as one JSON-ready object (schema :data:`SCHEMA`)."""
    rows = [{**asdict(row), "speedup": round(row.speedup, 2)} for row in result.rows]
    return {
        "schema": SCHEMA,
        "nodes": [asdict(node) for node in result.nodes],
        "chunk_size": result.chunk_size,
        "rows": rows,
        "notes": result.notes,
    }


def write_plot(result: StoryResult, path: str | os.PathLike[str]) -> None:
    """A PNG of each row's TTFT with and without the cache, by serving tier."""
    from lmtier_apps.demo.plot import write_ttft_plot  # noqa: PLC0415 - only to plot
    from lmtier_apps.demo.rows import DemoRow  # noqa: PLC0415

    rows = [
        DemoRow(
            request=f"{row.phase}. {row.node}: {row.prompt}",
            prompt_tokens=row.prompt_tokens,
            cached_tokens=row.cached_tokens,
            tiers=row.tiers,
            ttft_ms=row.ttft_ms,
            ttft_no_cache_ms=row.ttft_no_cache_ms,
            max_logit_diff=row.max_logit_diff or 0.0,
        )
        for row in result.rows
    ]
    title = "TTFT per request across the cluster: node B served from A's work"
    write_ttft_plot(rows, path, title=title)
