"""The disk tier against real files: round trips, restarts, corruption, eviction, ENOSPC
on a small tmpfs, O_DIRECT and its fallback, concurrency, crash debris, and one
directory shared by several tiers or processes.

Coroutines run under ``asyncio.run`` inside plain tests (no pytest-asyncio).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import mmap
import os
import pickle
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from lmtier.chunks.format import PREFIX_LEN
from lmtier.chunks.keys import ChunkKey
from lmtier.config import DiskTierConfig
from lmtier.errors import BackendUnavailable
from lmtier.testing import make_chunk, random_key
from lmtier_backends.disk import DiskTier, open_tier
from lmtier_backends.disk.io import DIRECT_ALIGN
from support.disk_files import CHUNK_LEN, GIB, chunk_files, run, temp_files

pytestmark = pytest.mark.integration


def bytes_on_disk(path: Path) -> int:
    """Bytes of chunk and temp files (not the 8-byte shared ledger)."""
    files = (p for p in (path / "v1").rglob("*") if p.is_file() and p.name != "ledger")
    return sum(p.stat().st_size for p in files)


def aligned_buffer(nbytes: int) -> memoryview:
    return memoryview(mmap.mmap(-1, nbytes))


async def read_back(tier: DiskTier, keys: list[ChunkKey], nbytes: int = 64 * 1024) -> list[Any]:
    """Each chunk's bytes as read through get_into, or None."""
    buffers = [aligned_buffer(nbytes) for _ in keys]
    sizes = await tier.get_into(keys, buffers)
    return [None if n is None else bytes(buf[:n]) for buf, n in zip(buffers, sizes, strict=True)]


# --- round trips and persistence ------------------------------------------------------


def test_round_trip_into_bytearray_and_mmap(tmp_path: Path) -> None:
    chunks = [make_chunk(seed=i) for i in range(6)]
    keys = [key for key, _ in chunks]

    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, GIB)
        assert not tier.properties.shared
        assert tier.properties.write_policy == "write_through"
        assert await tier.put(chunks) == 6
        # Layout: <path>/v1/<2 hex>/<32 hex>.lmtc, holding the chunk bytes unchanged.
        for key, data in chunks:
            assert (tmp_path / "v1" / key.hex()[32:34] / f"{key.hex()}.lmtc").read_bytes() == data
        assert await tier.contains(keys) == 6
        assert await tier.contains([*keys[:2], random_key(), keys[3]]) == 2
        plain = [memoryview(bytearray(CHUNK_LEN + 100)) for _ in keys]
        mapped = [aligned_buffer(CHUNK_LEN) for _ in keys]
        for buffers in (plain, mapped):
            sizes = await tier.get_into(keys, buffers)
            assert sizes == [CHUNK_LEN] * 6
            assert [bytes(b[:CHUNK_LEN]) for b in buffers] == [data for _, data in chunks]
        assert await tier.get_into([random_key()], [aligned_buffer(CHUNK_LEN)]) == [None]
        # A file larger than its buffer can never be served (slabs are sized for the
        # cache's chunks): it is deleted and counted, so lookups stop finding it.
        assert await tier.get_into(keys[5:], [memoryview(bytearray(CHUNK_LEN - 1))]) == [None]
        assert await tier.contains(keys[5:]) == 0
        stats = tier.stats
        assert (stats.puts, stats.bytes_written, stats.hits) == (6, 6 * CHUNK_LEN, 12)
        assert (stats.misses, stats.errors, stats.corrupt, stats.unservable) == (2, 0, 0, 1)
        assert stats.lookups == 11
        # Latencies are the StorageManager's to record (it wraps every tier call).
        assert (stats.write_latency.num, stats.read_latency.num) == (0, 0)
        assert await tier.delete([keys[0], keys[0], random_key()]) == 1
        assert await tier.contains(keys) == 0
        assert len(chunk_files(tmp_path)) == 4
        await tier.close()
        await tier.close()  # idempotent
        assert await tier.contains(keys[1:]) == 0
        with pytest.raises(BackendUnavailable):
            await tier.put(chunks)

    run(scenario)


def test_constructor_does_no_io(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "never", GIB)
    assert not (tmp_path / "never").exists()
    with pytest.raises(BackendUnavailable, match="not open"):
        run(tier.put, [make_chunk()])


def test_overwrite_replaces_the_chunk(tmp_path: Path) -> None:
    key = random_key()
    _, old = make_chunk(key, seed=1)
    _, new = make_chunk(key, num_tokens=32, seed=2)

    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, GIB)
        assert await tier.put([(key, old)]) == 1
        assert await tier.put([(key, new)]) == 1
        assert await read_back(tier, [key]) == [new]
        assert tier.used_bytes == len(new) == bytes_on_disk(tmp_path)
        await tier.close()

    run(scenario)


def test_restart_finds_every_chunk(tmp_path: Path) -> None:
    chunks = [make_chunk(seed=i) for i in range(40)]
    keys = [key for key, _ in chunks]

    async def write() -> None:
        tier = await DiskTier.open(tmp_path, GIB)
        assert await tier.put(chunks) == 40
        await tier.close()

    async def reopen() -> None:
        tier = await open_tier(DiskTierConfig(path=tmp_path, capacity_bytes=GIB))
        assert (len(tier), tier.used_bytes) == (40, 40 * CHUNK_LEN)
        assert await tier.contains(keys) == 40
        assert await read_back(tier, keys) == [data for _, data in chunks]
        await tier.close()

    run(write)
    run(reopen)


def test_recency_survives_restart(tmp_path: Path) -> None:
    a, b, c, d = (make_chunk(seed=i) for i in range(4))

    async def first_run() -> None:
        tier = await DiskTier.open(tmp_path, 3 * CHUNK_LEN)
        for item in (a, b, c):
            assert await tier.put([item]) == 1
            time.sleep(0.05)  # mtimes tick coarsely (a jiffy); keep them distinct
        assert await read_back(tier, [a[0]]) == [a[1]]  # a hit bumps a's mtime
        await tier.close()

    async def second_run() -> None:
        tier = await DiskTier.open(tmp_path, 3 * CHUNK_LEN)
        assert await tier.put([d]) == 1
        assert tier.stats.evictions == 1
        assert [await tier.contains([k]) for k, _ in (a, b, c, d)] == [1, 0, 1, 1]
        await tier.close()

    run(first_run)
    run(second_run)


# --- corruption -------------------------------------------------------------------------


def _flip(offset: int) -> Callable[[Path, bytes], None]:
    def corrupt(path: Path, data: bytes) -> None:
        raw = bytearray(data)
        raw[offset] ^= 0x01
        path.write_bytes(bytes(raw))

    return corrupt


CORRUPTIONS: dict[str, Callable[[Path, bytes], None]] = {
    "payload_bit": _flip(CHUNK_LEN - 100),
    "header_bit": _flip(PREFIX_LEN + 5),
    "truncated": lambda path, data: path.write_bytes(data[: len(data) - 1000]),
    "zero_length": lambda path, data: path.write_bytes(b""),
    "foreign_bytes": lambda path, data: path.write_bytes(random.randbytes(len(data))),
    "other_key": lambda path, data: path.write_bytes(make_chunk()[1]),
}


@pytest.mark.parametrize("damage", list(CORRUPTIONS))
def test_corrupt_file_is_a_miss_and_is_deleted(tmp_path: Path, damage: str) -> None:
    key, data = make_chunk()

    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, GIB)
        await tier.put([(key, data)])
        path = Path(tier.path_of(key))
        CORRUPTIONS[damage](path, data)
        assert await tier.get_into([key], [aligned_buffer(2 * CHUNK_LEN)]) == [None]
        assert (tier.stats.corrupt, tier.stats.misses, tier.stats.hits) == (1, 1, 0)
        assert not path.exists()
        assert await tier.contains([key]) == 0
        assert tier.used_bytes == 0
        await tier.close()

    run(scenario)


def test_vanished_file_is_a_miss_and_leaves_the_index(tmp_path: Path) -> None:
    key, data = make_chunk()

    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, GIB)
        await tier.put([(key, data)])
        Path(tier.path_of(key)).unlink()
        assert await tier.contains([key]) == 1  # the index cannot know yet
        assert await read_back(tier, [key]) == [None]
        assert (tier.stats.misses, tier.stats.corrupt, tier.stats.errors) == (1, 0, 0)
        assert await tier.contains([key]) == 0
        assert tier.used_bytes == 0
        await tier.close()

    run(scenario)


def test_read_error_is_a_counted_miss(tmp_path: Path) -> None:
    key, data = make_chunk()

    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, GIB)
        await tier.put([(key, data)])
        path = Path(tier.path_of(key))
        path.unlink()
        path.mkdir()  # open() of a directory for reading works; reading it is EISDIR
        assert await read_back(tier, [key]) == [None]
        assert tier.stats.errors == 1
        path.rmdir()
        await tier.close()

    run(scenario)


# --- capacity -------------------------------------------------------------------------


def test_eviction_keeps_newest_within_capacity(tmp_path: Path) -> None:
    chunks = [make_chunk(seed=i) for i in range(12)]
    keys = [key for key, _ in chunks]
    capacity = 5 * CHUNK_LEN + CHUNK_LEN // 2

    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, capacity)
        for item in chunks[:10]:
            assert await tier.put([item]) == 1
            assert bytes_on_disk(tmp_path) <= capacity
            assert tier.used_bytes == bytes_on_disk(tmp_path)
        assert tier.stats.evictions == 5
        assert [await tier.contains([k]) for k in keys[:10]] == [0] * 5 + [1] * 5
        # A hit makes the oldest chunk the newest: the next two puts evict 6 and 7.
        assert await read_back(tier, [keys[5]]) == [chunks[5][1]]
        for item in chunks[10:]:
            assert await tier.put([item]) == 1
        assert [await tier.contains([k]) for k in keys[5:]] == [1, 0, 0, 1, 1, 1, 1]
        assert bytes_on_disk(tmp_path) <= capacity
        await tier.close()

    run(scenario)


def test_batch_larger_than_capacity_keeps_its_newest(tmp_path: Path) -> None:
    chunks = [make_chunk(seed=i) for i in range(10)]

    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, 5 * CHUNK_LEN)
        assert await tier.put(chunks) == 5
        assert await tier.contains([k for k, _ in chunks[5:]]) == 5
        assert await tier.contains([k for k, _ in chunks[:5]]) == 0
        assert bytes_on_disk(tmp_path) <= 5 * CHUNK_LEN
        assert tier.stats.evictions == 5
        await tier.close()

    run(scenario)


def test_chunk_larger_than_capacity_is_refused(tmp_path: Path) -> None:
    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, CHUNK_LEN - 1)
        assert await tier.put([make_chunk()]) == 0
        assert (tier.stats.errors, tier.stats.puts, tier.used_bytes) == (1, 0, 0)
        assert chunk_files(tmp_path) == []
        await tier.close()

    run(scenario)


@contextlib.contextmanager
def mounted(path: Path, fstype: str, options: str = "defaults") -> Iterator[Path]:
    """A fresh ``fstype`` filesystem at ``path`` (we run as root), unmounted afterwards."""
    path.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", fstype, "-o", options, fstype, str(path)],
            check=True,
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:
        pytest.skip("no mount command (ENOENT): cannot make a small filesystem")
    except subprocess.CalledProcessError as exc:
        if "permission denied" in exc.stderr.lower() or "must be superuser" in exc.stderr:
            pytest.skip(f"mounting tmpfs is not permitted (EPERM): {exc.stderr.strip()}")
        raise
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_disk_full_is_counted_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    chunks = [make_chunk(num_tokens=64, hidden=128, seed=i) for i in range(80)]  # ~68 KiB each

    async def scenario(path: Path) -> None:
        tier = await DiskTier.open(path, 100 * GIB)  # the filesystem is far smaller
        stored: list[tuple[ChunkKey, bytes]] = []
        for start in range(0, len(chunks), 4):
            batch = chunks[start : start + 4]
            count = await tier.put(batch)
            present = await asyncio.gather(*(tier.contains([k]) for k, _ in batch))
            assert sum(present) == count
            stored += [item for item, hit in zip(batch, present, strict=True) if hit]
        assert tier.stats.errors > 0
        assert 0 < len(stored) < len(chunks)
        assert temp_files(path) == []
        assert await read_back(tier, [k for k, _ in stored], 128 * 1024) == [
            data for _, data in stored
        ]
        await tier.close()

    with mounted(tmp_path / "small", "tmpfs", "size=4m") as path, caplog.at_level(logging.WARNING):
        asyncio.run(scenario(path))
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(messages) == 1, messages  # once per errno, not once per failed chunk
    assert f"errno {errno.ENOSPC}" in messages[0].lower()
    assert "stats.errors" in messages[0]  # where to look for the ones not logged


# --- O_DIRECT -------------------------------------------------------------------------


def _supports_o_direct(path: Path) -> bool:
    probe = path / "probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True


@pytest.mark.parametrize("num_tokens", [16, 3])  # 3: a length that is not a multiple of 4096
def test_o_direct_round_trip(tmp_path: Path, num_tokens: int) -> None:
    if not _supports_o_direct(tmp_path):
        pytest.skip(f"{tmp_path} does not support O_DIRECT (tmpfs?)")
    chunks = [make_chunk(num_tokens=num_tokens, seed=i) for i in range(4)]
    keys = [key for key, _ in chunks]
    size = len(chunks[0][1])

    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, GIB, o_direct=True)
        assert tier.direct_io
        source = aligned_buffer(size)[:size]  # aligned: written without a bounce copy
        source[:] = chunks[0][1]
        assert await tier.put([(keys[0], source), *chunks[1:]]) == 4  # bytes: bounced
        assert [p.stat().st_size for p in chunk_files(tmp_path)] == [size] * 4
        exact = [aligned_buffer(size) for _ in keys]  # direct body, buffered tail
        roomy = [aligned_buffer(size + DIRECT_ALIGN) for _ in keys]  # rounded-up read
        unaligned = [memoryview(bytearray(size + 1))[1:] for _ in keys]  # buffered fallback
        for buffers in (exact, roomy, unaligned):
            assert await tier.get_into(keys, buffers) == [size] * 4
            assert [bytes(b[:size]) for b in buffers] == [data for _, data in chunks]
        await tier.close()
        # The same files read back without O_DIRECT: nothing about them is special.
        plain = await DiskTier.open(tmp_path, GIB)
        assert await read_back(plain, keys) == [data for _, data in chunks]
        await plain.close()

    run(scenario)


def test_o_direct_falls_back_where_unsupported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # ramfs refuses O_DIRECT with EINVAL; tmpfs did too before Linux 6.6, and accepts
    # it since, so tmpfs no longer exercises the fallback on current kernels.
    chunks = [make_chunk(seed=i) for i in range(3)]

    async def scenario(path: Path) -> None:
        tier = await DiskTier.open(path, GIB, o_direct=True)
        assert tier.o_direct
        assert not tier.direct_io
        assert await tier.put(chunks) == 3
        assert await read_back(tier, [k for k, _ in chunks]) == [d for _, d in chunks]
        await tier.close()
        assert temp_files(path) == []  # the probe file is gone too

    with mounted(tmp_path / "fs", "ramfs") as path, caplog.at_level(logging.WARNING):
        assert not _supports_o_direct(path)
        asyncio.run(scenario(path))
    assert len([r for r in caplog.records if "O_DIRECT" in r.getMessage()]) == 1


@pytest.mark.parametrize("fstype", ["tmpfs", "ramfs"])
def test_o_direct_follows_what_the_filesystem_supports(tmp_path: Path, fstype: str) -> None:
    async def scenario(path: Path) -> bool:
        tier = await DiskTier.open(path, GIB, o_direct=True)
        key, data = make_chunk()
        assert await tier.put([(key, data)]) == 1
        assert await read_back(tier, [key]) == [data]
        await tier.close()
        return tier.direct_io

    with mounted(tmp_path / "fs", fstype) as path:
        supported = _supports_o_direct(path)
        assert asyncio.run(scenario(path)) == supported


# --- concurrency and crash debris -----------------------------------------------------


def test_concurrent_puts_and_gets_never_tear(tmp_path: Path) -> None:
    keys = [random_key() for _ in range(20)]
    versions = {key: [make_chunk(key, seed=s)[1] for s in range(3)] for key in keys}
    rng = random.Random(0)

    async def scenario() -> None:
        # 10 chunks of room for 20 keys: puts evict while other puts and gets run.
        tier = await DiskTier.open(tmp_path, 10 * CHUNK_LEN, io_threads=4)
        stored: list[int] = []

        async def one(i: int) -> None:
            key = rng.choice(keys)
            await asyncio.sleep(rng.random() * 0.05)
            if i % 3 == 0:
                stored.append(await tier.put([(key, rng.choice(versions[key]))]))
            elif i % 3 == 1:
                (got,) = await read_back(tier, [key])
                assert got is None or got in versions[key]
            else:
                await tier.contains(keys)

        await asyncio.gather(*(one(i) for i in range(200)))
        assert stored == [1] * 67  # puts wait while writes in flight hold the capacity
        assert tier.stats.evictions > 0
        assert tier.stats.hits > 0
        assert (tier.stats.corrupt, tier.stats.errors) == (0, 0)
        assert tier.used_bytes == bytes_on_disk(tmp_path) <= 10 * CHUNK_LEN
        assert temp_files(tmp_path) == []
        await tier.close()

    run(scenario)


def test_crash_debris_removed_and_foreign_files_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key, data = make_chunk()
    shard = tmp_path / "v1" / "ab"
    (tmp_path / "v1" / "tmp").mkdir(parents=True)
    shard.mkdir()
    (tmp_path / "v1" / "tmp" / f"{key.hex()}.7.tmp").write_bytes(data[:100])
    foreign = [
        shard / "notes.txt",
        shard / ("AB" + "0" * 30 + ".lmtc"),  # upper-case hex: not a name we write
        shard / ("cd" + "0" * 30 + ".lmtc"),  # in the wrong shard
        tmp_path / "v1" / "stray",
    ]
    for path in foreign:
        path.write_bytes(b"not ours")

    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, GIB)
        assert temp_files(tmp_path) == []
        assert (tier.foreign_files, len(tier)) == (len(foreign), 0)
        assert all(path.exists() for path in foreign)
        assert await tier.put([(key, data)]) == 1
        await tier.close()

    with caplog.at_level(logging.WARNING):
        run(scenario)
    assert len([r for r in caplog.records if "foreign" in r.getMessage()]) == 1


def test_open_rebuilds_index_without_opening_files(tmp_path: Path) -> None:
    # Garbage under chunk names is indexed at open (no file is read) and caught at read.
    keys = [random_key() for _ in range(3)]
    for key in keys:
        shard = tmp_path / "v1" / key.hex()[32:34]
        shard.mkdir(parents=True, exist_ok=True)
        (shard / f"{key.hex()}.lmtc").write_bytes(b"garbage")

    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, GIB)
        assert await tier.contains(keys) == 3
        assert await read_back(tier, keys) == [None] * 3
        assert tier.stats.corrupt == 3
        assert chunk_files(tmp_path) == []
        await tier.close()

    run(scenario)


def test_cancelled_put_still_lands_and_close_waits_for_it(tmp_path: Path) -> None:
    chunks = [make_chunk(num_tokens=256, hidden=256, seed=i) for i in range(8)]  # ~2 MiB

    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, GIB, io_threads=2)
        cancelled = asyncio.ensure_future(tier.put(chunks[:4]))
        pending = asyncio.ensure_future(tier.put(chunks[4:]))
        await asyncio.sleep(0)  # both puts have handed their writes to the pool
        cancelled.cancel()
        await tier.close()  # waits for every write in flight, the cancelled put's too
        assert cancelled.cancelled()
        assert await pending == 4
        assert len(tier) == 8
        assert tier.stats.puts == 8

    run(scenario)
    assert len(chunk_files(tmp_path)) == 8
    assert temp_files(tmp_path) == []

    async def reopen() -> None:
        tier = await DiskTier.open(tmp_path, GIB)
        assert await read_back(tier, [k for k, _ in chunks], 4 << 20) == [d for _, d in chunks]
        await tier.close()

    run(reopen)


# --- sharing a directory with other processes -------------------------------------------


@pytest.mark.parametrize("how", ["contains", "contains_now", "get_into"])
def test_chunks_another_tier_writes_are_found_without_reopening(tmp_path: Path, how: str) -> None:
    # Two tiers on one directory stand for two processes: neither rescans after open.
    chunks = [make_chunk(seed=i) for i in range(6)]
    keys = [key for key, _ in chunks]

    async def scenario() -> None:
        ours = await DiskTier.open(tmp_path, GIB)
        theirs = await DiskTier.open(tmp_path, GIB)
        assert await ours.put(chunks[:2]) == 2
        assert await theirs.put(chunks[2:]) == 4
        if how == "contains":
            assert await ours.contains(keys) == 6
        elif how == "contains_now":  # from a thread other than the loop's, as lookups do
            assert await asyncio.to_thread(ours.contains_now, keys) == 6
        else:
            assert await read_back(ours, keys) == [data for _, data in chunks]
        assert (ours.adopted_files, len(ours), ours.used_bytes) == (4, 6, 6 * CHUNK_LEN)
        assert await ours.contains(keys) == 6  # adopted: no second discovery
        assert await read_back(ours, keys) == [data for _, data in chunks]
        assert ours.adopted_files == 4
        assert ours.stats.errors == theirs.stats.errors == 0
        await ours.close()
        await theirs.close()

    run(scenario)


def test_delete_removes_files_another_tier_wrote(tmp_path: Path) -> None:
    chunks = [make_chunk(seed=i) for i in range(3)]

    async def scenario() -> None:
        ours = await DiskTier.open(tmp_path, GIB)
        theirs = await DiskTier.open(tmp_path, GIB)
        await theirs.put(chunks)
        assert await ours.delete([chunks[0][0], random_key()]) == 1
        assert (len(chunk_files(tmp_path)), ours.used_bytes) == (2, 0)
        assert await theirs.contains([key for key, _ in chunks]) == 3  # its index is a hint
        assert await read_back(theirs, [chunks[0][0]]) == [None]  # a read finds it gone
        assert await theirs.contains([key for key, _ in chunks]) == 0
        await ours.close()
        await theirs.close()

    run(scenario)


def test_lookup_of_absent_keys_costs_one_stat_per_call(tmp_path: Path) -> None:
    chunks = [make_chunk(seed=i) for i in range(3)]
    keys = [key for key, _ in chunks] + [random_key() for _ in range(20)]

    async def scenario() -> None:
        ours = await DiskTier.open(tmp_path, GIB)
        theirs = await DiskTier.open(tmp_path, GIB)
        with mock.patch("os.stat", wraps=os.stat) as stat:
            assert [ours.contains_now(keys) for _ in range(5)] == [0] * 5
            assert stat.call_count == 5  # the first key, once per call
            await theirs.put(chunks)
            stat.reset_mock()
            assert ours.contains_now(keys) == 3
            assert stat.call_count == 4  # the three new files, then the first absent key
            stat.reset_mock()
            assert await ours.contains(keys) == 3
            assert ours.contains_now(keys[:3]) == 3
            assert stat.call_count == 1  # only the absent key: the rest are indexed
        await ours.close()
        await theirs.close()

    run(scenario)


def test_capacity_holds_for_the_directory_shared_by_two_tiers(tmp_path: Path) -> None:
    ours_chunks = [make_chunk(seed=i) for i in range(4)]
    their_chunks = [make_chunk(seed=10 + i) for i in range(3)]
    their_keys = [key for key, _ in their_chunks]

    async def scenario() -> None:
        ours = await DiskTier.open(tmp_path, 4 * CHUNK_LEN)
        theirs = await DiskTier.open(tmp_path, 4 * CHUNK_LEN)
        await ours.put(ours_chunks[:2])
        # 5 chunks in a directory of 4: the writer evicts its own least recent one
        # (never the chunk it has just written).
        for chunk in their_chunks:
            await theirs.put([chunk])
        assert bytes_on_disk(tmp_path) == 4 * CHUNK_LEN
        assert await theirs.contains(their_keys) == 0
        assert theirs.stats.evictions == 1
        # Adopting never evicts (it may run off the loop).
        assert await asyncio.to_thread(ours.contains_now, their_keys[1:]) == 2
        assert ours.used_bytes == 4 * CHUNK_LEN
        await ours.put(ours_chunks[2:3])  # evicts our least recent chunk: LRU
        assert bytes_on_disk(tmp_path) == 4 * CHUNK_LEN
        assert await ours.contains([key for key, _ in ours_chunks[:1]]) == 0
        await ours.put(ours_chunks[3:])  # then the next least recent
        assert bytes_on_disk(tmp_path) == 4 * CHUNK_LEN
        assert await ours.contains([key for key, _ in ours_chunks[1:]]) == 0
        await ours.close()
        await theirs.close()

    run(scenario)


def test_adopting_from_other_threads_while_the_loop_evicts(tmp_path: Path) -> None:
    # contains_now adopts from lookup threads while puts evict on the loop: the index
    # must neither raise (mutated during iteration) nor lose count of its bytes.
    written: list[ChunkKey] = []  # the other tier's keys, newest last

    async def scenario() -> None:
        ours = await DiskTier.open(tmp_path, 16 * CHUNK_LEN, fsync=False)
        theirs = await DiskTier.open(tmp_path, GIB, fsync=False)
        stop = time.monotonic() + 1.0

        def lookups() -> int:
            calls = 0
            while time.monotonic() < stop:
                ours.contains_now(written[-8:])
                calls += 1
            return calls

        threads = [asyncio.ensure_future(asyncio.to_thread(lookups)) for _ in range(2)]
        seed = 0
        while time.monotonic() < stop:
            batch = [make_chunk(seed=seed + i) for i in range(6)]
            seed += 6
            await theirs.put(batch[:4])
            written.extend(key for key, _ in batch[:4])
            await ours.put(batch[4:])  # evicts: adopted files and our own
        assert all(calls > 0 for calls in await asyncio.gather(*threads))
        assert ours.adopted_files > 0
        assert ours.stats.errors == 0
        assert ours.used_bytes == len(ours) * CHUNK_LEN
        await ours.put([make_chunk(seed=seed)])  # back within capacity
        assert ours.used_bytes <= 16 * CHUNK_LEN
        await ours.close()
        await theirs.close()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, to make races likely
    try:
        run(scenario)
    finally:
        sys.setswitchinterval(interval)


_WRITER = """
import asyncio, pickle, sys
from lmtier_backends.disk.tier import DiskTier

async def main():
    with open(sys.argv[2], "rb") as file:
        chunks = pickle.load(file)
    tier = await DiskTier.open(sys.argv[1], 1 << 30)
    stored = await tier.put(chunks)
    await tier.close()
    sys.exit(0 if stored == len(chunks) else 1)

asyncio.run(main())
"""


def test_chunks_another_process_writes_are_found(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    chunks = [make_chunk(seed=i) for i in range(5)]
    keys = [key for key, _ in chunks]
    (tmp_path / "chunks.pkl").write_bytes(pickle.dumps(chunks))

    async def scenario() -> None:
        tier = await DiskTier.open(cache, GIB)
        await tier.put(chunks[:1])
        assert tier.contains_now(keys) == 1
        script = [sys.executable, "-c", _WRITER, str(cache), str(tmp_path / "chunks.pkl")]
        await asyncio.to_thread(subprocess.run, script, check=True, timeout=120)
        assert tier.contains_now(keys) == 5
        assert await tier.contains(keys) == 5
        assert await read_back(tier, keys) == [data for _, data in chunks]
        assert (tier.adopted_files, tier.used_bytes) == (4, 5 * CHUNK_LEN)
        assert temp_files(cache) == []
        await tier.close()

    run(scenario)


def test_open_spares_temp_files_of_live_writers(tmp_path: Path) -> None:
    # Another process sharing the directory may be writing: its temp files stay.
    key = random_key()
    tmp_dir = tmp_path / "v1" / "tmp"
    tmp_dir.mkdir(parents=True)
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    live = tmp_dir / f"{key.hex()}.{os.getpid()}.3.tmp"
    dead = tmp_dir / f"{key.hex()}.{int(finished.stdout)}.4.tmp"
    stale = tmp_dir / f"{key.hex()}.{os.getpid()}.5.tmp"
    for path in (live, dead, stale):
        path.write_bytes(b"partial")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))

    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, GIB)
        assert temp_files(tmp_path) == [live]
        await tier.close()

    run(scenario)
