"""``lmtier cluster demo``'s last act: conversations through ``lmtier route``, once
routed round-robin and once KV-aware, each request's node and why, and the hit ratio
and TTFT of each policy.

Each policy runs its conversations under a cache salt of its own (a tenant of its
own: its keys share nothing with the other run's), turn after turn, every turn the
conversation so far plus a new message, through one router that is told the policy
per request (``x-lmtier-policy``). The router's ``x-lmtier-route`` header says which
node it chose and the cached tokens by tier that decided it; the engine's usage says
what its node then served, and from which tier.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from lmtier_apps.cluster.demo import post_completion

__all__ = ["POLICIES", "RoutedRow", "RoutingResult", "print_routing", "run_routing"]

POLICIES = ("round-robin", "kv-aware")


@dataclass(frozen=True, slots=True)
class RoutedRow:
    """One request through the router."""

    policy: str
    conversation: int
    turn: int
    node: str
    why: dict[str, int]
    """The cached tokens by tier that the router saw on that node."""
    prompt_tokens: int
    served: dict[str, int]
    """What the node's cache served, by tier (the engine's usage)."""
    ttft_ms: float


@dataclass(slots=True)
class RoutingResult:
    """The rows, and per policy: requests, prompt tokens, tokens served from the
    chosen node's own memory and from any tier, mean TTFT."""

    router_url: str
    rows: list[RoutedRow] = field(default_factory=list)

    def summary(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for policy in POLICIES:
            rows = [row for row in self.rows if row.policy == policy]
            tokens = sum(row.prompt_tokens for row in rows) or 1
            out[policy] = {
                "requests": len(rows),
                "local_hit_ratio": round(sum(r.served.get("cpu", 0) for r in rows) / tokens, 3),
                "hit_ratio": round(sum(sum(r.served.values()) for r in rows) / tokens, 3),
                "mean_ttft_ms": round(sum(r.ttft_ms for r in rows) / max(1, len(rows)), 1),
            }
        return out


def run_routing(
    router_url: str, *, conversations: int = 4, turns: int = 3, api_key: str | None = None
) -> RoutingResult:
    """The conversations under each policy (module docstring); ClusterError when the
    router refuses a request (:func:`~.demo.post_completion`)."""
    result = RoutingResult(router_url)
    run = secrets.token_hex(4)
    for policy in POLICIES:
        salt = secrets.token_hex(8)
        talks = [_opening(run, policy, c) for c in range(conversations)]
        for turn in range(turns):
            for number, history in enumerate(talks):
                row, reply = _request(
                    router_url, policy, salt, history, conversation=number, turn=turn, key=api_key
                )
                result.rows.append(row)
                talks[number] = f"{history}{reply} Then the user asks about turn {turn + 1}. "
    return result


def _opening(run: str, policy: str, conversation: int) -> str:
    text = f"[cluster demo {run}, {policy}, conversation {conversation}] "
    sentence = 0
    while len(text) < 1100:  # four chunks of 256 and more: worth routing for
        sentence += 1
        text += f"Fact {sentence} of conversation {conversation}: the fleet keeps it. "
    return text


def _request(
    url: str,
    policy: str,
    salt: str,
    prompt: str,
    *,
    conversation: int,
    turn: int,
    key: str | None,
) -> tuple[RoutedRow, str]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "cache_salt": salt}
    headers = {"x-lmtier-policy": policy}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    answered, reply = post_completion(url, body, where=f"the router ({url})", headers=headers)
    route: dict[str, Any] = json.loads(answered.get("x-lmtier-route") or "{}")
    usage = reply.get("usage") or {}
    lmtier = usage.get("lmtier") or {}
    row = RoutedRow(
        policy,
        conversation,
        turn,
        str(route.get("engine", "?")),
        {str(k): int(v) for k, v in (route.get("cached_tokens") or {}).items()},
        int(usage.get("prompt_tokens", 0)),
        {str(k): int(v) for k, v in (lmtier.get("cached_tokens_by_tier") or {}).items()},
        float(lmtier.get("ttft_ms", 0.0)),
    )
    return row, str((reply.get("choices") or [{}])[0].get("text", ""))


def print_routing(result: RoutingResult, out: Any) -> None:
    """The rows and the summary, as a table."""
    print(f"\nthrough the router ({result.router_url}):", file=out)
    header = (
        f"{'policy':<12} {'conv':>4} {'turn':>4} {'node':<8} {'router saw':<22} "
        f"{'served':<22} {'TTFT ms':>8}"
    )
    print(header, file=out)
    print("-" * len(header), file=out)
    for row in result.rows:
        why = ", ".join(f"{t} {n}" for t, n in row.why.items()) or "-"
        served = ", ".join(f"{t} {n}" for t, n in row.served.items()) or "-"
        print(
            f"{row.policy:<12} {row.conversation:>4} {row.turn:>4} {row.node:<8} "
            f"{why:<22} {served:<22} {row.ttft_ms:>8.1f}",
            file=out,
        )
    print("-" * len(header), file=out)
    for policy, figures in result.summary().items():
        print(
            f"{policy:<12} hit ratio {figures['hit_ratio']:.3f} (own memory "
            f"{figures['local_hit_ratio']:.3f}), mean TTFT {figures['mean_ttft_ms']:.1f} ms",
            file=out,
        )
