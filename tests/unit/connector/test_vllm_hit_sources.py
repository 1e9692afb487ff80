"""The vLLM connector's hit sources: lmtier's tiers as vLLM's ``CacheHitSource``, and an
external hit split by the spans its lookup found (a first chunk vLLM's local hit
already covers in part, a hit vLLM took less of, a sidecar over TCP)."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("vllm")

with warnings.catch_warnings():  # vLLM's imports of torch's deprecated parts
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from lmtier import TierSpan
    from lmtier_connector.vllm.hit_sources import FoundHit, source_of

pytestmark = pytest.mark.vllm

HOST, DISK, P2P = CacheHitSource.HOST, CacheHitSource.DISK, CacheHitSource.P2P
REMOTE = CacheHitSource.EXTERNAL_UNSPECIFIED
C = 64  # chunk size


SOURCES = [("cpu", HOST), ("disk", DISK), ("peer", P2P), ("redis", REMOTE), ("s3", REMOTE)]


@pytest.mark.parametrize(("tier", "source"), [*SOURCES, ("memo", REMOTE)])  # memo: a plugin
def test_each_tier_has_its_source(tier: str, source: CacheHitSource) -> None:
    assert source_of(tier) == source
    assert source_of(tier, on_this_host=False) == REMOTE  # a sidecar over TCP


def test_a_hit_splits_by_span() -> None:
    spans = (TierSpan("cpu", 0, 1), TierSpan("disk", 1, 2), TierSpan("redis", 2, 4))
    hit = FoundHit(start=0, first_chunk=0, spans=spans)
    assert hit.sources(4 * C, C) == {HOST: C, DISK: C, REMOTE: 2 * C}
    # vLLM took less than the hit (a cap, a trimmed tail): the tail spans count less.
    assert hit.sources(C + 10, C) == {HOST: C, DISK: 10}
    assert hit.sources(0, C) == {}
    assert hit.sources(4 * C, C, on_this_host=False) == {REMOTE: 4 * C}


def test_the_split_counts_from_vllms_local_hit() -> None:
    # vLLM's local hit ends inside chunk 2 (block-aligned, 16 tokens in): the lookup
    # asked from chunk 2, and its spans count from there.
    spans = (TierSpan("cpu", 0, 1), TierSpan("peer", 1, 3))
    hit = FoundHit(start=2 * C + 16, first_chunk=2, spans=spans)
    assert hit.sources(C - 16 + 2 * C, C) == {HOST: C - 16, P2P: 2 * C}


def test_tokens_no_span_holds_are_unspecified() -> None:
    hit = FoundHit(start=0, first_chunk=0, spans=(TierSpan("disk", 0, 1),))
    assert hit.sources(2 * C, C) == {DISK: C, REMOTE: C}
    assert sum(hit.sources(2 * C, C).values()) == 2 * C  # what vLLM checks
