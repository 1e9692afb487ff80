"""Pins and purge dry runs through a sidecar process: pins keep chunks in its CPU tier
under pressure, within the cap; unpinning all is scoped to the caller's namespace; a
dry run counts and deletes nothing; a purge's dry run of another tenant is refused to
a token scoped elsewhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lmtier.testing.sidecar import SidecarProcess
from support.sidecar_client import connect, kv_of, prompt

pytestmark = pytest.mark.integration
pytest.importorskip("grpc")

TOKENS = 4 * 256
SLAB = 520 * 1024  # the sidecar's slab: one chunk of sidecar_client.SPEC
SETTINGS: dict[str, Any] = {
    "cpu": {"capacity_bytes": 16 * SLAB, "staging_bytes": 8 * SLAB, "max_pinned_fraction": 0.25},
    "disk": {"enabled": False},
    "sidecar": {"slab_bytes": SLAB},
}


def test_pins_hold_under_pressure_within_the_cap_and_unpin_is_per_namespace(
    tmp_path: Path,
) -> None:
    with SidecarProcess(tmp_path / "sidecar", SETTINGS) as sidecar:
        cache = connect(sidecar.target, stream=False)
        try:
            ids = prompt(1, TOKENS)
            assert cache.store(ids, kv_of(1, TOKENS)) == 4
            assert cache.pin_keys(cache.keys(ids)) == {"cpu": 4}
            assert cache.store(ids, kv_of(1, TOKENS), cache_salt="other") == 4
            other = cache.keys(ids, cache_salt="other")
            assert cache.pin_keys(other) == {"cpu": 0}, "the cap (4 of 16 slabs) is reached"
            for seed in range(2, 8):  # 24 more chunks through a 16-chunk tier
                assert cache.store(prompt(seed, TOKENS), kv_of(seed, TOKENS)) == 4
            assert cache.lookup(ids).num_tokens == TOKENS, "pinned chunks stayed"
            assert cache.lookup(ids, cache_salt="other").num_tokens == 0
            stats = cache.stats()["cpu"]
            assert stats["pinned_chunks"] == 4 and stats["pins_refused"] >= 4
            assert cache.unpin_keys() == {"cpu": 4}
            assert cache.unpin_keys() == {"cpu": 0}
        finally:
            cache.close()


def test_a_purge_dry_run_counts_and_deletes_nothing(tmp_path: Path) -> None:
    with SidecarProcess(tmp_path / "sidecar", SETTINGS) as sidecar:
        cache = connect(sidecar.target, stream=True)
        try:
            ids = prompt(3, TOKENS)
            assert cache.store(ids, kv_of(3, TOKENS), cache_salt="t") == 4
            assert cache.purge("t", dry_run=True) == {"cpu": 4}
            assert cache.lookup(ids, cache_salt="t").num_tokens == TOKENS
            assert cache.purge("t") == {"cpu": 4}
            assert cache.purge("t", dry_run=True) == {"cpu": 0}
        finally:
            cache.close()
