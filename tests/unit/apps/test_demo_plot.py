"""``lmtier demo --plot``'s picture: a valid PNG from the rows a demo measured, bars
coloured by the tier that served most of each request, and a one-line error naming
the extra to install when matplotlib is missing."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from lmtier.extras import install_command
from lmtier_apps.demo.plot import (
    TIER_COLORS,
    dominant_tier,
    matplotlib_problem,
    write_ttft_plot,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def demo_rows() -> list[Any]:
    pytest.importorskip("torch")
    from lmtier_apps.demo.rows import DemoRow

    served = [{}, {"device": 1536}, {"disk": 1536}, {"device": 512, "disk": 256}, {"cpu": 2560}]
    return [
        DemoRow(
            request=f"request {index}",
            prompt_tokens=1600,
            cached_tokens=sum(tiers.values()),
            tiers=tiers,
            ttft_ms=600.0 if not tiers else 70.0 + index,
            ttft_no_cache_ms=600.0 + index,
            max_logit_diff=0.0,
        )
        for index, tiers in enumerate(served)
    ]


def test_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "ttft.png"
    write_ttft_plot(demo_rows(), out, title="TTFT")
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000  # bars, labels and a legend, not an empty canvas


def test_a_sidecar_run_is_drawn_too(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "sidecar.png"
    write_ttft_plot(demo_rows(), out, sidecar=True)
    assert out.read_bytes().startswith(PNG_SIGNATURE)


def test_dominant_tier() -> None:
    assert dominant_tier({}) == "none"
    assert dominant_tier({"device": 0}) == "none"
    assert dominant_tier({"device": 512, "disk": 256}) == "device"
    assert dominant_tier({"device": 256, "cpu": 1280}) == "cpu"
    assert set(TIER_COLORS) >= {"device", "cpu", "disk", "sidecar", "none"}


def test_missing_matplotlib_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name == "matplotlib" else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    problem = matplotlib_problem()
    assert problem is not None
    assert problem.endswith(install_command("plot"))  # lmtier is on no index: the checkout's
    assert "\n" not in problem
