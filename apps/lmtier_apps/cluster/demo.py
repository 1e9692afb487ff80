"""``lmtier cluster demo``: KV computed on one node serves requests on another.

The workload client of the local cluster and of docker-compose's ``client`` service.
It speaks only HTTP: the engines' OpenAI API (``lmtier demo serve`` reports the
cached prompt tokens per serving tier, its TTFT and, with ``--check-logits``, the
largest logit difference from a full prefill in each response's usage block), the
sidecars' ``/metrics`` when known, and Redis (a FLUSHDB) when given its URL.

The story, one row per request (:data:`PHASES`):

1. node A computes a long prompt P1: nothing is cached anywhere;
2. node B gets P1 from node A's memory: its own CPU and disk tiers do not hold it, and
   the peer directory says A's CPU tier does (the ``peer`` tier), before Redis;
3. node A computes P2 and P3; A's memory is emptied (its sidecar restarts: the
   ``forget_a`` hook, which ``lmtier cluster demo --dir`` has; without it the phase
   and the next are skipped, with a note); node B gets P2 from Redis;
4. Redis is flushed; node B gets P3 from S3;
5. node B gets P1 again: now from its own CPU tier (the peer hit was promoted).

Each row also runs its prompt under a fresh random ``cache_salt``: the salt makes
every chunk key different, so that is a cold prefill of the same tokens, the row's
"TTFT without cache". Prompts are new on every run (a random run id starts them), so
a rerun on the same cluster tells the same story.

Between requests the demo waits until the node's sidecar has written what the
request stored to its lower tiers and published it in the peer directory: its write
queues are empty and its ``puts`` counters have grown by the chunks stored
(:mod:`.writes`, from ``/metrics``). Otherwise node B could ask before A's writes
reached Redis or the directory. Without a metrics URL (``--metrics``)
nothing is awaited and the output says so. Each wait has a deadline; a wait that
ends there is a note, not a failure.
"""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmtier_apps.cluster.health import LOCAL_OPENER, http_problem
from lmtier_apps.cluster.state import ClusterError
from lmtier_apps.cluster.writes import WriteWatch

__all__ = [
    "DEFAULT_PROMPT_TOKENS",
    "PHASES",
    "Completion",
    "EngineClient",
    "Node",
    "Phase",
    "Row",
    "Story",
    "StoryResult",
    "flush_redis",
    "post_completion",
]

DEFAULT_PROMPT_TOKENS = 1537
"""Six full chunks of 256 tokens, plus the last prompt token (always computed)."""
SETTLE_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class Node:
    """A node as the demo sees it: its engine's URL, its sidecar's ``/metrics`` URL."""

    name: str
    engine_url: str
    metrics_url: str | None = None

    def __post_init__(self) -> None:
        for url in (self.engine_url, self.metrics_url):
            if url is not None and not url.startswith(("http://", "https://")):
                raise ClusterError(f"node {self.name}: {url!r} is not an http(s) URL")


@dataclass(frozen=True, slots=True)
class Completion:
    """What one response's usage block says."""

    prompt_tokens: int
    cached_tokens: int
    tiers: dict[str, int]
    ttft_ms: float
    max_logit_diff: float | None


class EngineClient:
    """``POST /v1/completions`` of one engine: one token, greedy, the usage parsed."""

    def __init__(self, node: Node, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.node = node
        self.timeout_s = timeout_s

    def complete(self, prompt: str, cache_salt: str | None = None) -> Completion:
        """Send ``prompt``; ClusterError (status and message) when the engine refuses."""
        body: dict[str, object] = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        where = f"node {self.node.name}'s engine ({self.node.engine_url})"
        _, reply = post_completion(
            self.node.engine_url, body, where=where, timeout_s=self.timeout_s
        )
        usage = reply.get("usage") or {}
        lmtier = usage.get("lmtier") or {}
        details = usage.get("prompt_tokens_details") or {}
        diff = lmtier.get("max_logit_diff")
        return Completion(
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            cached_tokens=int(details.get("cached_tokens") or 0),
            tiers={str(k): int(v) for k, v in (lmtier.get("cached_tokens_by_tier") or {}).items()},
            ttft_ms=float(lmtier.get("ttft_ms", 0.0)),
            max_logit_diff=None if diff is None else float(diff),
        )


def post_completion(
    url: str,
    body: dict[str, object],
    *,
    where: str,
    headers: dict[str, str] | None = None,
    timeout_s: float = REQUEST_TIMEOUT_S,
) -> tuple[dict[str, str], dict[str, Any]]:
    """``POST <url>/v1/completions`` of ``body``: the response's headers (names in
    lower case) and JSON;
    ClusterError naming ``where`` (the status and the start of the body) otherwise."""
    request = urllib.request.Request(  # noqa: S310 - http(s): the callers check
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with LOCAL_OPENER.open(request, timeout=timeout_s) as response:
            headers = {name.lower(): value for name, value in response.headers.items()}
            return headers, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:  # its socket, closed now rather than by the garbage collector
            detail = exc.read().decode(errors="replace")[:300]
        raise ClusterError(f"{where} answered HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ClusterError(f"{where} failed: {getattr(exc, 'reason', exc)}") from None


@dataclass(slots=True)
class Row:
    """One request of the story and its cold twin (the same prompt, a fresh salt)."""

    phase: int
    step: str
    node: str
    prompt: str
    prompt_tokens: int
    cached_tokens: int
    tiers: dict[str, int]
    expected_tier: str
    """The tier the story expects to serve it ("none": computed)."""
    ttft_ms: float
    ttft_no_cache_ms: float
    max_logit_diff: float | None

    @property
    def speedup(self) -> float:
        return self.ttft_no_cache_ms / self.ttft_ms if self.ttft_ms else 0.0

    @property
    def as_expected(self) -> bool:
        served = {tier for tier, tokens in self.tiers.items() if tokens > 0}
        return served == ({self.expected_tier} - {"none"})


@dataclass(slots=True)
class StoryResult:
    """The rows, and the notes on what could not be done or did not go as told."""

    nodes: list[Node]
    chunk_size: int
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


Phase = Callable[["Story"], None]
"""One step of the story: makes requests through :meth:`Story.row`, adds rows."""


class Story:
    """Runs :data:`PHASES` against two nodes, A (``nodes[0]``) and B (``nodes[1]``).
    ``redis_url``: the shared Redis, for phase 4's flush (None skips the phase);
    ``forget_a``: empties node A's memory, for phases 3 and 4 (None skips them);
    ``chunk_size``: the cluster's (what a stored prompt's chunks are counted in)."""

    def __init__(
        self,
        nodes: Sequence[Node],
        *,
        redis_url: str | None = None,
        chunk_size: int = 256,
        prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
        settle_timeout_s: float = SETTLE_TIMEOUT_S,
        phases: Sequence[Phase] | None = None,
        forget_a: Callable[[], None] | None = None,
    ) -> None:
        if len(nodes) < 2:
            raise ClusterError(f"the demo needs two nodes (A and B), got {len(nodes)}")
        self.a, self.b = nodes[0], nodes[1]
        self.redis_url = redis_url
        self.forget_a = forget_a
        """Empties node A's memory (its CPU tier) when called; None: the demo cannot."""
        self.prompt_tokens = prompt_tokens
        self.settle_timeout_s = settle_timeout_s
        self.phases = list(PHASES if phases is None else phases)
        self.result = StoryResult([self.a, self.b], chunk_size)
        self.run_id = secrets.token_hex(4)
        self.phase = 0
        self._clients = {node.name: EngineClient(node) for node in (self.a, self.b)}

    def run(self) -> StoryResult:
        """Check both engines answer, warm them up, then run every phase."""
        for node in (self.a, self.b):
            problem = http_problem(f"{node.engine_url}/health")
            if problem is not None:
                raise ClusterError(f"node {node.name}'s engine: {problem}")
            if node.metrics_url is None:
                self.note(
                    f"node {node.name}: no metrics URL, so its writes to Redis and S3 are "
                    "not awaited and a row may show a lower tier than expected (--metrics)"
                )
        for node in (self.a, self.b):  # first-request costs (kernels, mappings) off the rows
            warm = self.prompt(f"warm-up {node.name}", 2 * self.result.chunk_size + 8)
            salt = secrets.token_hex(8)
            self._call(node, warm, salt)
            self._call(node, warm, salt)
        for number, phase in enumerate(self.phases, start=1):
            self.phase = number
            phase(self)
        return self.result

    def note(self, text: str) -> None:
        """Add a note to the result (once: a problem of every request is said once)."""
        if text not in self.result.notes:
            self.result.notes.append(text)

    def prompt(self, name: str, tokens: int | None = None) -> str:
        """The text of prompt ``name``: ``tokens`` tokens with the demo's byte tokenizer
        (one per byte, and ``<s>``), unique to this run from its first chunk on."""
        length = (tokens or self.prompt_tokens) - 1
        text = f"[lmtier cluster demo {self.run_id}, {name}] "
        sentence = 0
        while len(text) < length:
            sentence += 1
            text += f"Sentence {sentence} of {name}: every node may be asked about it. "
        return text[:length]

    def row(self, node: Node, prompt: str, *, step: str, expected: str) -> Row:
        """Send prompt ``prompt`` (a name) to ``node``, then the same under a fresh salt;
        the row is added to the result and returned."""
        text = self.prompt(prompt)
        done = self._call(node, text, None)
        cold = self._call(node, text, secrets.token_hex(8))
        row = Row(
            self.phase,
            step,
            node.name,
            prompt,
            done.prompt_tokens,
            done.cached_tokens,
            done.tiers,
            expected,
            done.ttft_ms,
            cold.ttft_ms,
            done.max_logit_diff,
        )
        self.result.rows.append(row)
        if not row.as_expected:
            served = ", ".join(f"{t} {n}" for t, n in row.tiers.items()) or "nothing cached"
            self.note(f"phase {self.phase} ({step}): expected {expected}, got {served}")
        return row

    def _call(self, node: Node, text: str, salt: str | None) -> Completion:
        """One request, then the wait for the writes it caused (module docstring)."""
        watch = WriteWatch(node.metrics_url) if node.metrics_url else None
        done = self._clients[node.name].complete(text, salt)
        if watch is None:
            return done
        size = self.result.chunk_size
        stored = done.prompt_tokens // size - done.cached_tokens // size
        if watch.before is None:
            self.note(f"node {node.name}: its /metrics did not answer; writes not awaited")
        elif not watch.wait(stored, self.settle_timeout_s):
            self.note(
                f"node {node.name}: its sidecar's writes did not settle within "
                f"{self.settle_timeout_s:.0f} s (see its /metrics)"
            )
        return done


def flush_redis(url: str) -> None:
    """FLUSHDB on the Redis at ``url``, on every primary when it is a Redis Cluster
    (compose's ``redis-cluster`` profile): every chunk the cluster wrote there is gone."""
    import redis  # noqa: PLC0415 - the redis extra
    from redis.cluster import RedisCluster  # noqa: PLC0415

    timeouts: dict[str, float] = {"socket_timeout": 5.0, "socket_connect_timeout": 5.0}
    client = redis.Redis.from_url(url, **timeouts)
    try:
        if client.info("cluster").get("cluster_enabled"):
            with RedisCluster.from_url(url, **timeouts) as cluster:
                cluster.flushdb(target_nodes=RedisCluster.PRIMARIES)
        else:
            client.flushdb()
    except redis.RedisError as exc:
        raise ClusterError(f"cannot flush Redis: {type(exc).__name__}: {exc}") from None
    finally:
        client.close()


def cold_on_a(story: Story) -> None:
    """Phase 1: node A computes P1; nothing is cached anywhere."""
    story.row(story.a, "P1", step="A computes P1", expected="none")


def peer_on_b(story: Story) -> None:
    """Phase 2: node B gets P1 from node A's CPU tier (peer), before Redis and S3."""
    story.row(story.b, "P1", step="B gets P1 from A's memory", expected="peer")


def redis_on_b(story: Story) -> None:
    """Phase 3: node A computes P2 and P3, then loses its memory; B gets P2 from Redis."""
    if story.forget_a is None:
        story.note(
            "phases 3-4 (B served from Redis, then S3) skipped: they empty node A's memory "
            "(restart its sidecar), which only `lmtier cluster demo --dir` can do"
        )
        return
    story.row(story.a, "P2", step="A computes P2", expected="none")
    story.row(story.a, "P3", step="A computes P3", expected="none")
    story.forget_a()
    story.row(story.b, "P2", step="A's memory gone, B gets P2 from Redis", expected="redis")


def s3_on_b(story: Story) -> None:
    """Phase 4: Redis is flushed; node B gets P3 (computed in phase 3) from S3."""
    if story.forget_a is None:
        return  # said in phase 3
    if story.redis_url is None:
        story.note("phase 4 (B served from S3) skipped: it flushes Redis; pass --redis-url")
        return
    flush_redis(story.redis_url)
    story.row(story.b, "P3", step="Redis flushed, B gets P3 from S3", expected="s3")


def promoted_on_b(story: Story) -> None:
    """Phase 5: node B gets P1 again: its CPU tier kept what the peer served in phase 2."""
    story.row(story.b, "P1", step="B gets P1 again (promoted)", expected="cpu")


PHASES: tuple[Phase, ...] = (cold_on_a, peer_on_b, redis_on_b, s3_on_b, promoted_on_b)
"""The story in order (``Story(phases=...)`` takes another list)."""
