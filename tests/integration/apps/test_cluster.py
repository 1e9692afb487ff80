"""The local cluster (`lmtier cluster`): docker-compose.yml's topology as real processes.

One two-node cluster serves the module (redis-server, moto's S3 server, two sidecars,
two demo engines with --check-logits): node B is served, bit-exact, what node A
computed, from A's memory (peer), through Redis and then S3 (the demo's story); a
wrong token cannot use a sidecar nor fetch from a peer; a peer killed costs misses and
leaves the directory within its TTL; with Redis killed B is served from S3; with
A's sidecar killed both engines keep answering; `down` leaves no process (checked by
pid, and again by the fixture after any failure). Then the CLI: `up`, `status --json`,
`down` as processes.

The tests after the story break the cluster on purpose (Redis, then A's sidecar), so
they run in file order, and each waits on conditions with deadlines, never on time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

import lmtier
from lmtier import KVSpec, LMTier, load_config
from lmtier.errors import ConfigError
from lmtier_apps.cluster import commands
from lmtier_apps.cluster.demo import (
    Completion,
    EngineClient,
    Node,
    Story,
    flush_redis,
)
from lmtier_apps.cluster.launcher import CONFIG_FILES, LocalCluster
from lmtier_apps.cluster.routing import run_routing
from lmtier_apps.cluster.state import ClusterError, ClusterState, ProcessInfo, read_state
from lmtier_apps.cluster.trust import SERVER_NAME
from lmtier_apps.cluster.writes import scrape_tier_metrics
from support import ROOT
from support.redis_servers import RedisClusterProcesses, require_redis

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT_TOKENS = 1025  # four full chunks of 256 and the last token, always computed
CHUNK = 256
FULL = (PROMPT_TOKENS - 1) // CHUNK * CHUNK  # what a node can be served of such a prompt
MAX_LOGIT_DIFF = 1e-5
"""A cached prefill runs its matmuls over the suffix only, a different shape that BLAS
may sum in another order: the logits may differ in the last bits (~1e-6)."""
SIDECAR_ENV = {
    "LMTIER_CPU__CAPACITY_BYTES": "192MiB",
    "LMTIER_CPU__STAGING_BYTES": "64MiB",
    "LMTIER_PEER__TTL_S": "3",
}
"""Smaller pools than the config's 1.25 GiB (touched at start): room for ~90 chunks;
a dead node leaves the peer directory 3 s after its last heartbeat, not 15."""
GONE_TIMEOUT_S = 120.0
START_TIMEOUT_S = 300.0
SETTLE_TIMEOUT_S = 600.0
"""Hang guards, never reached when all is well: a process's exit, a start (an engine
gets three times it), the demo's wait for a node's writes (whose deadline, reached,
is a note, which a test counts as a failure). A loaded machine takes minutes."""


def _gone(pid: int) -> bool:
    """No process runs as ``pid``: none exists, or it is a zombie no one has reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True


def _wait_gone(info: ProcessInfo, cluster: LocalCluster) -> None:
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while info in cluster.running():  # running() reaps a child that exited
        assert time.monotonic() < deadline, f"{info.role} {info.pid} did not exit"
        time.sleep(0.05)


def _assert_no_process_left(state: ClusterState) -> None:
    """Every recorded pid is gone (our children are reaped by `down`), and so is every
    member of its process group."""
    for info in state.processes():
        with pytest.raises(ProcessLookupError):
            os.kill(info.pid, 0)
        with pytest.raises(ProcessLookupError):
            os.killpg(info.pid, 0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    require_redis()
    local = LocalCluster(
        tmp_path_factory.mktemp("cluster"),
        nodes=2,
        engine_args=["--check-logits"],
        sidecar_env=SIDECAR_ENV,
        start_timeout_s=START_TIMEOUT_S,
    )
    try:
        local.start()
        yield local
    finally:  # also after a failed start or test: nothing may outlive the module
        problems = local.down()
        with contextlib.suppress(ClusterError):  # no state: start failed before any process
            _assert_no_process_left(local.state)
        assert problems == []


def _story(cluster: LocalCluster, **kwargs: Any) -> Story:
    state = cluster.state
    nodes = [
        Node(name, node.engine_url or "", node.metrics_url)
        for name, node in zip("AB", state.nodes, strict=True)
    ]
    return Story(
        nodes,
        chunk_size=state.chunk_size,
        prompt_tokens=PROMPT_TOKENS,
        settle_timeout_s=SETTLE_TIMEOUT_S,
        **kwargs,
    )


def test_launcher_surfaces_it_depends_on(tmp_path: Path) -> None:
    from lmtier_apps.engine.serve import READY

    assert READY.format(url="") == commands.ENGINE_READY
    assert all((ROOT / path).is_file() for path in CONFIG_FILES.values())
    with pytest.raises(ConfigError, match=r"deploy/cluster/sidecar\.yaml"):
        LocalCluster(tmp_path / "c", deploy_dir=tmp_path).start()
    assert not (tmp_path / "c").exists()


def test_node_b_is_served_from_peer_redis_then_s3_bit_exact(cluster: LocalCluster) -> None:
    result = _story(
        cluster, redis_url=cluster.redis_url, forget_a=lambda: cluster.restart_sidecar(0)
    ).run()
    assert result.notes == []  # every write awaited, every row served as told
    assert [(r.phase, r.node, r.prompt, r.expected_tier) for r in result.rows] == [
        (1, "A", "P1", "none"),
        (2, "B", "P1", "peer"),
        (3, "A", "P2", "none"),
        (3, "A", "P3", "none"),
        (3, "B", "P2", "redis"),
        (4, "B", "P3", "s3"),
        (5, "B", "P1", "cpu"),
    ]
    for row in result.rows:
        served = {} if row.expected_tier == "none" else {row.expected_tier: FULL}
        assert row.tiers == served, row
        assert row.prompt_tokens == PROMPT_TOKENS
        assert row.cached_tokens == sum(row.tiers.values())
        assert row.max_logit_diff is not None and row.max_logit_diff <= MAX_LOGIT_DIFF, row


def _peer_only_cache(cluster: LocalCluster, spec: KVSpec, secret: str | None = None) -> LMTier:
    """An embedded cache in this process whose only lower tier is the peer tier (no
    Redis, S3 or disk): what it loads came from another node's memory. It holds the
    cluster's certificate and integrity key, and proves the node secret (or
    ``secret``)."""
    trust = cluster.trust
    peer: dict[str, object] = {
        "enabled": True,
        "directory_url": cluster.redis_url,
        "tls_ca_file": str(trust.ca),
        "tls_cert_file": str(trust.cert),
        "tls_key_file": str(trust.key),
        "tls_server_name": SERVER_NAME,
    }
    peer |= {"token": secret} if secret is not None else {"token_file": str(trust.node_secret)}
    config = load_config(
        env={},
        overrides={
            "cpu": {"capacity_bytes": "4MiB", "staging_bytes": "4MiB"},
            "disk": {"enabled": False},
            "peer": peer,
            "integrity": {"key_file": str(trust.integrity_key)},
        },
    )
    return LMTier.open(config, kv=spec, model_id="cluster/peer")


def test_the_router_sends_each_turn_where_its_prefix_is(cluster: LocalCluster) -> None:
    state = cluster.state
    assert state.router is not None and state.router_url
    names = {node.name for node in state.nodes}
    # Three conversations on two nodes: with two, round-robin sends each conversation
    # to the same node every turn (as kv-aware does), and the two ratios differed only
    # by the replies' lengths (0.557 against 0.558 in one run).
    routed = run_routing(state.router_url, conversations=3, turns=3)
    rows = [row for row in routed.rows if row.policy == "kv-aware"]
    assert {row.node for row in rows} <= names
    for conversation in (0, 1, 2):
        turns = [row for row in rows if row.conversation == conversation]
        assert len({row.node for row in turns}) == 1, f"conversation {conversation}: {turns}"
        for later in turns[1:]:
            assert later.why.get("cpu", 0) > 0, later  # the index knew where it was
            assert later.served.get("cpu", 0) > 0, later  # and that node's memory served it
    summary = routed.summary()
    assert summary["kv-aware"]["local_hit_ratio"] >= summary["round-robin"]["local_hit_ratio"]
    parts = {part.name: part for part in cluster.status()}
    assert parts["router"].running and parts["router"].problem is None


def test_the_peer_tier_serves_bit_exact_and_only_to_the_node_secret(
    cluster: LocalCluster,
) -> None:
    """Over the cluster's mutual TLS, with its integrity key: a cache proving the node
    secret gets B's chunks bit-exact; one proving another secret, or the sidecar token
    (which in the shipped cluster used to be the node token too), gets nothing and
    its lookups count nothing."""
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8)
    tokens = list(range(2000, 2000 + 3 * CHUNK + 5))
    kv = torch.randn(spec.shape(len(tokens)), generator=torch.Generator().manual_seed(4))
    token = cluster.secrets.sidecar_token
    config = load_config(
        env={}, overrides={"cpu": {"capacity_bytes": "4MiB", "staging_bytes": "4MiB"}}
    )
    node_b = lmtier.connect(
        cluster.state.nodes[1].socket, config, kv=spec, model_id="cluster/peer", token=token
    )
    good = _peer_only_cache(cluster, spec)
    strangers = [_peer_only_cache(cluster, spec, s) for s in ("x" * 32, token)]
    try:
        assert node_b.store(tokens, kv) == 3  # in B's CPU tier, published by B's sidecar
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while good.lookup(tokens).num_chunks < 3:  # B's next publishing round
            assert time.monotonic() < deadline, "B's chunks never reached the directory"
            time.sleep(0.05)
        with good.load(tokens) as hit:
            assert hit.num_tokens == 3 * CHUNK
            assert hit.tokens_by_tier() == {"peer": 3 * CHUNK}
            assert torch.equal(hit.kv(), kv[:, :, : 3 * CHUNK])
        for bad in strangers:  # the directory is shared, B's chunks are not
            assert bad.lookup(tokens).num_chunks == 0
            with bad.load(tokens) as hit:
                assert hit.num_tokens == 0
    finally:
        for cache in (*strangers, good, node_b):
            cache.close()


def test_a_dead_peer_costs_misses_and_leaves_the_directory(cluster: LocalCluster) -> None:
    story = _story(cluster, phases=[])
    story.row(story.a, "P7", step="A computes P7", expected="none")
    node_a = cluster.state.nodes[0]
    os.kill(node_a.sidecar.pid, signal.SIGKILL)  # no drain: it cannot withdraw anything
    _wait_gone(node_a.sidecar, cluster)
    row = story.row(story.b, "P7", step="A dead, B gets P7", expected="redis")
    # the directory still names A, but B's lookup asks A, counts nothing from it and
    # walks on to Redis, where A wrote P7 (it recomputed, when lookups trusted the
    # directory: the load from A failed after the lookup had counted A's chunks)
    assert row.tiers == {"redis": FULL}
    assert row.prompt_tokens == PROMPT_TOKENS
    assert row.max_logit_diff is not None and row.max_logit_diff <= MAX_LOGIT_DIFF
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        heartbeat = f"lmtier:{{peer}}:node:{node_a.name}"
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while client.exists(heartbeat):  # peer.ttl_s (SIDECAR_ENV) after its last beat
            assert time.monotonic() < deadline, "the directory never forgot node A"
            time.sleep(0.1)
    finally:
        client.close()
    cluster.restart_sidecar(0)  # the tests after this one kill it again


def test_a_wrong_token_cannot_use_a_sidecar(cluster: LocalCluster) -> None:
    socket = cluster.state.nodes[1].socket
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8)
    config = load_config(
        env={},
        overrides={
            "cpu": {"capacity_bytes": "4MiB", "staging_bytes": "4MiB"},
            "disk": {"enabled": False},
        },
    )
    tokens = list(range(1000, 1000 + 3 * CHUNK + 5))
    kv = torch.randn(spec.shape(len(tokens)), generator=torch.Generator().manual_seed(3))
    token = cluster.secrets.sidecar_token
    good = lmtier.connect(socket, config, kv=spec, model_id="cluster/token", token=token)
    bad = lmtier.connect(socket, config, kv=spec, model_id="cluster/token", token="wrong-" + token)
    try:
        assert good.store(tokens, kv) == 3
        assert good.lookup(tokens).num_chunks == 3
        assert "sidecar" in good.stats()
        assert bad.stats() == {}  # UNAUTHENTICATED: the client's "sidecar unreachable"
        assert bad.lookup(tokens).num_chunks == 0
        with bad.load(tokens) as hit:
            assert hit.num_tokens == 0
    finally:
        bad.close()
        good.close()


def test_redis_down_node_b_is_served_from_s3(cluster: LocalCluster) -> None:
    story = _story(cluster, phases=[])
    story.row(story.a, "P3", step="A computes P3", expected="none")
    redis = cluster.state.redis
    assert redis is not None
    os.kill(redis.pid, signal.SIGKILL)
    _wait_gone(redis, cluster)
    row = story.row(story.b, "P3", step="Redis down, B gets P3", expected="s3")
    assert row.tiers == {"s3": FULL}
    assert row.max_logit_diff is not None and row.max_logit_diff <= MAX_LOGIT_DIFF
    metrics = scrape_tier_metrics(cluster.state.nodes[1].metrics_url)
    assert metrics is not None  # B's lookups failed on Redis (then its breaker skipped it)
    assert metrics["errors", "redis"] + metrics["skipped", "redis"] > 0
    assert metrics["errors", "peer"] + metrics["skipped", "peer"] > 0  # and the directory


def test_a_sidecar_killed_mid_run_costs_misses_not_requests(cluster: LocalCluster) -> None:
    story = _story(cluster, phases=[])
    node_a = cluster.state.nodes[0]
    a = EngineClient(story.a)
    outcome: list[Completion] = []
    # A request on A in flight (or about to be) while its sidecar is killed: it must
    # succeed either way; when the kill lands is not what this asserts.
    request = threading.Thread(target=lambda: outcome.append(a.complete(story.prompt("P5"))))
    request.start()
    os.kill(node_a.sidecar.pid, signal.SIGKILL)
    _wait_gone(node_a.sidecar, cluster)
    request.join(timeout=300)
    assert len(outcome) == 1 and outcome[0].prompt_tokens == PROMPT_TOKENS
    again = a.complete(story.prompt("P5"))  # A's KV is gone with its sidecar: recomputed
    assert again.cached_tokens == 0 and again.prompt_tokens == PROMPT_TOKENS
    b = EngineClient(story.b)
    fresh = b.complete(story.prompt("P6"))  # B never needed A
    assert fresh.cached_tokens == 0
    assert b.complete(story.prompt("P6")).tiers == {"cpu": FULL}


def test_down_leaves_no_process(cluster: LocalCluster) -> None:
    state = cluster.state
    assert cluster.down() == []
    _assert_no_process_left(state)
    assert read_state(cluster.directory).processes() == state.processes()  # the record stays
    assert cluster.down() == []  # again: nothing to stop


def test_flush_redis_empties_every_primary_of_a_redis_cluster(tmp_path: Path) -> None:
    with RedisClusterProcesses(tmp_path) as redis_cluster:
        from redis.cluster import RedisCluster

        with RedisCluster.from_url(redis_cluster.url) as client:
            for index in range(64):  # keys in slots of every master
                client.set(f"lmtier:{index}", b"x")
            flush_redis(redis_cluster.url)
            assert client.dbsize(target_nodes=RedisCluster.PRIMARIES) == 0


def _lmtier(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmtier.cli", "cluster", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_cli_up_status_down(tmp_path: Path) -> None:
    require_redis()
    directory = tmp_path / "cli"
    try:
        up = _lmtier("up", "--nodes", "2", "--dir", str(directory), "--no-check-logits")
        assert up.returncode == 0, up.stderr
        state = read_state(directory)
        assert state.nodes[1].engine_url in up.stdout and state.nodes[0].socket in up.stdout
        status = _lmtier("status", "--dir", str(directory), "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        body = json.loads(status.stdout)
        assert body["healthy"] is True
        assert {part["pid"] for part in body["parts"]} == {p.pid for p in state.processes()}
        down = _lmtier("down", "--dir", str(directory))
        assert down.returncode == 0, down.stderr
        # Orphans of the `up` process: init reaps them, or, where it does not (this VM's
        # init), they stay zombies that run nothing.
        assert all(_gone(info.pid) for info in state.processes())
        stopped = _lmtier("status", "--dir", str(directory), "--json")
        assert stopped.returncode == 1
        assert not any(part["running"] for part in json.loads(stopped.stdout)["parts"])
    finally:  # a failure above must not leave the cluster running
        if (directory / "cluster.json").exists():
            LocalCluster.attach(directory).down()
