"""``lmtier demo --plot FILE.png``: TTFT per request, with and without lmtier.

One pair of bars per request: the full prefill without lmtier (grey) beside the
prefill through lmtier, coloured by the tier that served most of its cached tokens
(``none`` when nothing was cached). A picture shows at once what the table says row
by row: which requests the cache helped, and from where.

matplotlib is an optional extra (``plot``), imported only here and only when a plot
is drawn. The figure is drawn on a ``Figure`` with the Agg
canvas, not through ``pyplot``: no global backend switch, no GUI, no state left
behind in the process.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmtier.extras import MissingExtraError, require

if TYPE_CHECKING:
    from lmtier_apps.demo.rows import DemoRow

__all__ = ["TIER_COLORS", "dominant_tier", "matplotlib_problem", "write_ttft_plot"]

TIER_COLORS = {
    "device": "#2ca02c",
    "cpu": "#1f77b4",
    "disk": "#ff7f0e",
    "sidecar": "#9467bd",
    "redis": "#d62728",
    "s3": "#8c564b",
    "none": "#bcbd22",
}
"""The colour of each serving tier's bars; a tier not listed is drawn in black."""
_NO_CACHE_COLOR = "#b0b0b0"
_OTHER_TIER_COLOR = "#000000"


def matplotlib_problem() -> str | None:
    """A one-line message when matplotlib cannot be imported, else None; checked before
    the demo runs, so a missing extra does not cost a whole run."""
    try:
        require("plot", what="--plot")
    except MissingExtraError as exc:
        return str(exc)
    return None


def dominant_tier(tiers: dict[str, int]) -> str:
    """The tier that served the most tokens (the first one listed on a tie; "none"
    when nothing was cached)."""
    served = {tier: tokens for tier, tokens in tiers.items() if tokens > 0}
    return max(served, key=lambda tier: served[tier]) if served else "none"


def write_ttft_plot(
    rows: Sequence[DemoRow],
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    sidecar: bool = False,
) -> None:
    """Write a PNG of the rows' TTFT with and without lmtier to ``path``. ``sidecar``:
    the cache was a sidecar's, so every tier but the in-process device tier is drawn as
    "sidecar" (its hits report the sidecar's own tier names, cpu or disk)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415 - optional
    from matplotlib.figure import Figure  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415

    width = 0.38
    positions = list(range(len(rows)))
    tiers = [dominant_tier(row.tiers) for row in rows]
    if sidecar:
        tiers = [tier if tier in ("device", "none") else "sidecar" for tier in tiers]
    figure = Figure(figsize=(max(7.0, 0.9 * len(rows) + 4.0), 4.8), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.bar(
        [x - width / 2 for x in positions],
        [row.ttft_no_cache_ms for row in rows],
        width,
        color=_NO_CACHE_COLOR,
    )
    axes.bar(
        [x + width / 2 for x in positions],
        [row.ttft_ms for row in rows],
        width,
        color=[TIER_COLORS.get(tier, _OTHER_TIER_COLOR) for tier in tiers],
    )
    axes.set_xticks(positions, [row.request for row in rows], rotation=30, ha="right")
    axes.set_ylabel("time to first token (ms)")
    axes.set_xlabel("request")
    axes.set_title(title or "TTFT per request, without and with lmtier")
    legend = [Patch(color=_NO_CACHE_COLOR, label="without lmtier")]
    legend += [
        Patch(color=TIER_COLORS.get(tier, _OTHER_TIER_COLOR), label=f"with lmtier: {tier}")
        for tier in dict.fromkeys(tiers)  # the tiers present, in order of appearance
    ]
    # Beside the axes, not on them: a tall bar would hide under it.
    axes.legend(handles=legend, title="served by", loc="upper left", bbox_to_anchor=(1.01, 1))
    axes.grid(axis="y", alpha=0.3)
    figure.savefig(os.fspath(path), format="png", dpi=100)
