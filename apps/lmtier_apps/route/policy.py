"""Which engine a request goes to: ``kv-aware``, ``round-robin`` or ``least-loaded``.

``kv-aware`` scores each healthy engine by the prompt tokens its node can serve from
cache, weighted by how fast the tier is, against its load::

    score = sum over tiers of cached_tokens[tier] * TIER_WEIGHTS[tier]
            - load_tokens * (requests in flight + requests the engine says are waiting)

and takes the highest (ties: the less loaded, then the next in turn). The cached
tokens are the node's leading run of the prompt's chunks (:class:`Holding`): the
fleet index's answer, lengthened by what this router sent to that engine itself and
the index does not show yet (tier ``routed``: the engine stores what it computes, so
a conversation's next turn finds it there even within the index's lag). A tier every
node reads (Redis, S3) adds the same to every engine, so it never decides alone;
memory and disk do. ``load_tokens`` is what one queued request is worth in prompt
tokens: with the default (:data:`LOAD_TOKENS`, two chunks of 256) a node holding
several chunks more of the prompt in memory wins over one with a request fewer in
flight, and a node far busier than the others loses even its cached prefix.

Without the index (down, slow, or not configured) ``kv-aware`` is ``least-loaded``
over the router's own knowledge (tier ``routed``).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lmtier.chunks.keys import ChunkKey
from lmtier_backends.fleet.index import Holding

__all__ = [
    "LOAD_TOKENS",
    "POLICIES",
    "TIER_WEIGHTS",
    "Candidate",
    "Choice",
    "Holding",
    "Recent",
    "choose",
]

POLICIES = ("kv-aware", "round-robin", "least-loaded")
TIER_WEIGHTS: dict[str, float] = {
    "cpu": 1.0,
    "routed": 0.9,
    "disk": 0.6,
    "redis": 0.4,
    "s3": 0.25,
    "other": 0.25,
}
"""A cached token's worth by tier: roughly its load speed against host memory's on
the machines the benchmarks ran on (benchmarks/README.md)."""
LOAD_TOKENS = 512
"""Default worth of one request in flight or waiting, in prompt tokens."""


@dataclass(slots=True)
class Candidate:
    """One healthy engine as the router sees it now."""

    name: str
    in_flight: int
    waiting: int = 0
    holding: Holding = field(default_factory=Holding)

    @property
    def load(self) -> int:
        return self.in_flight + self.waiting


@dataclass(frozen=True, slots=True)
class Choice:
    """The engine chosen, and why (what the router reports per request)."""

    name: str
    policy: str
    cached_tokens: dict[str, int]
    load: int
    score: float | None = None


class Recent:
    """Chunks this router sent to each engine lately: ``key -> engine``, the last
    ``limit`` keys (a bounded LRU). Thread-unsafe: one event loop owns it."""

    def __init__(self, limit: int = 262_144) -> None:
        self._keys: OrderedDict[ChunkKey, str] = OrderedDict()
        self._limit = limit

    def remember(self, keys: Sequence[ChunkKey], engine: str) -> None:
        for key in keys:
            self._keys[key] = engine
            self._keys.move_to_end(key)
        while len(self._keys) > self._limit:
            self._keys.popitem(last=False)

    def forget(self, engine: str) -> None:
        """An engine that failed may have lost what it held."""
        for key in [k for k, e in self._keys.items() if e == engine]:
            del self._keys[key]

    def leading(self, keys: Sequence[ChunkKey], engine: str) -> int:
        """How many leading ``keys`` were sent to ``engine``."""
        count = 0
        for key in keys:
            if self._keys.get(key) != engine:
                break
            count += 1
        return count


def with_recent(holding: Holding, routed: int) -> Holding:
    """``holding`` lengthened to ``routed`` chunks where the router's own record is
    longer (the extra chunks in tier ``routed``)."""
    if routed <= holding.chunks:
        return holding
    by_tier = dict(holding.by_tier)
    by_tier["routed"] = by_tier.get("routed", 0) + routed - holding.chunks
    return Holding(routed, by_tier)


def score(candidate: Candidate, chunk_size: int, load_tokens: int) -> float:
    """The ``kv-aware`` score (module docstring)."""
    cached = sum(
        n * chunk_size * TIER_WEIGHTS.get(tier, TIER_WEIGHTS["other"])
        for tier, n in candidate.holding.by_tier.items()
    )
    return cached - load_tokens * candidate.load


class Turns:
    """A round-robin turn counter (the tie-breaker of every policy)."""

    def __init__(self) -> None:
        self._count = itertools.count()

    def order(self, names: Sequence[str]) -> dict[str, int]:
        """Each name's place in this turn's order (0: its turn)."""
        start = next(self._count) % max(1, len(names))
        return {name: (i - start) % len(names) for i, name in enumerate(names)}


def choose(
    policy: str,
    candidates: Sequence[Candidate],
    turns: Turns,
    *,
    chunk_size: int,
    load_tokens: int = LOAD_TOKENS,
    exclude: Mapping[str, object] | None = None,
) -> Choice | None:
    """The engine for one request among ``candidates`` (healthy engines, in the
    router's order), or None when none is left after ``exclude``."""
    pool = [c for c in candidates if not exclude or c.name not in exclude]
    if not pool:
        return None
    order = turns.order([c.name for c in pool])
    if policy == "round-robin":
        best = min(pool, key=lambda c: order[c.name])
        value = None
    elif policy == "least-loaded":
        best = min(pool, key=lambda c: (c.load, order[c.name]))
        value = None
    else:
        scores = {c.name: score(c, chunk_size, load_tokens) for c in pool}
        best = max(pool, key=lambda c: (scores[c.name], -c.load, -order[c.name]))
        value = round(scores[best.name], 1)
    return Choice(best.name, policy, best.holding.tokens_by_tier(chunk_size), best.load, value)
