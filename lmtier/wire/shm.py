"""The sidecar's host pool as shared memory: one file under a tmpfs, mapped by the
sidecar and by every local client, cut into the same slabs on both sides.

Why a file and not an anonymous mapping passed as a descriptor: gRPC cannot pass
descriptors, a path works across containers that share ``/dev/shm``, and a client
re-maps it after a reconnect without a side channel. The file is created ``0600``
(``O_EXCL``, no symlinks followed), so only the sidecar's own user can map it; other
users' clients stream chunk bytes over gRPC instead. Its name carries the sidecar's
pid: a sidecar that starts removes the files of sidecars that died without cleaning
up (SIGKILL), and one that stops unlinks its own (mappings stay valid until unmapped).

On CUDA a client registers its mapping as pinned memory (``cudaHostRegister``), so
copies between GPU pages and slabs are DMA on the transfer engine's streams.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import stat
from pathlib import Path

import torch

from lmtier.config.sizes import format_size
from lmtier.errors import CapacityError, ConfigError

__all__ = ["SharedRegion"]

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^lmtier-(\d+)-[0-9a-f]{16}\.pool$")


class SharedRegion:
    """A shared mapping of ``size`` bytes as a 1-D uint8 tensor (:attr:`tensor`).

    Made by :meth:`create` (the sidecar: owns and unlinks the file) or :meth:`attach`
    (a client). The mapping lives as long as some view of it does; :meth:`close`
    drops this object's references and, for the owner, unlinks the file.
    """

    def __init__(self, path: Path, size: int, mapping: mmap.mmap, *, owner: bool) -> None:
        self.path = path
        self.size = size
        self.owner = owner
        self._mapping: mmap.mmap | None = mapping
        self.tensor: torch.Tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=size)
        self._registered = False

    @classmethod
    def create(cls, directory: Path, size: int) -> SharedRegion:
        """A new zero-filled region in ``directory`` (every page touched now)."""
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        if not directory.is_dir():
            raise ConfigError(f"sidecar.shm_dir {str(directory)!r} is not a directory")
        remove_stale(directory)
        free = _free_bytes(directory)
        if free is not None and size > free:
            raise CapacityError(
                f"the shared host pool needs {format_size(size)}, and {directory} has "
                f"{format_size(free)} free: lower cpu.capacity_bytes, or enlarge the tmpfs"
            )
        path = directory / f"lmtier-{os.getpid()}-{secrets.token_hex(8)}.pool"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        region = cls(path, size, mapping, owner=True)
        try:
            region.tensor.zero_()  # fault every page in now, not on the hot path
        except BaseException:  # SIGBUS surfaces as a crash; a MemoryError does not
            region.close()
            raise
        logger.info("shared host pool: %s at %s", format_size(size), path)
        return region

    @classmethod
    def attach(cls, path: Path, size: int) -> SharedRegion:
        """Map an existing region (a client): a regular file of at least ``size`` bytes
        owned by this user. OSError when it cannot be opened (another user's sidecar,
        another machine): the caller then streams instead."""
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size < size:
                raise OSError(f"{path} is not a shared host pool of {size} bytes")
            if info.st_uid != os.getuid() or info.st_mode & 0o077:
                raise OSError(f"{path} is not owned by this user with mode 0600")
            # MAP_POPULATE maps every page now (~0.15 s per GiB here): without it each
            # slab's first use page-faults, and a first store ran at a quarter speed.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, size, mapping, owner=False)

    def pin(self) -> bool:
        """Register the mapping with CUDA as pinned memory (page-locked: copies to and
        from the GPU are DMA). False without CUDA. Idempotent."""
        if self._registered or not torch.cuda.is_available():
            return self._registered
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        code = cudart.cudaHostRegister(self.tensor.data_ptr(), self.size, 0)
        if int(code) != 0:
            logger.warning("cudaHostRegister of the shared pool failed (error %s)", int(code))
            return False
        self._registered = True
        return True

    def close(self) -> None:
        """Unregister from CUDA, drop this object's mapping reference, and (the owner)
        unlink the file. Views still held keep the memory mapped. Idempotent."""
        if self._registered:
            self._registered = False
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            cudart.cudaHostUnregister(self.tensor.data_ptr())
        if self.owner and self._mapping is not None:
            self.path.unlink(missing_ok=True)
        self._mapping = None


def remove_stale(directory: Path) -> int:
    """Unlink pool files in ``directory`` left by sidecars (of this user) that are dead.
    Returns how many. Never raises: a file it cannot judge is left alone."""
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        found = _NAME.match(entry.name)
        if found is None or _alive(int(found.group(1))):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid == os.getuid():
                os.unlink(entry.path)
                removed += 1
        except OSError:
            continue
    if removed:
        logger.info("removed %d shared pool file(s) of dead sidecars in %s", removed, directory)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _free_bytes(directory: Path) -> int | None:
    try:
        info = os.statvfs(directory)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize
