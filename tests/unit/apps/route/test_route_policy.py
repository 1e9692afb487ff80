"""The router's choice (lmtier_apps.route.policy): kv-aware takes the node that holds
the most of the prompt, weighted by tier, unless it is much busier; round-robin
cycles; least-loaded takes the idlest; the router's own record fills the index's lag;
an engine excluded (it failed) is never chosen again for that request."""

from __future__ import annotations

from lmtier.testing import random_key
from lmtier_apps.route.policy import (
    TIER_WEIGHTS,
    Candidate,
    Holding,
    Recent,
    Turns,
    choose,
    with_recent,
)

CHUNK = 256


def candidate(name: str, load: int = 0, **by_tier: int) -> Candidate:
    return Candidate(name, load, holding=Holding(sum(by_tier.values()), dict(by_tier)))


def pick(policy: str, *candidates: Candidate, turns: Turns | None = None, **options: object) -> str:
    choice = choose(policy, candidates, turns or Turns(), chunk_size=CHUNK, **options)  # type: ignore[arg-type]
    assert choice is not None
    return choice.name


def test_kv_aware_takes_the_most_cached_prefix_weighted_by_tier() -> None:
    assert pick("kv-aware", candidate("a", cpu=2), candidate("b", cpu=5)) == "b"
    assert pick("kv-aware", candidate("a", cpu=4), candidate("b", disk=5)) == "a", (
        "memory beats disk"
    )
    assert TIER_WEIGHTS["cpu"] > TIER_WEIGHTS["disk"] > TIER_WEIGHTS["redis"] > TIER_WEIGHTS["s3"]
    # A tier every node reads adds the same to all: the node's own memory decides.
    assert pick("kv-aware", candidate("a", redis=6), candidate("b", cpu=1, redis=5)) == "b"


def test_kv_aware_weighs_the_cached_prefix_against_load() -> None:
    cached, idle = candidate("a", load=1, cpu=4), candidate("b", load=0)
    assert pick("kv-aware", cached, idle) == "a", "one request more is worth less than 4 chunks"
    busy = candidate("a", load=8, cpu=4)
    assert pick("kv-aware", busy, idle) == "b", "far busier: the cached prefix is not worth it"
    assert pick("kv-aware", busy, idle, load_tokens=1) == "a"


def test_ties_go_to_the_less_loaded_then_in_turn() -> None:
    turns = Turns()
    chosen = [pick("kv-aware", candidate("a"), candidate("b"), turns=turns) for _ in range(4)]
    assert sorted(chosen) == ["a", "a", "b", "b"]
    assert pick("kv-aware", candidate("a", load=2), candidate("b", load=1)) == "b"


def test_round_robin_cycles_and_least_loaded_takes_the_idlest() -> None:
    turns = Turns()
    names = [
        pick("round-robin", candidate("a", cpu=9), candidate("b"), turns=turns) for _ in range(4)
    ]
    assert names in (["a", "b", "a", "b"], ["b", "a", "b", "a"]), "cache is ignored"
    assert (
        pick("least-loaded", candidate("a", 3, cpu=9), candidate("b", 1), candidate("c", 2)) == "b"
    )


def test_excluded_engines_are_never_chosen() -> None:
    pool = [candidate("a", cpu=9), candidate("b")]
    choice = choose("kv-aware", pool, Turns(), chunk_size=CHUNK, exclude={"a": True})
    assert choice is not None and choice.name == "b"
    assert choose("kv-aware", pool, Turns(), chunk_size=CHUNK, exclude={"a": 1, "b": 1}) is None
    assert choose("kv-aware", [], Turns(), chunk_size=CHUNK) is None


def test_the_routers_own_record_fills_the_index_lag() -> None:
    recent = Recent(limit=4)
    keys = [random_key() for _ in range(6)]
    recent.remember(keys[:3], "a")
    assert recent.leading(keys, "a") == 3 and recent.leading(keys, "b") == 0
    holding = with_recent(Holding(1, {"cpu": 1}), recent.leading(keys, "a"))
    assert holding.chunks == 3 and holding.by_tier == {"cpu": 1, "routed": 2}
    assert with_recent(Holding(4, {"disk": 4}), 3).by_tier == {"disk": 4}, "the index knows more"
    recent.remember(keys[3:], "b")  # past the limit: the oldest go
    assert recent.leading(keys, "a") == 0
    recent.forget("b")
    assert recent.leading(keys[3:], "b") == 0


def test_a_choice_reports_why() -> None:
    choice = choose("kv-aware", [candidate("a", 2, cpu=3, disk=1)], Turns(), chunk_size=CHUNK)
    assert choice is not None
    assert choice.cached_tokens == {"cpu": 3 * CHUNK, "disk": CHUNK}
    assert choice.load == 2 and choice.policy == "kv-aware" and choice.score is not None
