"""The disk tier's directory: its layout, its permissions, and what opening it does.

Layout::

    <path>/v1/<c[:2]>/<n><c>.lmtc   n, c = the key's namespace and chain halves, 32 hex
                                    digits each; 256 shards by chain, so one namespace
                                    spreads evenly and ``rm v1/*/<n>*`` drops it
    <path>/v1/<c[:2]>/.<key>.<pid>.<i>.tmp
                                    a write in flight, renamed over its chunk file when
                                    complete (in the same directory: see below)
    <path>/v1/tmp/                  probes at open (and temp files of older versions)
    <path>/v1/ledger                bytes of chunk files, shared by every process
                                    (:mod:`lmtier_backends.disk.ledger`)
    <path>/v1/pins                  pinned keys, one per line (:mod:`lmtier.storage.pins`)

Permissions: chunk files, the ledger and the pins file get the tier's ``file_mode``
(default 0600) and the directories under ``v1`` the matching search bits (0700),
whatever the umask, and directories an older install made wider are narrowed at
open; so do ``disk.path`` and its parents when the tier creates them (existing ones
are the deployment's): cached KV can reveal prompts, so other local users must not
read it, nor see which prompts were cached, unless the deployment says so.

Temp files live beside their chunk file, not in one shared directory: a rename
within a directory needs no filesystem-wide rename lock, and creates spread over 256
directories do not queue on one directory's lock (32 KiB writes on 4 threads here:
~80 us a file against ~110-150 us through ``tmp/``).

Opening (:func:`prepare`, blocking) creates the directories, proves that a file can be
created (a read-only or foreign directory is a ConfigError at open, naming
``disk.path``, rather than an error per write), deletes crash debris, lists the chunk
files and sets the shared ledger from them. Several processes may share one
directory, so the scan tolerates files that vanish under it, and deletes only the
temp files no live process may still be writing.

A directory removed while open (an operator clearing the cache with ``rm -rf``, a
tmp cleaner) is recreated by the next write that finds it gone
(:func:`restore_dirs`, then the write is retried): the chunks in it are lost, which
costs misses, but the tier keeps storing instead of failing every write until a
restart. Index entries of the removed files leave as reads miss them or as they age
out, like files another process deleted.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import re
import stat
import time
from dataclasses import dataclass, field

from lmtier.chunks.keys import ChunkKey
from lmtier_backends.disk.io import probe_write
from lmtier_backends.disk.ledger import LEDGER_NAME, Ledger

__all__ = [
    "CHUNK_SUFFIX",
    "PINS_NAME",
    "TEMP_SUFFIX",
    "ScanResult",
    "dir_mode",
    "explain_open_error",
    "list_namespace",
    "make_chunk_dirs",
    "prepare",
    "restore_dirs",
    "scan_chunk_dir",
    "temp_name",
]

logger = logging.getLogger(__name__)

CHUNK_SUFFIX = ".lmtc"
PINS_NAME = "pins"
TEMP_SUFFIX = ".tmp"
_CHUNK_NAME = re.compile(r"[0-9a-f]{64}\.lmtc")
_TEMP_NAME = re.compile(r"\.?[0-9a-f]{64}\.[0-9]+\.[0-9]+\.tmp")
_SHARD_NAMES = tuple(f"{i:02x}" for i in range(256))
TEMP_MAX_AGE_S = 3600.0
"""A temp file older than this is debris even if the process that named it still runs."""
_temp_ids = itertools.count()  # per process, shared by every tier: names never collide


def temp_name(key: ChunkKey) -> str:
    """A fresh temp file name for a write of ``key``: ``.<key>.<pid>.<n>.tmp``, in the
    directory of its chunk file.

    The pid keeps processes sharing a directory apart (O_EXCL would refuse a clash),
    and tells another process's start-up scan whether the write may still be running.
    """
    return f".{key.hex()}.{os.getpid()}.{next(_temp_ids)}{TEMP_SUFFIX}"


def _maybe_in_flight(entry: os.DirEntry[str], now: float) -> bool:
    """Whether temp file ``entry`` may be a write still in flight: named by
    :func:`temp_name` in a process that still runs, and under ``TEMP_MAX_AGE_S`` old."""
    parts = entry.name.removeprefix(".").split(".")
    if len(parts) != 4 or not parts[1].isdigit() or int(parts[1]) <= 0:
        return False
    try:
        os.kill(int(parts[1]), 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    except (OverflowError, OSError):
        return False
    try:
        return now - entry.stat(follow_symlinks=False).st_mtime < TEMP_MAX_AGE_S
    except FileNotFoundError:
        return True  # renamed into place (or removed) meanwhile: not ours to touch


@dataclass(slots=True)
class ScanResult:
    """What a start-up scan found: chunk files, oldest first, and what it left alone."""

    entries: list[tuple[ChunkKey, int]] = field(default_factory=list)
    """(key, file size), ordered by mtime, oldest first."""
    foreign: list[str] = field(default_factory=list)
    """Paths of entries that are not ours: left in place, never indexed."""
    removed_temps: int = 0
    total: int = 0
    """Bytes of the chunk files found."""


def _remove_debris(entry: os.DirEntry[str], now: float) -> int:
    """Unlink temp file ``entry`` unless a live writer may still be writing it; 1 if
    it went. Temp files are debris of writes that never reached their rename (a crash):
    no reader can see them."""
    if _maybe_in_flight(entry, now):
        return 0
    try:
        os.unlink(entry.path)
    except FileNotFoundError:
        return 0  # renamed into place, or another process's scan took it
    return 1


def _chunk_dirs(root: str) -> tuple[str, ...]:
    """``root`` and the directories under it that the layout needs."""
    return (root, os.path.join(root, "tmp"), *(os.path.join(root, s) for s in _SHARD_NAMES))


def make_chunk_dirs(root: str, mode: int) -> None:
    """Create ``root`` with its shard and tmp directories, each with exactly ``mode``
    (the umask cannot widen or narrow it; existing ones are changed too), and the
    directories above ``root`` that do not exist yet (``disk.path`` and its missing
    parents) with ``mode`` too: ``os.makedirs`` gave those the umask's 0755. Blocking."""
    _make_missing_parents(os.path.dirname(root), mode)
    for path in _chunk_dirs(root):
        os.makedirs(path, mode=mode, exist_ok=True)
        if stat.S_IMODE(os.stat(path).st_mode) != mode:
            os.chmod(path, mode)


def _make_missing_parents(path: str, mode: int) -> None:
    """Create ``path`` and its missing parents, each with exactly ``mode``. Directories
    that exist are the deployment's (``/mnt/nvme``, ``~/.cache``) and are left alone."""
    missing: list[str] = []
    while path and not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, mode)
        except FileExistsError:
            continue  # another process made it meanwhile (or a file is in the way: the
            # next mkdir says so)
        os.chmod(directory, mode)  # the umask may have taken bits


def scan_chunk_dir(root: str) -> ScanResult:
    """Delete temp files of ``root``, list its chunk files and their total size.

    Blocking; run it in a worker thread, after :func:`make_chunk_dirs`. Temp files
    (beside chunk files, or in ``tmp/`` from older versions) go, except those another
    live process may still be writing (:func:`temp_name`). Files that vanish during the
    scan (another process evicting) are skipped.
    """
    result = ScanResult()
    tmp_dir = os.path.join(root, "tmp")
    now = time.time()
    with os.scandir(tmp_dir) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                result.foreign.append(entry.path)
            else:
                result.removed_temps += _remove_debris(entry, now)
    known = {*_SHARD_NAMES, "tmp", LEDGER_NAME, PINS_NAME}
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.name not in known:
                result.foreign.append(entry.path)
    found: list[tuple[int, ChunkKey, int]] = []
    sizes: dict[int, int] = {}  # share one int object per distinct size: chunks mostly agree
    for shard in _SHARD_NAMES:
        with os.scandir(os.path.join(root, shard)) as entries:
            for entry in entries:
                name = entry.name
                if name.endswith(TEMP_SUFFIX) and _TEMP_NAME.fullmatch(name):
                    result.removed_temps += _remove_debris(entry, now)
                elif (
                    name[32:34] == shard
                    and _CHUNK_NAME.fullmatch(name)
                    and entry.is_file(follow_symlinks=False)
                ):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # evicted by another process sharing the directory
                    size = sizes.setdefault(st.st_size, st.st_size)
                    found.append((st.st_mtime_ns, ChunkKey(bytes.fromhex(name[:64])), size))
                else:
                    result.foreign.append(entry.path)
    found.sort(key=lambda item: item[0])
    result.entries = [(key, size) for _, key, size in found]
    result.total = sum(size for _, _, size in found)
    return result


def list_namespace(root: str, namespace: bytes) -> list[ChunkKey]:
    """The keys of every chunk file of one namespace under ``root``, whoever wrote it:
    names starting with its 32 hex digits, in each of the 256 shards (a namespace
    spreads over all of them). Blocking: one ``scandir`` per shard, no ``stat``."""
    start = namespace.hex()
    keys: list[ChunkKey] = []
    for shard in _SHARD_NAMES:
        with os.scandir(os.path.join(root, shard)) as entries:
            keys.extend(
                ChunkKey(bytes.fromhex(entry.name[:64]))
                for entry in entries
                if entry.name.startswith(start) and _CHUNK_NAME.fullmatch(entry.name)
            )
    return keys


def dir_mode(file_mode: int) -> int:
    """Directory permissions matching file permissions: rw- -> rwx (search bit)."""
    return file_mode | ((file_mode & 0o444) >> 2)


def prepare(root: str, file_mode: int, ledger: Ledger) -> ScanResult:
    """Blocking start-up of the directory ``root`` (module docstring)."""
    make_chunk_dirs(root, dir_mode(file_mode))
    probe_write(os.path.join(root, "tmp"), file_mode)
    scan = scan_chunk_dir(root)
    ledger.open(file_mode)
    ledger.reset(scan.total)
    return scan


def restore_dirs(root: str, file_mode: int, ledger: Ledger) -> bool:
    """Make ``root`` whole again if part of it was removed while open (module
    docstring); whether it was. Blocking; OSError if it cannot be recreated."""
    if os.path.exists(ledger.path) and all(os.path.isdir(p) for p in _chunk_dirs(root)):
        return False
    prepare(root, file_mode, ledger)  # the ledger's new file replaces the removed one
    logger.warning("disk directory %s was removed while open; recreated it", root)
    return True


def explain_open_error(path: str, exc: OSError) -> str:
    """One line that says why ``disk.path`` cannot hold chunks and what to change."""
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        problem = "is not a directory (a file is in the way)"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        problem = "is not writable by this user (or its chunk directories are not ours)"
    elif exc.errno == errno.EROFS:
        problem = "is on a read-only filesystem"
    else:
        problem = f"cannot hold chunks: {exc.strerror or exc}"
    return f"disk.path {path!r} {problem}; choose another disk.path, or set disk.enabled: false"
