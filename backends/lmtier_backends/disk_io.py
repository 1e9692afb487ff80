"""Blocking file operations of the disk tier, one call per worker-thread hop.

Each function does a whole open / read-or-write / close, so the event loop pays one
executor hop per file. OSErrors propagate to the tier, which turns them into misses
and counters; nothing here touches the tier's index or stats.

O_DIRECT needs 4096-aligned memory, lengths and file offsets. Files keep the chunk's
exact length (no padding): the body, a multiple of 4096 bytes, moves with O_DIRECT,
and the tail of under 4096 bytes goes through the page cache after O_DIRECT is
cleared on the descriptor (``fcntl``). Unaligned sources (bytes objects) are copied
into a per-thread bounce buffer from ``mmap`` (page aligned), grown only when too
small. Reads go straight into the caller's buffer when it is aligned; an unaligned
buffer gets a buffered read for that one call.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
import threading
from collections.abc import Sequence

import numpy as np

from lmtier.chunk_format import PAYLOAD_ALIGN, align_up

__all__ = ["O_DIRECT", "file_size", "probe_direct", "read_file", "unlink_all", "write_file"]

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_local = threading.local()  # per worker thread: the O_DIRECT bounce buffer


def _address(view: memoryview) -> int:
    """Memory address of a buffer (read-only ones too, which ctypes cannot take)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _bounce(nbytes: int) -> mmap.mmap:
    """This thread's page-aligned scratch buffer, grown (never shrunk) to ``nbytes``."""
    buf: mmap.mmap | None = getattr(_local, "bounce", None)
    if buf is None or len(buf) < nbytes:
        if buf is not None:
            buf.close()
        buf = mmap.mmap(-1, align_up(max(nbytes, 1)))
        _local.bounce = buf
    return buf


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        written = os.write(fd, data[done:])
        if written <= 0:
            raise OSError(errno.EIO, "write made no progress")
        done += written


def _clear_direct(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)


def _write_direct(fd: int, data: memoryview) -> None:
    """Write ``data`` to an O_DIRECT descriptor: the 4096-multiple body bypasses the
    page cache (from the caller's memory when aligned, else from the bounce buffer);
    the tail of under 4096 bytes is written buffered (O_DIRECT cleared on the fd)."""
    size = len(data)
    body = size - size % PAYLOAD_ALIGN
    if body and _address(data) % PAYLOAD_ALIGN == 0:
        _write_all(fd, data[:body])
    elif body:
        bounce = _bounce(body)
        with memoryview(bounce) as scratch:
            scratch[:body] = data[:body]
            _write_all(fd, scratch[:body])
    if body < size:
        _clear_direct(fd)
        _write_all(fd, data[body:])


def write_file(final: str, temp: str, data: memoryview, direct: bool, sync: bool) -> None:
    """Atomically make ``final`` hold ``data``: temp file, fdatasync, rename.

    The shard directory is deliberately not fsynced: for a cache, a rename lost in a
    crash is a miss, and a file torn by one fails its checksum; that fsync costs a
    second journal commit per file (~15% of write throughput here). fdatasync before
    the rename stays, so a renamed file never points at unwritten blocks.
    On any OSError nothing is left behind (no temp file).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (O_DIRECT if direct else 0)
    fd = os.open(temp, flags, 0o644)
    try:
        try:
            if direct:
                _write_direct(fd, data)
            else:
                _write_all(fd, data)
            if sync:
                os.fdatasync(fd)  # a new file: its size is data to fdatasync, mtime is not
        finally:
            os.close(fd)
        os.replace(temp, final)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def _read_exact(fd: int, view: memoryview, offset: int = 0) -> int:
    """Fill ``view`` from file ``offset`` on; fewer bytes only at end of file."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


def read_file(path: str, buf: memoryview, direct: bool) -> int | None:
    """Read the file at ``path`` into ``buf`` and bump its mtime (it was just used).

    Returns the file's length, or None when it is larger than ``buf``.
    FileNotFoundError and other OSErrors propagate to the caller, which sorts them.
    """
    direct = direct and _address(buf) % PAYLOAD_ALIGN == 0
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if direct else 0))
    try:
        size = os.fstat(fd).st_size
        if size > len(buf):
            return None
        done = 0
        if direct:
            # Round up when the buffer allows (the kernel stops at end of file), else
            # read the 4096-multiple body direct and the short tail buffered.
            body = align_up(size) if align_up(size) <= len(buf) else size - size % PAYLOAD_ALIGN
            done = _read_exact(fd, buf[:body])
            if done < size:
                _clear_direct(fd)
        if done < size:
            done += _read_exact(fd, buf[done:size], done)
        os.utime(fd)
        return min(done, size)
    finally:
        os.close(fd)


def file_size(path: str) -> int | None:
    """The size of the regular file at ``path`` (one ``lstat``, ~2 us on a local disk);
    None if there is none (absent, or a symlink or directory). Other OSErrors raise."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def unlink_all(paths: Sequence[str]) -> list[OSError]:
    """Unlink each path; files already gone are fine. Returns the other failures."""
    failures: list[OSError] = []
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            failures.append(exc)
    return failures


def probe_direct(tmp_dir: str) -> OSError | None:
    """Try one O_DIRECT write in ``tmp_dir``: None if it works, else the error."""
    path = os.path.join(tmp_dir, f"o_direct_probe.{os.getpid()}")
    page = mmap.mmap(-1, PAYLOAD_ALIGN)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | O_DIRECT, 0o644)
        try:
            os.write(fd, page)
        finally:
            os.close(fd)
    except OSError as exc:
        return exc
    finally:
        page.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
    return None
