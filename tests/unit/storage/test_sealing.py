"""Chunks stored unsealed: served from host memory as they are, sealed (checksum, MAC)
once before any lower tier gets their bytes, never sent unsealed."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.chunks.format import decode
from lmtier.chunks.integrity import ChunkMac
from lmtier.chunks.keys import ChunkKey
from lmtier.config import CPUTierConfig, DiskTierConfig, IntegrityConfig
from lmtier.kv_spec import ChunkFramer, frame_slab
from lmtier.storage import writes
from lmtier.storage.check import ChunkCheck
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.host_pool import HostPool
from lmtier.storage.manager import StorageManager
from lmtier.storage.sealing import is_sealed
from lmtier.storage.tier import Buffer, TierProperties
from lmtier.testing import DictTier, random_key
from lmtier_backends.disk.layout import CHUNK_SUFFIX

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8)
CHUNK = 16
KEY = b"sealing-tests-key-of-32-bytes!!!"


def kv_of(chunks: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(SPEC.shape(chunks * CHUNK), generator=torch.Generator().manual_seed(seed))


def test_store_frames_unsealed_and_host_memory_serves_it() -> None:
    config = LMTierConfig(
        chunk_size=CHUNK,
        cpu=CPUTierConfig(capacity_bytes=1 << 20, staging_bytes=8 << 20),
        disk=DiskTierConfig(enabled=False),
    )
    prompt, kv = list(range(3 * CHUNK)), kv_of(3)
    with LMTier.open(config, kv=SPEC, model_id="m") as cache:
        assert cache.store(prompt, kv) == 3
        with cache.load(prompt) as loaded:
            assert torch.equal(loaded.kv(), kv)
            # Host memory holds the bytes as framed: no checksum was computed.
            assert not any(chunk.chunk.sealed for chunk in loaded.chunks)


def test_two_tiers_share_one_sealing_and_receive_verifiable_chunks() -> None:
    framer = ChunkFramer(SPEC, CHUNK)
    mac = ChunkMac(KEY)
    lower = [DictTier(name, TierProperties(shared=True)) for name in ("near", "far")]

    async def case() -> None:
        pool = HostPool(framer.template.encoded_size, 16, pin=False, align=64)
        check = ChunkCheck(SPEC.geometry(CHUNK), mac)
        manager = StorageManager(CPUTier(pool, 8 * pool.slab_bytes), lower, check=check)
        await manager.start()
        keys = [random_key() for _ in range(4)]
        kv = kv_of(4)
        for index, key in enumerate(keys):
            (handle,) = manager.acquire_slabs(1)
            part = kv.narrow(2, index * CHUNK, CHUNK)
            size = framer.write(handle, key, part, ctime=1.0)
            assert not is_sealed(handle.view[:size])
            assert manager.put(key, handle, size)
        await manager.flush()
        assert manager.writes.sealer.sealed == 4  # once per chunk, not once per tier
        for tier in lower:
            for key in keys:
                chunk = decode(tier.data[key])  # verifies the checksum: sealed
                assert mac.verify(chunk)
        # Host memory sees the sealed header too (the same slab, rewritten in place).
        for key in keys:
            shared = manager.cpu_tier.share(key)
            assert shared is not None
            assert is_sealed(shared[0].view[: shared[1]])
            shared[0].release()
        await manager.close()
        pool.close()

    asyncio.run(case())


def test_bytes_that_cannot_be_sealed_are_never_written_down() -> None:
    lower = DictTier("lower")

    async def case() -> None:
        pool = HostPool(4096, 4, pin=False, align=64)
        manager = StorageManager(CPUTier(pool, 2 * pool.slab_bytes), [lower])
        await manager.start()
        (handle,) = manager.acquire_slabs(1)
        meta = SPEC.meta(random_key(), 1)
        size = frame_slab(handle, meta)
        handle.view[30] ^= 0xFF  # the unsealed header is damaged before it is sealed
        key = meta.namespace + meta.key
        manager.put(key, handle, size)  # type: ignore[arg-type]
        await manager.flush()
        assert lower.data == {}
        assert lower.stats.errors == 1
        await manager.close()
        pool.close()

    asyncio.run(case())


class _HeldTier(DictTier):
    """Records each put's size and holds every put until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__("held", TierProperties(shared=True))
        self.sizes: list[int] = []
        self.release = asyncio.Event()

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> int:
        self.sizes.append(len(items))
        await self.release.wait()
        return await super().put(items)


def test_a_large_store_is_sealed_in_steps_while_earlier_steps_are_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One store larger than SEAL_STEP_BYTES goes down in batches of at most that many
    bytes, and the next batch is sealed while the tier still writes the first (it was
    one batch, sealed whole before the tier got a byte)."""
    framer = ChunkFramer(SPEC, CHUNK)
    lower = _HeldTier()

    async def case() -> None:
        pool = HostPool(framer.template.encoded_size, 16, pin=False, align=64)
        monkeypatch.setattr(writes, "SEAL_STEP_BYTES", 3 * pool.slab_bytes)
        manager = StorageManager(CPUTier(pool, 16 * pool.slab_bytes), [lower])
        await manager.start()
        kv = kv_of(7)
        for index in range(7):
            (handle,) = manager.acquire_slabs(1)
            size = framer.write(handle, keys[index], kv.narrow(2, index * CHUNK, CHUNK), ctime=1.0)
            assert manager.put(keys[index], handle, size)
        async with asyncio.timeout(30):  # a hang guard, not a speed check
            while manager.writes.sealer.sealed < 6:  # a put is held: the next is sealed
                await asyncio.sleep(0.01)
        assert lower.sizes == [3, 3] and lower.data == {}  # PUTS_IN_FLIGHT held, none landed
        lower.release.set()
        await manager.flush()
        assert max(lower.sizes) <= 3 and sum(lower.sizes) == 7
        assert set(lower.data) == set(keys)
        await manager.close()
        pool.close()

    keys = [random_key() for _ in range(7)]
    asyncio.run(case())


def _disk_config(root: Path, key: str | None = None) -> LMTierConfig:
    return LMTierConfig(
        chunk_size=CHUNK,
        cpu=CPUTierConfig(capacity_bytes=1 << 20, staging_bytes=8 << 20),
        disk=DiskTierConfig(path=root),
        integrity=IntegrityConfig(key=key),  # type: ignore[arg-type]
    )


def test_a_store_with_a_write_through_tier_seals_as_it_copies(tmp_path: Path) -> None:
    """The checksum is computed right after each chunk's copy, so the writer has no
    sealing left to do; host memory and the disk hold the same verifiable chunk."""
    prompt, kv = list(range(5 * CHUNK)), kv_of(5)
    with LMTier.open(_disk_config(tmp_path), kv=SPEC, model_id="m") as cache:
        assert cache.store(prompt, kv) == 5
        cache.flush()
        with cache.load(prompt) as loaded:
            assert all(chunk.chunk.sealed for chunk in loaded.chunks)
            assert torch.equal(loaded.kv(), kv)
        manager = cache._store.manager  # type: ignore[attr-defined]
        assert manager.writes.sealer.sealed == 0
        assert cache.stats()["disk"]["puts"] == 5
    files = sorted(tmp_path.rglob(f"*{CHUNK_SUFFIX}"))
    assert len(files) == 5
    for path in files:
        assert decode(memoryview(path.read_bytes())).sealed  # decode verifies the checksum


def test_per_layer_pairs_are_sealed_once_every_pair_of_a_chunk_is_copied(
    tmp_path: Path,
) -> None:
    """A chunk stored from per-layer (K, V) pairs is several copies: its hash runs after
    the last of them, so the checksum covers every layer's bytes."""
    prompt, kv = list(range(3 * CHUNK)), kv_of(3)
    pairs = [(kv[layer, 0], kv[layer, 1]) for layer in range(SPEC.num_layers)]
    with LMTier.open(_disk_config(tmp_path), kv=SPEC, model_id="m") as cache:
        assert cache.store(prompt, pairs) == 3
        cache.flush()
        assert cache._store.manager.writes.sealer.sealed == 0  # type: ignore[attr-defined]
    files = sorted(tmp_path.rglob(f"*{CHUNK_SUFFIX}"))
    assert len(files) == 3
    for path in files:
        assert decode(memoryview(path.read_bytes())).sealed  # decode verifies the checksum


def test_with_an_integrity_key_the_store_leaves_the_seal_to_the_writer(tmp_path: Path) -> None:
    """A MAC costs ~20x the copy: not on the storing thread. The writer seals (checksum
    and MAC) before the disk gets a byte, as without a write-through tier."""
    prompt, kv = list(range(3 * CHUNK)), kv_of(3)
    config = _disk_config(tmp_path, key=KEY.decode())
    with LMTier.open(config, kv=SPEC, model_id="m") as cache:
        assert cache.store(prompt, kv) == 3
        cache.flush()
        assert cache._store.manager.writes.sealer.sealed == 3  # type: ignore[attr-defined]
