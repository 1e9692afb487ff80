"""What ``lmtier demo`` measures per request: :class:`DemoRow`.

A module of its own, with no torch, because the demo (:mod:`.demo`) fills the rows
and the plot (:mod:`.plot`) and ``lmtier cluster demo``'s report draw them: with the
row here, neither of those imports the demo, and the demo imports the plot one way.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DemoRow"]


@dataclass(slots=True)
class DemoRow:
    """What one request measured."""

    request: str
    prompt_tokens: int
    cached_tokens: int
    tiers: dict[str, int]
    ttft_ms: float
    ttft_no_cache_ms: float
    max_logit_diff: float

    @property
    def speedup(self) -> float:
        return self.ttft_no_cache_ms / self.ttft_ms if self.ttft_ms else 0.0
