"""glibc malloc settings for a process that moves chunk-sized messages through grpcio.

Every streamed chunk is a fresh 2 MiB (or larger) ``bytes`` on each side of a call, and
grpc core allocates its slices alike. With glibc's defaults such a block is mapped
fresh and unmapped when freed, or the heap's top is trimmed back to the kernel after
it: either way every message faults in its 512 pages again, which here cost more than
copying the bytes (a sidecar serving 32-chunk LoadStreams took ~1,000 page faults a
call, ~4,300 a StoreStream; 0 and ~200 with these settings, benchmarks/README.md).

:func:`keep_freed_memory` raises the size above which blocks are mapped on their own
(to 32 MiB, glibc's most) and the free space the heap keeps before trimming (to
``trim_bytes``), so freed message buffers are reused instead. ``lmtier serve`` calls
it at start; an engine process that uses the streaming path (``shared_memory=False``)
may call it too, or set the same through glibc's own environment variables, which
this never overrides.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

__all__ = ["MMAP_THRESHOLD", "TRIM_BYTES", "keep_freed_memory"]

logger = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20
"""Blocks above this are mapped on their own: glibc's largest allowed threshold."""
TRIM_BYTES = 256 << 20
"""Free space at the heap's top kept before it is returned to the kernel."""

_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_THRESHOLD = -3
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_memory(trim_bytes: int = TRIM_BYTES) -> bool:
    """Make glibc keep freed message buffers for reuse (module docstring). Returns
    whether the settings were applied: False on another C library, or when the
    environment already sets glibc's malloc tunables (the operator's choice wins)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in _USER_SETTINGS):
        logger.debug("malloc settings left as the environment sets them")
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    return bool(mallopt(_M_TRIM_THRESHOLD, trim_bytes)) and applied
