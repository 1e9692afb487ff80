"""Two live ``vllm serve`` engines share lmtier's tiers: a real ``redis-server``, then one
``lmtier serve`` sidecar. What one engine computed, the other is served with output
bitwise equal to the first engine's own prefix-cache hit; Redis killed in the middle
of a load costs that request a recompute (same output), never a failed request, and
the engine goes on serving.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lmtier.testing.sidecar import SidecarProcess
from support.redis_servers import RedisServer
from support.slow_link import SlowLink
from support.vllm_serve import Completion, VllmServer, reference_hits, words

CHUNK = 256
SHARED = words(770, seed=3)  # 3 chunks + 2 tokens
KILLED = words(1030, seed=4)  # 4 chunks + 6 tokens
AFTER = words(600, seed=5)
TOKEN = "live-sidecar-token-0123456789abcdef"
KEYS_TIMEOUT_S = 120.0  # a hang guard: the CPU tier writes down to Redis in the background


def start_both(*servers: VllmServer) -> None:
    """Start engines side by side (each start is mostly waiting on its own process)."""
    errors: list[BaseException] = []

    def start(server: VllmServer) -> None:
        try:
            server.start()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(server,)) for server in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        for server in servers:
            server.stop()
        raise errors[0]


@dataclass
class RedisPair:
    redis: RedisServer
    link: SlowLink  # engine b reaches Redis through it (a fault can be armed)
    a: VllmServer
    b: VllmServer


@pytest.fixture(scope="module")
def redis_pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisPair]:
    root = tmp_path_factory.mktemp("shared-redis")
    redis = RedisServer(root / "redis").start()
    link = SlowLink(redis.port)
    link.__enter__()

    def config(port: int) -> dict[str, object]:
        return {
            "chunk_size": CHUNK,
            "cpu": {"capacity_bytes": "64MiB", "staging_bytes": "16MiB"},
            "disk": {"enabled": False},
            "redis": {"url": f"redis://127.0.0.1:{port}/0", "timeout_s": 2},
        }

    a = VllmServer(root / "a", tiny_model, lmtier=config(redis.port))
    b = VllmServer(root / "b", tiny_model, lmtier=config(link.port))
    try:
        start_both(a, b)
        yield RedisPair(redis, link, a, b)
    finally:
        a.stop()
        b.stop()
        link.close()
        redis.stop()


def wait_for_keys(redis: RedisServer, count: int) -> None:
    """Until Redis holds ``count`` chunks (one key each)."""
    deadline = time.monotonic() + KEYS_TIMEOUT_S
    client = redis.client()
    while client.dbsize() < count:
        assert time.monotonic() < deadline, f"Redis holds {client.dbsize()} of {count} chunks"
        time.sleep(0.1)


def test_two_engines_share_a_redis_tier(redis_pair: RedisPair) -> None:
    hit = reference_hits(redis_pair.a, [SHARED])[SHARED]
    wait_for_keys(redis_pair.redis, 3)
    got = redis_pair.b.complete(SHARED)
    assert got.cached_tokens == hit.cached_tokens == 768, redis_pair.b.tail()
    assert got.output == hit.output
    assert redis_pair.b.metric("lmtier:loaded_chunks_total", tier="redis") == 3
    # vLLM has no source for a remote store: its "external_unspecified".
    by_source = "vllm:prompt_tokens_cached_by_source_total"
    assert redis_pair.b.metric(by_source, source="external_unspecified") == 768


def test_redis_killed_during_a_load_costs_a_recompute(redis_pair: RedisPair) -> None:
    """Runs after the sharing test (same engines): Redis dies as the first large reply
    (a chunk) flows to engine b."""
    misses: dict[str, Completion] = {}
    reference_hits(redis_pair.a, [KILLED], misses)
    miss = misses[KILLED]
    wait_for_keys(redis_pair.redis, 3 + 4)
    redis_pair.link.trip_on_reply(16 * 1024, redis_pair.redis.kill)
    got = redis_pair.b.complete(KILLED)
    assert redis_pair.link.tripped.is_set()  # the fault hit a load, not a lookup
    assert got.output == miss.output  # recomputed: the same tokens and logprobs
    assert redis_pair.b.metric("lmtier:load_failed_chunks_total") >= 1
    # The engine goes on: Redis is gone, so a new prompt is computed.
    after = redis_pair.b.complete(AFTER)
    assert after.prompt_tokens == 600 and after.cached_tokens == 0
    assert redis_pair.b.healthy()


def wait_for_sidecar_chunks(target: str, token_file: Path, count: int) -> None:
    """Until the sidecar's CPU tier holds ``count`` chunks (``lmtier stats``): a
    response leaves vLLM before the request's saves are through."""
    deadline = time.monotonic() + KEYS_TIMEOUT_S
    command = [sys.executable, "-m", "lmtier.cli", "stats", "--json", "--sidecar", target]
    command += ["--sidecar-token-file", str(token_file)]
    while True:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
        tiers = {tier["name"]: tier for tier in json.loads(done.stdout)["tiers"]}
        if (tiers["cpu"]["chunks"] or 0) >= count:
            return
        assert time.monotonic() < deadline, f"the sidecar holds {tiers['cpu']['chunks']} chunks"
        time.sleep(0.2)


def test_two_engines_share_one_sidecar(tiny_model: Path, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    settings = {
        "cpu": {"capacity_bytes": "128MiB"},
        "disk": {"enabled": False},
        "sidecar": {"auth_token": TOKEN},
    }
    with SidecarProcess(tmp_path / "sidecar", settings) as sidecar:
        connector = {"sidecar": sidecar.target, "sidecar_token_file": str(token_file)}
        lmtier = {"chunk_size": CHUNK}
        a = VllmServer(tmp_path / "a", tiny_model, lmtier=lmtier, connector=connector)
        b = VllmServer(tmp_path / "b", tiny_model, lmtier=lmtier, connector=connector)
        try:
            start_both(a, b)
            hit = reference_hits(a, [SHARED])[SHARED]
            wait_for_sidecar_chunks(sidecar.target, token_file, 3)
            got = b.complete(SHARED)
            assert got.cached_tokens == 768, b.tail()
            assert got.output == hit.output
            # And the other way round, for a prompt b computed.
            b_hit = reference_hits(b, [AFTER])[AFTER]
            wait_for_sidecar_chunks(sidecar.target, token_file, 3 + 2)
            from_b = a.complete(AFTER)
            assert from_b.cached_tokens == 512 and from_b.output == b_hit.output
        finally:
            a.stop()
            b.stop()
