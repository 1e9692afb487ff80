"""The disk tier's write path: batches spread over threads, group commits, waves, and
what a crash leaves behind (torn, zeroed or stale files are misses, never served)."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from lmtier.chunks.keys import ChunkKey
from lmtier.testing import make_chunk
from lmtier_backends.disk import io as disk_io
from lmtier_backends.disk.batch import fan_out
from lmtier_backends.disk.index import WAVE_FRACTION, wave_length
from lmtier_backends.disk.tier import DiskTier
from support.disk_files import CHUNK_LEN, GIB, chunk_files, run, temp_files

pytestmark = pytest.mark.integration


async def read_back(tier: DiskTier, keys: list[ChunkKey]) -> list[bytes | None]:
    buffers = [memoryview(bytearray(64 * 1024)) for _ in keys]
    chunks = await tier.read_chunks(keys, buffers)
    sizes = [None if c is None else c.payload_offset + c.meta.nbytes for c in chunks]
    return [None if n is None else bytes(b[:n]) for b, n in zip(buffers, sizes, strict=True)]


# --- a batch of writes ----------------------------------------------------------------


@pytest.mark.parametrize("fsync", [False, True])
def test_a_batch_stores_every_chunk_and_survives_a_restart(tmp_path: Path, fsync: bool) -> None:
    chunks = [make_chunk(seed=i) for i in range(40)]

    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, GIB, fsync=fsync, io_threads=3)
        assert await tier.put(chunks) == 40
        assert (tier.stats.puts, tier.stats.errors) == (40, 0)
        await tier.close()
        again = await DiskTier.open(tmp_path, GIB)
        assert await read_back(again, [k for k, _ in chunks]) == [d for _, d in chunks]
        assert temp_files(tmp_path) == []
        await again.close()

    run(scenario)


def test_a_batch_in_which_one_write_fails_stores_the_others(tmp_path: Path) -> None:
    chunks = [make_chunk(seed=i) for i in range(8)]
    keys = [key for key, _ in chunks]

    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, GIB, fsync=True)
        blocker = Path(tier.path_of(keys[3]))
        blocker.mkdir(parents=True)  # a directory where the file must go: EISDIR on rename
        (blocker / "keep").write_bytes(b"x")
        assert await tier.put(chunks) == 7
        assert tier.stats.errors == 1
        assert await tier.contains(keys[:3]) == 3
        found = await read_back(tier, keys)
        assert found == [data if i != 3 else None for i, (_, data) in enumerate(chunks)]
        assert temp_files(tmp_path) == []
        assert tier.used_bytes == 7 * CHUNK_LEN
        await tier.close()

    run(scenario)


def test_a_batch_that_cannot_be_made_durable_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # syncfs failing as it does after a writeback error (EIO): nothing may count as
    # stored, and nothing of the batch may stay to be served as if it were durable.
    def failing_syncfs(fd: int) -> int:
        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(disk_io, "_syncfs", failing_syncfs)
    chunks = [make_chunk(seed=i) for i in range(5)]

    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, GIB, fsync=True)
        assert await tier.put(chunks) == 0
        assert (tier.stats.puts, tier.stats.errors) == (0, 5)
        assert (await tier.contains([chunks[0][0]]), tier.used_bytes) == (0, 0)
        assert chunk_files(tmp_path) == [] and temp_files(tmp_path) == []
        await tier.close()

    run(scenario)


def test_durable_writes_where_there_is_no_syncfs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The portable group commit: an fsync of every file and directory written.
    monkeypatch.setattr(disk_io, "_syncfs", None)
    chunks = [make_chunk(seed=i) for i in range(6)]

    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, GIB, fsync=True)
        assert await tier.put(chunks) == 6
        gone = Path(tier.path_of(chunks[0][0]))
        gone.unlink()  # evicted by another process meanwhile: skipped, not an error
        disk_io.make_durable(tier.root, [str(gone), tier.path_of(chunks[1][0])])
        assert tier.stats.errors == 0
        await tier.close()

    run(scenario)


def test_a_put_far_larger_than_a_wave_ends_as_lru_would(tmp_path: Path) -> None:
    capacity = 64 * CHUNK_LEN
    old = [make_chunk(seed=i) for i in range(64)]
    new = [make_chunk(seed=100 + i) for i in range(48)]

    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, capacity)
        assert await tier.put(old) == 64
        assert await tier.put(new) == 48
        assert tier.stats.evictions == 48
        assert await tier.contains([k for k, _ in old[48:]]) == 16
        assert await tier.contains([k for k, _ in old[:48]]) == 0
        assert await tier.contains([k for k, _ in new]) == 48
        assert len(chunk_files(tmp_path)) == 64
        await tier.close()

    run(scenario)


def test_waves_are_a_small_part_of_capacity_and_never_empty() -> None:
    views = [(ChunkKey(bytes(32)), memoryview(bytes(CHUNK_LEN)))] * 100
    assert wave_length(views, 64 * CHUNK_LEN) == 64 // WAVE_FRACTION
    assert wave_length(views, CHUNK_LEN) == 1  # a chunk larger than a wave: alone
    assert wave_length(views[:3], GIB) == 3


# --- what a crash leaves -----------------------------------------------------------------


def test_temp_files_of_dead_writers_go_at_open_and_live_ones_stay(tmp_path: Path) -> None:
    key, data = make_chunk()
    shard = tmp_path / "v1" / key.hex()[32:34]
    shard.mkdir(parents=True)
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = shard / f".{key.hex()}.{int(finished.stdout)}.0.tmp"
    live = shard / f".{key.hex()}.{os.getpid()}.0.tmp"
    for path in (dead, live):
        path.write_bytes(data[:100])

    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, GIB)
        assert temp_files(tmp_path) == [live]
        assert (tier.foreign_files, len(tier)) == (0, 0)
        assert await tier.put([(key, data)]) == 1  # beside a live writer's temp file
        assert await read_back(tier, [key]) == [data]
        await tier.close()

    run(scenario)


_WRITE_AND_DIE = """
import asyncio, os, pickle, sys
from lmtier_backends.disk.tier import DiskTier

async def main():
    tier = await DiskTier.open(sys.argv[1], 1 << 30)
    await tier.put(pickle.loads(open(sys.argv[2], "rb").read()))
    os._exit(0)  # no close: as abrupt as a crash can be without losing the page cache

asyncio.run(main())
"""


def _empty(path: Path, data: bytes, other: bytes) -> None:
    path.write_bytes(b"")  # ext4 delayed allocation: the size never reached the disk


def _zeroed(path: Path, data: bytes, other: bytes) -> None:
    path.write_bytes(bytes(len(data)))  # the size did, the data blocks did not


def _torn(path: Path, data: bytes, other: bytes) -> None:
    path.write_bytes(data[:4096] + bytes(len(data) - 4096))  # the first page only


def _stale(path: Path, data: bytes, other: bytes) -> None:
    path.write_bytes(other)  # the name landed on blocks that held another chunk


@pytest.mark.parametrize("damage", [_empty, _zeroed, _torn, _stale], ids=lambda f: f.__name__)
def test_files_a_power_loss_tore_are_misses_after_restart(
    tmp_path: Path, damage: Callable[[Path, bytes, bytes], None]
) -> None:
    chunks = [make_chunk(seed=i) for i in range(4)]
    keys = [key for key, _ in chunks]
    (tmp_path / "chunks.pkl").write_bytes(pickle.dumps(chunks))
    cache = tmp_path / "cache"
    script = [sys.executable, "-c", _WRITE_AND_DIE, str(cache), str(tmp_path / "chunks.pkl")]
    subprocess.run(script, check=True, timeout=120)
    # What the disk may hold after a power loss, for a file that was not yet durable.
    victim = next(p for p in chunk_files(cache) if p.name.startswith(keys[1].hex()))
    damage(victim, chunks[1][1], chunks[2][1])

    async def scenario() -> None:
        tier = await DiskTier.open(cache, GIB)
        assert await tier.contains(keys) == 4  # names only: nothing is read at open
        assert await read_back(tier, keys) == [chunks[0][1], None, chunks[2][1], chunks[3][1]]
        assert tier.stats.corrupt == 1
        assert not victim.exists() and await tier.contains(keys) == 1
        await tier.close()

    run(scenario)


# --- fan_out --------------------------------------------------------------------------------


def test_fan_out_keeps_order_and_failures_per_item() -> None:
    def work(n: int) -> int:
        if n == 3:
            raise OSError(errno.EIO, "item 3")
        return n * n

    async def scenario() -> list[Any]:
        pool = ThreadPoolExecutor(3)
        try:
            return await fan_out(pool, 3, work, [(n,) for n in range(10)])
        finally:
            pool.shutdown()

    results = run(scenario)
    assert [r for i, r in enumerate(results) if i != 3] == [n * n for n in range(10) if n != 3]
    assert isinstance(results[3], OSError)


def test_a_cancelled_fan_out_returns_only_when_no_thread_uses_its_items() -> None:
    started, release = threading.Event(), threading.Event()
    ran: list[int] = []

    def work(n: int) -> int:
        ran.append(n)
        if n == 0:
            started.set()
            release.wait()
        return n

    async def scenario() -> None:
        pool = ThreadPoolExecutor(1)
        task = asyncio.ensure_future(fan_out(pool, 1, work, [(n,) for n in range(5)]))
        await asyncio.to_thread(started.wait)
        task.cancel()
        await asyncio.sleep(0)  # the task takes its cancellation: no new item from now on
        assert not task.done()  # item 0 still runs in a thread: the call must not end
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ran == [0]
        pool.shutdown()

    run(scenario)
