"""Pins (lmtier.storage.pins): the capped set, and the CPU tier keeping pinned chunks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from lmtier import KVSpec, LMTier
from lmtier.config import LMTierConfig
from lmtier.errors import NotSupportedError
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.host_pool import HostPool
from lmtier.storage.pins import Pins
from lmtier.testing import make_chunk, random_key


def test_pins_are_capped() -> None:
    pins = Pins(100)
    a, b, c = random_key(), random_key(), random_key()
    assert pins.add(a, 60)
    assert pins.add(a, 60), "pinning twice is still pinned, counted once"
    assert not pins.add(b, 50), "past the cap"
    assert pins.add(c, 40)
    assert (pins.nbytes, len(pins)) == (100, 2)
    assert pins.discard(a) and not pins.discard(a)
    assert pins.nbytes == 40
    assert pins.clear() == 1 and pins.nbytes == 0


def test_pin_file_round_trip_skips_damaged_lines(tmp_path: Path) -> None:
    path = tmp_path / "pins"
    pins = Pins(1000, str(path))
    keys = [random_key() for _ in range(3)]
    for key in keys:
        pins.add(key, 10)
    pins.save()
    with path.open("a") as stream:
        stream.write("not-a-key\nabcd\n")
    again = Pins(25, str(path))
    stored = again.stored_keys()
    assert sorted(stored) == sorted(keys)
    again.restore((key, 10) for key in stored)
    assert len(again) == 2, "a smaller cap drops the pins past it"
    assert Pins(10, str(tmp_path / "absent")).stored_keys() == []


def _tier(num_slabs: int, capacity_slabs: int, pinned_slabs: int) -> CPUTier:
    pool = HostPool(16 * 1024, num_slabs)
    return CPUTier(
        pool, capacity_slabs * pool.slab_bytes, max_pinned_bytes=pinned_slabs * pool.slab_bytes
    )


def test_cpu_tier_never_evicts_a_pinned_chunk() -> None:
    tier = _tier(8, capacity_slabs=3, pinned_slabs=1)
    chunks = [make_chunk(num_tokens=4, hidden=16) for _ in range(6)]
    keys = [key for key, _ in chunks]

    async def body() -> None:
        await tier.put(chunks[:2])
        assert await tier.pin(keys[:2]) == 1, "the cap holds one slab: the second is refused"
        assert tier.usage()["pinned_chunks"] == 1 and tier.stats.pins_refused == 1
        await tier.put(chunks[2:])  # four more through a 3-chunk tier
        assert keys[0] in tier, "the pinned (least recently used) chunk survived"
        assert keys[1] not in tier
        assert len(tier) == 3
        assert await tier.unpin() == 1
        await tier.put([make_chunk(num_tokens=4, hidden=16) for _ in range(3)])
        assert keys[0] not in tier, "unpinned, it is evicted like any other"

    asyncio.run(body())


def test_a_deleted_chunk_loses_its_pin_and_absent_keys_are_not_pinned() -> None:
    tier = _tier(4, capacity_slabs=4, pinned_slabs=4)
    key, data = make_chunk(num_tokens=4, hidden=16)

    async def body() -> None:
        assert await tier.pin([key]) == 0, "not held: nothing to pin"
        await tier.put([(key, data)])
        assert await tier.pin([key]) == 1
        await tier.delete([key])
        assert tier.usage()["pinned_bytes"] == 0

    asyncio.run(body())


def test_a_tier_without_pins_says_so() -> None:
    class NoPins(CPUTier):
        pins = None  # type: ignore[assignment]

    pool = HostPool(16 * 1024, 2)
    tier = NoPins(pool)
    tier.pins = None  # type: ignore[assignment]
    with pytest.raises(NotSupportedError, match="does not pin"):
        asyncio.run(tier.pin([random_key()]))


def test_facade_pins_survive_pressure_and_are_capped(tmp_path: Path) -> None:
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=16)
    chunk = 16
    slab = spec.encoded_chunk_bytes(chunk)
    config = LMTierConfig.model_validate(
        {
            "chunk_size": chunk,
            "cpu": {
                "capacity_bytes": 8 * slab,
                "staging_bytes": 4 * slab,
                "max_pinned_fraction": 0.25,
            },
            "disk": {"enabled": False},
        }
    )
    with LMTier.open(config, kv=spec, model_id="pins") as cache:
        warm = list(range(4 * chunk))
        cache.store(warm, torch.randn(spec.shape(len(warm))))
        keys = cache.keys(warm)
        pinned = cache.pin_keys(keys)
        assert pinned == {"cpu": 2}, "a quarter of 8 slabs: two chunks, the rest refused"
        for round_ in range(6):  # 24 other chunks through an 8-chunk tier
            other = [10_000 * (round_ + 1) + i for i in range(4 * chunk)]
            cache.store(other, torch.randn(spec.shape(len(other))))
        assert cache.lookup(warm).tokens_by_tier(chunk) == {"cpu": 2 * chunk}
        stats = cache.stats()["cpu"]
        assert stats["pinned_chunks"] == 2 and stats["capacity_bytes"] >= 8 * slab
        assert cache.unpin_keys() == {"cpu": 2}
