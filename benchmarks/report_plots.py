"""The plots of benchmarks/report.py: matplotlib (Agg), imported only when a plot is drawn.

Each function draws one PNG from figures report.py has already taken out of the
benchmarks' JSON, so the plots can be rebuilt from saved JSON (``--from-json``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtier.extras import install_command

INSTALL_HINT = install_command("plot")
COLORS = {"met": "tab:green", "missed": "tab:red", "none": "tab:blue"}


@dataclass(frozen=True, slots=True)
class Ratio:
    """One figure of a tier against the physical baseline measured in the same run:
    ``value`` > 1 means faster than the baseline."""

    tier: str
    what: str
    value: float
    baseline: str
    target: float | None = None
    figures: str = ""

    @property
    def verdict(self) -> str:
        if self.target is None:
            return "none"
        return "met" if self.value >= self.target else "missed"


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display), or a clear exit."""
    try:
        import matplotlib  # noqa: PLC0415  (an optional extra: imported when plotting)
    except ImportError:
        raise SystemExit(
            f"benchmarks/report.py draws its plots with matplotlib, which is not installed: "
            f"{INSTALL_HINT}"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def tiers_plot(ratios: Sequence[Ratio], path: Path) -> None:
    """Plot 1: one panel per tier, a horizontal bar per ratio from the baseline (1.0)
    to the figure, on a log axis (2x faster and 2x slower look alike), with targets."""
    plt = pyplot()
    from matplotlib.lines import Line2D  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # noqa: PLC0415
    from matplotlib.transforms import blended_transform_factory  # noqa: PLC0415

    tiers = list(dict.fromkeys(r.tier for r in ratios))
    rows = [[r for r in ratios if r.tier == tier] for tier in tiers]
    values = [r.value for r in ratios] + [r.target for r in ratios if r.target]
    low, high = min(0.5, min(values) / 1.6), max(2.0, max(values) * 1.6)
    fig, axes = plt.subplots(
        len(tiers),
        1,
        figsize=(10, 1.4 + 0.42 * len(ratios) + 0.5 * len(tiers)),
        sharex=True,
        gridspec_kw={"height_ratios": [len(r) + 0.6 for r in rows]},
        squeeze=False,
    )
    for ax, tier, group in zip(axes[:, 0], tiers, rows, strict=True):
        ys = range(len(group))[::-1]
        label_at = blended_transform_factory(ax.transAxes, ax.transData)  # x: right margin
        for y, r in zip(ys, group, strict=True):
            ax.barh(y, r.value - 1, left=1, height=0.6, color=COLORS[r.verdict], alpha=0.85)
            color = "tab:red" if r.verdict == "missed" else "black"
            ax.text(1.01, y, f"{r.value:.2f}x", transform=label_at, va="center", color=color)
            if r.target is not None:
                ax.plot([r.target], [y], marker="|", color="black", markersize=18, mew=2.5)
        ax.set_yticks(list(ys), [r.what for r in group], fontsize=9)
        ax.set_ylim(-0.7, len(group) - 0.3)
        ax.axvline(1.0, color="0.3", linestyle="--", linewidth=1)
        ax.set_title(f"{tier}: against {group[0].baseline}", loc="left", fontsize=10)
        ax.grid(axis="x", color="0.9")
        ax.set_axisbelow(True)
    ax = axes[-1, 0]
    ax.set_xscale("log")
    ax.set_xlim(low, high)
    ticks = [t for t in (0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 50) if low <= t <= high]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}x"))
    ax.set_xlabel("tier / baseline, same run (throughput ratio; > 1: faster than the baseline)")
    legend = [
        Patch(color=COLORS["met"], label="target met"),
        Patch(color=COLORS["missed"], label="below target"),
        Patch(color=COLORS["none"], label="no target"),
        Line2D([], [], color="black", marker="|", markersize=12, mew=2.5, ls="", label="target"),
        Line2D([], [], color="0.3", linestyle="--", label="baseline (1.0x)"),
    ]
    fig.legend(handles=legend, loc="lower center", ncol=5, fontsize=9, frameon=False)
    fig.suptitle("Each tier against its physical baseline, measured in the same run", fontsize=12)
    fig.tight_layout(rect=(0, 0.025, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ttft_plot(
    points: Sequence[dict[str, Any]], extras: dict[str, tuple[int, float]], title: str, path: Path
) -> None:
    """Plot 2: TTFT against the cached prefix's length, lmtier and the ideal, and the
    disk-tier points (``extras``: label -> (cached tokens, ms))."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.2))
    xs = [p["cached_tokens"] for p in points]
    ax.plot(
        xs,
        [p["ideal_ms"] for p in points],
        "o--",
        color="0.35",
        label="ideal: KV already in the model's cache",
    )
    ax.plot(
        xs,
        [p["cpu_tier_ms"] for p in points],
        "o-",
        color="tab:blue",
        lw=2,
        label="lmtier, served from the CPU tier",
    )
    for (label, (x, ms)), marker, color in zip(
        extras.items(), "sD^", ("tab:purple", "tab:orange", "tab:brown"), strict=False
    ):
        ax.plot([x], [ms], marker=marker, ls="", color=color, markersize=8, label=label)
    for p in points:
        ax.annotate(
            f"{p['cpu_tier_ms']:.0f} ms",
            (p["cached_tokens"], p["cpu_tier_ms"]),
            textcoords="offset points",
            xytext=(8, -14),
            fontsize=9,
        )
    total = points[0]["cached_tokens"] + points[0]["computed_tokens"]
    ax.set_xticks(xs, [f"{x}\n({x / total:.0%})" for x in xs])
    ax.set_xlabel(f"cached prefix, tokens of the {total}-token prompt")
    ax.set_ylabel("time to first token, ms")
    ax.set_ylim(0, max(p["cpu_tier_ms"] for p in points) * 1.15)
    ax.grid(color="0.9")
    ax.legend(fontsize=9)
    ax.set_title(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def capacity_plot(rows: Sequence[dict[str, Any]], ideal: float, title: str, path: Path) -> None:
    """Plot 3: token hit ratio against the CPU tier's capacity (a share of the working
    set), measured and LRU-simulated, with the ideal cache as a ceiling."""
    plt = pyplot()
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(9, 5.2))
    xs = [100 * r["capacity_fraction"] for r in rows]
    measured = [r["token_hit_ratio"] for r in rows]
    ax.plot(xs, measured, "o-", lw=5, ms=12, color="tab:blue", alpha=0.6, label="lmtier, replayed")
    lru = [r["lru_hit_ratio"] for r in rows]  # drawn thin over lmtier's: both show when equal
    label = "LRU of the same capacity, simulated"
    ax.plot(xs, lru, "s--", lw=1.5, ms=6, color="black", mfc="none", label=label)
    ax.axhline(
        ideal, color="tab:green", linestyle=":", lw=2, label=f"ideal, infinite cache ({ideal:.3f})"
    )
    for x, r in zip(xs, rows, strict=True):
        ax.annotate(
            f"{r['token_hit_ratio']:.3f}\n{r['capacity_mib']:g} MiB",
            (x, r["token_hit_ratio"]),
            textcoords="offset points",
            xytext=(0, -30),
            ha="center",
            fontsize=8,
        )
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(xs))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}%"))
    ax.set_xlabel("CPU tier capacity, share of the trace's working set (distinct chunks)")
    ax.set_ylabel("token hit ratio (tokens served from the cache / prompt tokens)")
    ax.set_ylim(0, min(1.0, ideal * 1.15))
    ax.grid(color="0.9")
    ax.legend(fontsize=9, loc="lower right")
    ax.set_title(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
