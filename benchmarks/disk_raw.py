"""Raw file I/O, the baseline of the disk benchmarks: plain os calls on plain threads,
the fastest way this machine writes and reads files of the sizes the tier moves.

Cold reads drop the page cache first (``/proc/sys/vm/drop_caches`` when writable,
else ``posix_fadvise(DONTNEED)`` per file). Read buffers are page aligned (mmap), like
the host pool's slabs, so O_DIRECT can read into them.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import mmap
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

ALIGN = 4096
DROP_CACHES = "/proc/sys/vm/drop_caches"
WRITE_MODES = (
    "write_buffered",  # no sync: what the disk tier does by default
    "write_buffered_fsync",  # fsync per file
    "write_buffered_syncfs",  # every file written, then one syncfs (a group commit)
    "write_direct",
    "write_direct_fsync",
)
READ_MODES = ("read_buffered", "read_direct")
_libc = ctypes.CDLL(None, use_errno=True)


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def aligned_buffers(count: int, size: int) -> list[memoryview]:
    """``count`` page-aligned buffers of ``size`` bytes (rounded up), already touched:
    first touches of fresh memory are slow here, and the tier reads into reused slabs."""
    buffers = [memoryview(mmap.mmap(-1, align_up(size))) for _ in range(count)]
    zeros = bytes(align_up(size))
    for buf in buffers:
        buf[:] = zeros
    return buffers


def files_under(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]


def drop_page_cache(paths: Sequence[str], level: str = "1") -> str:
    """Evict ``paths`` from the page cache; returns the method used."""
    os.sync()
    if os.access(DROP_CACHES, os.W_OK):
        with open(DROP_CACHES, "w") as f:
            f.write(level)
        return "drop_caches"
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def syncfs(path: str) -> None:
    """Flush the filesystem holding ``path`` (Linux ``syncfs``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), "syncfs failed")
    finally:
        os.close(fd)


def raw_write(path: str, data: memoryview, direct: bool, sync: bool) -> None:
    """Write ``data`` to a new file; with ``direct``, the 4096-multiple body goes with
    O_DIRECT and the tail after clearing it (chunks are not whole pages)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0))
    try:
        body = len(data) - len(data) % ALIGN if direct else len(data)
        os.write(fd, data[:body])
        if body < len(data):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            os.write(fd, data[body:])
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: str, buf: memoryview, direct: bool) -> int:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        size = os.fstat(fd).st_size
        return os.preadv(fd, [buf[: align_up(size) if direct else size]], 0)
    finally:
        os.close(fd)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def raw_write_pass(workdir: str, views: Sequence[memoryview], threads: int, mode: str) -> float:
    """Seconds to write each of ``views`` to its own new file in ``workdir``."""
    paths = [os.path.join(workdir, f"{i}.raw") for i in range(len(views))]
    direct, sync = "direct" in mode, mode.endswith("fsync")

    def write_all() -> None:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda p, v: raw_write(p, v, direct, sync), paths, views))
        if mode.endswith("syncfs"):
            syncfs(workdir)

    return timed(write_all)


def raw_cold_read(paths: Sequence[str], threads: int, direct: bool) -> float:
    """Seconds to read ``paths`` into aligned buffers on ``threads``, page cache dropped."""
    buffers = aligned_buffers(len(paths), max(os.path.getsize(p) for p in paths))
    drop_page_cache(paths)
    with ThreadPoolExecutor(threads) as pool:
        return timed(lambda: list(pool.map(lambda p, b: raw_read(p, b, direct), paths, buffers)))


def raw_pass(workdir: str, views: Sequence[memoryview], threads: int, mode: str) -> float:
    """Seconds for one raw pass of ``mode`` (WRITE_MODES, READ_MODES) over files of
    ``views``' sizes; reads use files a durable write made first."""
    if mode in WRITE_MODES:
        return raw_write_pass(workdir, views, threads, mode)
    raw_write_pass(workdir, views, threads, "write_buffered_syncfs")
    paths = [os.path.join(workdir, f"{i}.raw") for i in range(len(views))]
    return raw_cold_read(paths, threads, mode == "read_direct")


def main() -> None:
    """``python disk_raw.py PATHS_FILE THREADS DIRECT``: one cold read of the files
    listed in PATHS_FILE (one a line), in this new process; prints JSON seconds."""
    paths_file, threads, direct = sys.argv[1:4]
    with open(paths_file) as f:
        paths = f.read().split()
    print(json.dumps({"read_s": raw_cold_read(paths, int(threads), direct == "1")}))


if __name__ == "__main__":
    main()
