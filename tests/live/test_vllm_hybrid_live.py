"""A hybrid model (full-attention and sliding-window layers) under a live ``vllm serve``:
a restarted engine is served its prompts from lmtier's disk tier, per KV cache group,
with output bitwise equal to the engine's own prefix-cache hit.

The model is a tiny random Gemma-3 (:func:`~support.vllm_serve.build_tiny_hybrid_model`):
three layers attend within a window of 512 tokens, the fourth fully. vLLM's hybrid KV
cache allocator (kept on: the connector is ``SupportsHMA``) makes one KV cache group of
each layer, three of them sliding-window groups, and the connector caches each group
in its own namespace (``lmtier_connector/vllm/hybrid.py``): the full-attention group
every chunk of a prompt, each sliding-window group only the chunks of the window
before the prompt's anchor (2 of 256 tokens here, whatever the prompt's length).

The first engine computes two prompts longer than the window twice (a miss, then
vLLM's own prefix-cache hit), one of them in chunked prefill (vLLM frees its
sliding-window blocks while later chunks are still prefilled). Restarted engines
load them from disk synchronously and asynchronously (every group's part of the
load must land); a prompt that shares only the first 1300 tokens of a stored one is a
miss (a sliding-window group is hit only at its stored prompts' anchors).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.disk_files import chunk_files
from support.vllm_serve import (
    HYBRID_LAYER_TYPES,
    HYBRID_WINDOW,
    Completion,
    VllmServer,
    assert_served_as,
    build_tiny_hybrid_model,
    reference_hits,
    words,
)

CHUNK = 256
SHORT = words(770, seed=1)  # 3 chunks (768 tokens) + 2 to compute
LONG = words(1800, seed=2)  # 7 chunks (1792) + 8; prefilled in 4 steps of <= 512
BATCH = ("--max-num-batched-tokens", "512")
GROUPS = len(HYBRID_LAYER_TYPES)  # one KV cache group per layer (vLLM's n:1 grouping)
SLIDING = HYBRID_LAYER_TYPES.count("sliding_attention")


def lmtier_config(disk: Path) -> dict[str, object]:
    return {
        "chunk_size": CHUNK,
        "cpu": {"capacity_bytes": "64MiB", "staging_bytes": "16MiB"},
        "disk": {"path": str(disk)},
    }


def window_chunks(hit_tokens: int) -> int:
    """The chunks a sliding-window group keeps of a prompt whose hit ends at
    ``hit_tokens``: those holding the ``window - 1`` tokens before it."""
    return hit_tokens // CHUNK - (hit_tokens - (HYBRID_WINDOW - 1)) // CHUNK


def chunks_of(hit_tokens: int) -> int:
    """Every group's chunks of such a prompt: all of them in the full-attention group,
    the window's in each sliding-window group."""
    return hit_tokens // CHUNK + SLIDING * window_chunks(hit_tokens)


def shares_only_a_prefix(tail_seed: int) -> str:
    """1600 tokens: LONG's first 1300, then a tail of its own."""
    return " ".join([*LONG.split()[:1300], *words(300, seed=tail_seed).split()])


@dataclass(frozen=True)
class FirstRun:
    disk: Path
    hits: dict[str, Completion]  # the first engine's prefix-cache hits, by prompt
    files: dict[str, list[int]]  # chunk file sizes on disk, by namespace (group)


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hybrid_model(tmp_path_factory.mktemp("tiny-gemma3"))


def wait_for_metric(engine: VllmServer, name: str, value: float, timeout_s: float = 30) -> float:
    """``name``'s value once it reaches ``value`` (workers' counters arrive with steps)."""
    deadline = time.monotonic() + timeout_s
    while (got := engine.metric(name)) < value and time.monotonic() < deadline:
        time.sleep(0.5)
    return got


@pytest.fixture(scope="module")
def first_run(hybrid_model: Path, tmp_path_factory: pytest.TempPathFactory) -> FirstRun:
    root = tmp_path_factory.mktemp("hybrid")
    disk = root / "disk"
    with VllmServer(root / "first", hybrid_model, lmtier=lmtier_config(disk), args=BATCH) as first:
        hits = reference_hits(first, [SHORT, LONG])
        assert all(hit.cached_tokens % CHUNK == 0 for hit in hits.values())  # whole chunks
        saved = sum(chunks_of(hit.cached_tokens) for hit in hits.values())
        assert wait_for_metric(first, "lmtier:saved_chunks_total", saved) == saved
        log = first.log()
    # vLLM made a KV cache group of each layer, and the connector registered each
    # group's layers apart (its INFO lines reach vLLM's log): the hybrid path.
    sizes = re.search(r"kv cache group sizes \(([\d, ]+)\)", log)
    assert sizes is not None and len(sizes.group(1).split(",")) == GROUPS, log[-6000:]
    assert log.count("lmtier: registered 1 KV layers as PagedKVCache") == GROUPS
    files: dict[str, list[int]] = defaultdict(list)
    for path in chunk_files(disk):
        files[path.name[:32]].append(path.stat().st_size)  # <namespace><chain>.lmtc
    return FirstRun(disk, hits, dict(files))


def test_sliding_window_groups_store_only_the_window(first_run: FirstRun) -> None:
    """One namespace per group: the full-attention group holds every chunk of both
    prompts (3 + 7), each sliding-window group the 2 before each prompt's anchor."""
    full = sum(hit.cached_tokens // CHUNK for hit in first_run.hits.values())
    window = sum(window_chunks(hit.cached_tokens) for hit in first_run.hits.values())
    assert (full, window) == (10, 4)
    counts = sorted(len(sizes) for sizes in first_run.files.values())
    assert counts == [window] * SLIDING + [full]
    stored = sorted(sum(sizes) for sizes in first_run.files.values())
    assert all(sliding < stored[-1] / 2 for sliding in stored[:-1])  # 4 chunks of 10


@pytest.mark.parametrize(("mode", "path", "tail"), [("never", "sync", 5), ("always", "async", 6)])
def test_a_restarted_engine_loads_every_group_from_disk_as_its_own_prefix_cache_hit(
    first_run: FirstRun, hybrid_model: Path, tmp_path: Path, mode: str, path: str, tail: int
) -> None:
    config = lmtier_config(first_run.disk)
    with VllmServer(
        tmp_path, hybrid_model, lmtier=config, connector={"async_loads": mode}, args=BATCH
    ) as engine:
        assert_served_as(engine, first_run.hits)
        # Its first 1280 tokens are LONG's full-attention chunks, but no sliding-window
        # group holds the window before them: no hit (each test's tail is its own,
        # so what the other one saved of it does not count).
        assert engine.complete(shares_only_a_prefix(tail)).cached_tokens == 0
        assert engine.alive()
        external = engine.metric("vllm:external_prefix_cache_hits_total")
        assert external == sum(hit.cached_tokens for hit in first_run.hits.values())
        loaded = sum(chunks_of(hit.cached_tokens) for hit in first_run.hits.values())
        other = "async" if path == "sync" else "sync"
        assert engine.metric("lmtier:loaded_chunks_total", mode=path) == loaded  # 22 of 28
        assert engine.metric("lmtier:loaded_chunks_total", mode=other) == 0
        assert engine.metric("lmtier:loaded_chunks_total", tier="disk") == loaded
        assert engine.metric("lmtier:load_failed_chunks_total") == 0
