"""The disk tier against hostile directories: special files in place of chunks, files
it cannot serve, permissions whatever the umask, a bad ``disk.path``, and one
directory's capacity shared by several real processes."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest

from lmtier.errors import ConfigError
from lmtier.testing import make_chunk
from lmtier_backends.disk.tier import DiskTier
from support.disk_files import CHUNK_LEN, GIB, chunk_files, run

pytestmark = pytest.mark.integration


def buffers(count: int) -> list[memoryview]:
    return [memoryview(bytearray(64 * 1024)) for _ in range(count)]


def chunk_bytes_on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "v1").glob("??/*.lmtc"))


@pytest.mark.parametrize("kind", ["fifo", "symlink-to-fifo", "symlink", "directory", "socket"])
def test_special_files_in_place_of_a_chunk_never_hang_or_hit(tmp_path: Path, kind: str) -> None:
    chunks = [make_chunk(seed=i) for i in range(4)]
    keys = [key for key, _ in chunks]

    async def scenario() -> tuple[list[int | None], int, int]:
        tier = await DiskTier.open(tmp_path, GIB, io_threads=2)
        await tier.put(chunks)
        path = Path(tier.path_of(keys[2]))
        path.unlink()
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "symlink-to-fifo":
            os.mkfifo(tmp_path / "fifo")
            path.symlink_to(tmp_path / "fifo")
        elif kind == "symlink":
            path.symlink_to(tier.path_of(keys[0]))
        elif kind == "directory":
            path.mkdir()
        else:  # bound at a short path (AF_UNIX limits its length), then moved in place
            short = Path(tempfile.mkdtemp(dir="/tmp")) / "s"
            with socket.socket(socket.AF_UNIX) as sock:
                sock.bind(str(short))
            short.rename(path)
        # Loads more often than there are I/O threads: none may stay blocked.
        for _ in range(4):
            sizes = await tier.get_into(keys, buffers(4))
        found = await tier.contains(keys)
        unservable = tier.stats.unservable
        await tier.close()
        return sizes, found, unservable

    result: list[tuple[list[int | None], int, int]] = []
    thread = threading.Thread(target=lambda: result.append(run(scenario)), daemon=True)
    thread.start()
    thread.join(timeout=60)  # milliseconds when right; a blocked open would hang for ever
    assert not thread.is_alive(), f"the disk tier hung on a {kind}"
    sizes, found, unservable = result[0]
    assert sizes[:2] == [CHUNK_LEN, CHUNK_LEN] and sizes[2] is None and sizes[3] == CHUNK_LEN
    assert found == 2  # no phantom hit: the unservable entry left the index
    assert unservable >= 1


def test_a_file_larger_than_a_slab_leaves_the_index_and_the_disk(tmp_path: Path) -> None:
    key, data = make_chunk()

    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, GIB)
        await tier.put([(key, data)])
        Path(tier.path_of(key)).write_bytes(data + bytes(70 * 1024))  # grown behind our back
        assert await tier.get_into([key], buffers(1)) == [None]
        assert await tier.contains([key]) == 0
        assert not Path(tier.path_of(key)).exists()
        assert (tier.stats.unservable, tier.stats.corrupt) == (1, 0)
        await tier.close()

    run(scenario)


@pytest.mark.parametrize(("umask", "mode"), [(0o022, "0600"), (0o000, "0600"), (0o077, "0640")])
def test_chunk_files_get_the_configured_mode_whatever_the_umask(
    tmp_path: Path, umask: int, mode: str
) -> None:
    file_mode = int(mode, 8)
    dir_mode = file_mode | ((file_mode & 0o444) >> 2)
    key, data = make_chunk()
    path = tmp_path / "new" / "chunks"  # disk.path and a parent the tier creates
    before = stat.S_IMODE(tmp_path.stat().st_mode)

    async def scenario() -> DiskTier:
        tier = await DiskTier.open(path, GIB, file_mode=file_mode)
        await tier.put([(key, data)])
        assert await tier.pin([key]) == 1  # writes v1/pins
        await tier.close()
        return tier

    old = os.umask(umask)
    try:
        tier = run(scenario)
    finally:
        os.umask(old)
    root = path / "v1"
    assert stat.S_IMODE(Path(tier.path_of(key)).stat().st_mode) == file_mode
    # disk.path and its new parent were 0755, v1/pins 0644 (the umask's modes).
    for directory in (tmp_path / "new", path, root, root / "tmp", Path(tier.path_of(key)).parent):
        assert stat.S_IMODE(directory.stat().st_mode) == dir_mode, directory
    for file in (root / "ledger", root / "pins"):
        assert stat.S_IMODE(file.stat().st_mode) == file_mode, file
    assert stat.S_IMODE(tmp_path.stat().st_mode) == before  # not ours: left alone


def test_directories_of_an_older_install_are_made_private(tmp_path: Path) -> None:
    shard = tmp_path / "v1" / "ab"
    shard.mkdir(parents=True)
    os.chmod(tmp_path / "v1", 0o755)
    os.chmod(shard, 0o755)

    async def scenario() -> None:
        await (await DiskTier.open(tmp_path, GIB)).close()

    run(scenario)
    assert stat.S_IMODE((tmp_path / "v1").stat().st_mode) == 0o700
    assert stat.S_IMODE(shard.stat().st_mode) == 0o700


def test_a_path_that_cannot_hold_chunks_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")

    async def open_at(path: Path) -> None:
        await (await DiskTier.open(path, GIB)).close()

    with pytest.raises(ConfigError, match=r"disk\.path .* is not a directory"):
        run(open_at, blocker)
    with pytest.raises(ConfigError, match=r"disk\.path"):
        run(open_at, blocker / "below")
    assert blocker.read_text() == "not a directory"  # nothing lost


def test_three_processes_keep_a_shared_directory_within_capacity(tmp_path: Path) -> None:
    capacity = 40 * CHUNK_LEN
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from lmtier.testing import make_chunk
        from lmtier_backends.disk.tier import DiskTier

        async def main(seed):
            tier = await DiskTier.open(sys.argv[1], {capacity}, fsync=False)
            for start in range(0, 60, 4):  # 60 chunks each: 4.5x the capacity together
                await tier.put([make_chunk(seed=seed * 1000 + start + i) for i in range(4)])
            await tier.close()

        asyncio.run(main(int(sys.argv[2])))
        """
    )
    processes = [
        subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(seed)])
        for seed in range(3)
    ]
    for process in processes:
        assert process.wait(timeout=120) == 0
    # Each writer makes room for its wave before writing it (disk/sharing.py); what
    # can pass capacity is the ledger's drift while they open at once (an open resets
    # it, missing the waves in flight) and a wave written with nothing left to evict.
    assert chunk_bytes_on_disk(tmp_path) <= capacity + 3 * 4 * CHUNK_LEN
    assert chunk_bytes_on_disk(tmp_path) >= capacity // 2


_SHARER = """
import asyncio, sys
from lmtier.testing import make_chunk
from lmtier_backends.disk.tier import DiskTier

async def main():
    tier = await DiskTier.open(sys.argv[1], int(sys.argv[2]), fsync=False)
    print("open", flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        seed, count = map(int, line.split())
        print(await tier.put([make_chunk(seed=seed + i) for i in range(count)]), flush=True)
    await tier.close()

asyncio.run(main())
"""


def test_processes_sharing_a_directory_never_hold_more_than_its_capacity(tmp_path: Path) -> None:
    """Three processes open one empty directory, so none knows the files the others
    write; the test has them write in turn and measures the bytes on disk after
    every put. Each wave used to be counted in the shared ledger only once it had
    landed: a process that knew no file to evict wrote a whole wave into the full
    directory (41 chunks in a directory of 40 after the second put, 1.10x with
    three processes writing at once). Now the wave is counted first and the writer
    adopts and evicts the others' files before it writes (disk/sharing.py)."""
    capacity = 40 * CHUNK_LEN
    sharers = [
        subprocess.Popen(
            [sys.executable, "-c", _SHARER, str(tmp_path), str(capacity)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    try:
        for sharer in sharers:
            assert sharer.stdout is not None and sharer.stdout.readline() == "open\n"
        # One fills the directory; then each in turn stores one or three chunks.
        steps = [(0, 0, 40)] + [
            (who, 1000 * step + 100 * who, 1 + 2 * (step % 2))
            for step in range(1, 5)
            for who in (1, 2, 0)
        ]
        peak = 0
        for who, seed, count in steps:
            sharer = sharers[who]
            assert sharer.stdin is not None and sharer.stdout is not None
            sharer.stdin.write(f"{seed} {count}\n")
            sharer.stdin.flush()
            assert int(sharer.stdout.readline()) == count
            peak = max(peak, chunk_bytes_on_disk(tmp_path))
    finally:
        for sharer in sharers:
            assert sharer.stdin is not None
            sharer.stdin.close()
        codes = [sharer.wait(timeout=120) for sharer in sharers]
        for sharer in sharers:
            assert sharer.stdout is not None
            sharer.stdout.close()
    assert codes == [0, 0, 0]
    assert peak == capacity, f"peak {peak / capacity:.3f}x the capacity"


def test_a_writer_over_capacity_adopts_and_evicts_files_it_did_not_write(tmp_path: Path) -> None:
    theirs = [make_chunk(seed=i) for i in range(8)]
    ours = [make_chunk(seed=100 + i) for i in range(4)]

    async def scenario() -> None:
        tier = await DiskTier.open(tmp_path, 8 * CHUNK_LEN, fsync=False)
        other = await DiskTier.open(tmp_path, 8 * CHUNK_LEN, fsync=False)
        await other.put(theirs)  # fills the directory with files ``tier`` never saw
        await other.close()
        await tier.put(ours[:1])  # over capacity: keeps what it wrote, looks for others'
        assert await tier.contains([ours[0][0]]) == 1
        for _ in range(6000):  # the rescan runs in the background (milliseconds)
            if tier.adopted_files >= len(theirs):
                break
            await asyncio.sleep(0.01)
        await tier.put(ours[1:])
        assert chunk_bytes_on_disk(tmp_path) <= 8 * CHUNK_LEN
        assert await tier.contains([key for key, _ in ours]) == 4
        await tier.close()

    run(scenario)


def ledger_total(path: Path) -> int:
    """The directory's byte counter as every process reads it (``v1/ledger``)."""
    return int.from_bytes((path / "v1" / "ledger").read_bytes()[:8], "little", signed=True)


@pytest.mark.parametrize("removed", ["the whole path", "one shard"])
def test_a_directory_removed_while_open_is_recreated_by_the_next_write(
    tmp_path: Path, removed: str
) -> None:
    """An operator's ``rm -rf`` (or a tmp cleaner) under an open tier: the next write
    recreates what is gone, private as at open, and lands; the ledger counts exactly
    the bytes on disk. It failed every write until a restart."""
    path = tmp_path / "cache"
    before = [make_chunk(seed=i) for i in range(8)]
    after = [make_chunk(seed=100 + i) for i in range(8)]

    async def scenario() -> tuple[int, list[int | None], list[int | None], int]:
        tier = await DiskTier.open(path, GIB, io_threads=2)
        assert await tier.put(before) == 8
        if removed == "the whole path":
            shutil.rmtree(path)
        else:  # the shard of the first new chunk: files elsewhere stay
            shutil.rmtree(Path(tier.path_of(after[0][0])).parent)
        stored = await tier.put(after)
        new = await tier.get_into([k for k, _ in after], buffers(8))
        old = await tier.get_into([k for k, _ in before], buffers(8))
        errors = tier.stats.errors
        await tier.close()
        return stored, new, old, errors

    stored, new, old, errors = run(scenario)
    assert stored == 8 and new == [CHUNK_LEN] * 8 and errors == 0
    if removed == "the whole path":
        assert old == [None] * 8
    assert ledger_total(path) == chunk_bytes_on_disk(path)
    for directory in (path / "v1", path / "v1" / "tmp", *{p.parent for p in chunk_files(path)}):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory


def test_a_process_sharing_a_removed_directory_counts_in_the_recreated_ledger(
    tmp_path: Path,
) -> None:
    """Two tiers on one directory (as two processes: each its own ledger descriptor).
    After the directory is removed, the first to write recreates it; the other's
    writes then count in the new ledger, not in the removed file."""
    chunks = [make_chunk(seed=i) for i in range(12)]

    async def scenario() -> None:
        first = await DiskTier.open(tmp_path, GIB)
        second = await DiskTier.open(tmp_path, GIB)
        assert await first.put(chunks[:2]) == 2 and await second.put(chunks[2:4]) == 2
        shutil.rmtree(tmp_path / "v1")
        assert await first.put(chunks[4:8]) == 4  # recreates it
        assert await second.put(chunks[8:]) == 4  # its directory is there again
        await first.close()
        await second.close()

    run(scenario)
    assert chunk_bytes_on_disk(tmp_path) == 8 * CHUNK_LEN
    assert ledger_total(tmp_path) == 8 * CHUNK_LEN
