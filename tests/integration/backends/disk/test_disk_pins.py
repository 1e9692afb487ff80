"""Disk-tier pins on a real directory: never evicted, capped, persisted across a
restart, and dropped with the file by a delete or a purge."""

from __future__ import annotations

import asyncio
from pathlib import Path

from lmtier.testing import TEST_NAMESPACE, make_chunk
from lmtier_backends.disk import DiskTier

CHUNK_LEN = len(make_chunk(num_tokens=4, hidden=16)[1])


def _chunks(count: int) -> list[tuple[bytes, bytes]]:
    return [make_chunk(num_tokens=4, hidden=16) for _ in range(count)]


def test_pinned_files_survive_eviction_and_a_restart(tmp_path: Path) -> None:
    chunks = _chunks(10)
    keys = [key for key, _ in chunks]

    async def body() -> None:
        tier = await DiskTier.open(tmp_path, 4 * CHUNK_LEN, max_pinned_fraction=0.5)
        await tier.put(chunks[:3])
        assert await tier.pin(keys[:3]) == 2, "half of 4 chunks: the third pin is refused"
        assert tier.stats.pins_refused == 1
        await tier.put(chunks[3:])  # seven more through a 4-chunk tier
        assert await tier.contains(keys[:2]) == 2, "pinned, though least recently used"
        assert await tier.contains(keys[2:3]) == 0
        assert tier.used_bytes <= 4 * CHUNK_LEN
        await tier.close()

        again = await DiskTier.open(tmp_path, 4 * CHUNK_LEN, max_pinned_fraction=0.5)
        assert again.usage()["pinned_chunks"] == 2, "pins are read back at open"
        await again.put(_chunks(6))
        assert await again.contains(keys[:2]) == 2
        assert await again.unpin(keys[:1]) == 1
        await again.put(_chunks(6))
        assert await again.contains(keys[:1]) == 0, "unpinned: evicted like the rest"
        assert await again.contains(keys[1:2]) == 1
        await again.close()

        third = await DiskTier.open(tmp_path, 4 * CHUNK_LEN)
        assert third.usage()["pinned_chunks"] == 1, "the unpin was persisted too"
        await third.close()

    asyncio.run(body())


def test_delete_and_purge_take_the_pin_with_the_file(tmp_path: Path) -> None:
    chunks = _chunks(3)
    keys = [key for key, _ in chunks]

    async def body() -> None:
        tier = await DiskTier.open(tmp_path, 10 * CHUNK_LEN)
        await tier.put(chunks)
        assert await tier.pin(keys) == 3
        await tier.delete(keys[:1])
        assert tier.usage()["pinned_chunks"] == 2
        assert await tier.purge(TEST_NAMESPACE) == 2
        assert tier.usage()["pinned_bytes"] == 0
        await tier.close()
        reopened = await DiskTier.open(tmp_path, 10 * CHUNK_LEN)
        assert reopened.usage()["pinned_chunks"] == 0
        await reopened.close()

    asyncio.run(body())


def test_a_damaged_pin_file_costs_pins_not_the_tier(tmp_path: Path) -> None:
    chunks = _chunks(2)

    async def body() -> None:
        tier = await DiskTier.open(tmp_path, 10 * CHUNK_LEN)
        await tier.put(chunks)
        await tier.pin([chunks[0][0]])
        await tier.close()
        pins = tmp_path / "v1" / "pins"
        pins.write_bytes(pins.read_bytes() + b"\xff\xfe garbage\n" + b"0" * 10_000 + b"\n")
        again = await DiskTier.open(tmp_path, 10 * CHUNK_LEN)
        assert again.usage()["pinned_chunks"] == 1
        assert again.foreign_files == 0, "the pin file is the tier's own"
        await again.close()

    asyncio.run(body())
