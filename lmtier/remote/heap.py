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
it at start. A client never changes its process's malloc on its own: an engine that
uses the streaming path (``shared_memory=False``) may call it (or set both thresholds
through glibc's own environment variables, which this never overrides), and its
streaming stores then write each chunk straight into its message
(:func:`reuses_freed_memory`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

__all__ = ["MMAP_THRESHOLD", "TRIM_BYTES", "keep_freed_memory", "reuses_freed_memory"]

logger = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20
"""Blocks above this are mapped on their own: glibc's largest allowed threshold."""
TRIM_BYTES = 256 << 20
"""Free space at the heap's top kept before it is returned to the kernel."""

_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_THRESHOLD = -3
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


class _Settings:
    applied = False  # keep_freed_memory() applied them in this process


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
    mapped = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    _Settings.applied = bool(mallopt(_M_TRIM_THRESHOLD, trim_bytes)) and mapped
    return _Settings.applied


def reuses_freed_memory() -> bool:
    """Whether this process's malloc keeps freed message-sized buffers: set here by
    :func:`keep_freed_memory`, or both thresholds set by the environment. A streaming
    store writes chunks straight into fresh messages only then: with glibc's defaults
    a batch of fresh 2 MiB messages is faulted in afresh every store, which costs more
    than the copy it saves (0.58x a raw stream against 0.78x copying)."""
    if _Settings.applied:
        return True
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    mmap = "MALLOC_MMAP_THRESHOLD_" in os.environ or "glibc.malloc.mmap_threshold" in tunables
    trim = "MALLOC_TRIM_THRESHOLD_" in os.environ or "glibc.malloc.trim_threshold" in tunables
    return mmap and trim
