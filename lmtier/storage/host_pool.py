"""The host memory pool: one region, cut into fixed-size slabs, leased out by handle.

Every chunk lmtier keeps in CPU memory, and every buffer a lower tier reads into, is
a slab of :class:`HostPool`. Why it is built this way:

* **Slabs, not allocations.** On these machines a copy into freshly allocated memory
  runs at 1.5-4 GB/s (page faults on first touch) against ~20 GB/s into reused memory.
  So the pool allocates once at start-up, touches every page then, and reuses the
  same bytes forever; the hot path never allocates a buffer. Slabs are all one size
  (a chunk each), so there is no fragmentation and a free slab is an index on a list.
* **One region.** One tensor is one allocation to pin and one ``data_ptr`` to align;
  the views of each slab (a memoryview, a torch view) are made once and handed out.
* **Aligned slabs.** Each slab starts on an ``align`` boundary (4096 by default) and
  its size is rounded up to one: O_DIRECT reads and writes need aligned buffers and
  lengths, and a chunk's payload is 4096-aligned inside it (see chunk_format).
* **Leases, not a shared counter.** Each :class:`SlabHandle` is one owner's lease:
  :meth:`SlabHandle.share` makes a new lease on the same slab (zero-copy sharing: the
  CPU tier holds one, a reader another), and each lease is released exactly once. A
  bare ``decref(index)`` could not tell a second owner's release from the same
  owner releasing twice; a lease can, so a double release raises
  :class:`~lmtier.errors.HandleError` instead of freeing a slab someone still reads.
* **Pinned when CUDA is present, decided at run time.** CUDA copies from pageable
  memory go through a staging buffer; pinned memory is what async copies need. The
  CPU-only torch build raises on ``pin_memory=True``, so ``pin=None`` asks
  ``torch.cuda.is_available()`` and ``pin=True`` without CUDA is a ``ValueError``.

* **Never more than the machine has.** Asking for more memory than the machine's
  physical memory is a :class:`~lmtier.errors.CapacityError` before anything is
  allocated (touching it all would bring the OOM killer, not an error), and an
  allocation the allocator refuses is one too, naming the size.

An exhausted pool is an expected condition: :meth:`HostPool.acquire` returns ``None``
and the caller evicts and retries. The pool never blocks and never busy-waits.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import torch

from lmtier.chunks.format import PAYLOAD_ALIGN, align_up
from lmtier.config.sizes import format_size
from lmtier.errors import CapacityError, ConfigError, HandleError

__all__ = [
    "DIRECT_IO_ALIGN",
    "HostPool",
    "SlabHandle",
    "SoleLease",
    "open_host_pool",
    "physical_memory_bytes",
]

logger = logging.getLogger(__name__)


def physical_memory_bytes() -> int | None:
    """The machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _check_sizes(slab_bytes: int, align: int) -> None:
    if slab_bytes <= 0:
        raise ValueError(f"slab size must be positive, got {slab_bytes}")
    if align <= 0 or align & (align - 1):
        raise ValueError(f"align must be a positive power of two, got {align}")


class SlabHandle:
    """One owner's lease on one slab of a :class:`HostPool`; release it exactly once.

    Make a second lease for a second owner with :meth:`share`, never by passing this
    object around: each owner's release then decrements the count once. Using a
    released handle, or releasing it again, raises :class:`HandleError`. A handle is a
    context manager that releases on exit. Made by :class:`HostPool`, not directly.
    """

    __slots__ = ("_index", "_pool", "_released")

    def __init__(self, pool: HostPool, index: int) -> None:
        self._pool = pool
        self._index = index
        self._released = False

    @property
    def index(self) -> int:
        """The slab's position in the pool (stable for the slab's lifetime)."""
        return self._index

    @property
    def released(self) -> bool:
        """Whether this lease has been released (other leases may still hold the slab)."""
        return self._released

    @property
    def refcount(self) -> int:
        """How many leases the slab has now, this one included while it is live."""
        return self._pool._refcounts[self._index]

    @property
    def view(self) -> memoryview:
        """Writable memoryview of the whole slab (``slab_bytes`` long); no copy."""
        views = self._pool._views  # read before the check: close() empties it
        self._check_usable("view")
        return views[self._index]

    @property
    def tensor(self) -> torch.Tensor:
        """1-D uint8 tensor over the slab, sharing memory with :attr:`view`."""
        tensors = self._pool._tensors
        self._check_usable("tensor")
        return tensors[self._index]

    def check(self, what: str = "the slab") -> None:
        """HandleError if this lease can no longer be used (released, pool closed, or,
        for a sidecar's lease, past its deadline)."""
        self._check_usable(what)

    def share(self) -> SlabHandle:
        """Return a new lease on the same slab for another owner (ref count + 1)."""
        pool = self._pool
        with pool._lock:
            usable = not self._released and not pool._closed
            if usable:
                pool._refcounts[self._index] += 1
        if not usable:
            raise self._misuse("share()")
        return SlabHandle(pool, self._index)

    def release(self) -> None:
        """End this lease; the slab returns to the free list when its last lease ends.

        Releasing after the pool was closed is allowed (owners release in ``finally``
        blocks during shutdown); releasing the same lease twice is a bug.
        """
        pool = self._pool
        with pool._lock:
            already = self._released
            if not already:
                self._released = True
                count = pool._refcounts[self._index] - 1
                pool._refcounts[self._index] = count
                if count == 0:
                    pool._free.append(self._index)
        if already:
            raise HandleError(
                f"slab {self._index}: lease released twice; each owner must take its own "
                "lease with share() and release only that one"
            )

    def _check_usable(self, what: str) -> None:
        if self._released or self._pool._closed:
            raise self._misuse(what)

    def _misuse(self, what: str) -> HandleError:
        # Both flags only ever go from False to True, so this names the real cause.
        if self._released:
            return HandleError(f"slab {self._index}: {what} used after its lease was released")
        return HandleError(f"slab {self._index}: {what} used after the HostPool was closed")

    def __enter__(self) -> SlabHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else f"refcount={self.refcount}"
        return f"SlabHandle(index={self._index}, {state})"


class SoleLease(SlabHandle):
    """A lease with one owner that ends its own way (a sidecar's lease, a message being
    written): no :meth:`share`, and :meth:`release` marks it released once, then
    calls :meth:`_end`. Not counted in the pool's ref counts."""

    __slots__ = ()

    @property
    def refcount(self) -> int:
        return 0 if self._released else 1

    def share(self) -> SlabHandle:
        raise HandleError(f"slab {self._index}: this lease has one owner: copy out of it instead")

    def release(self) -> None:
        if self._released:
            raise HandleError(f"slab {self._index}: lease released twice")
        self._released = True
        self._end()

    def _end(self) -> None:
        """What ending this lease does, once (nothing here)."""


class HostPool:
    """Preallocated host memory as ``num_slabs`` slabs of ``slab_bytes``, leased by handle.

    ``slab_bytes`` is rounded up to a multiple of ``align`` (a power of two); every slab
    starts on an ``align`` boundary. ``pin=None`` pins when CUDA is available. The
    constructor allocates and touches the whole region, so it is as slow as first-touch
    memory is (about 1.5 GB/s here); nothing after it allocates. Thread-safe.
    """

    def __init__(
        self,
        slab_bytes: int,
        num_slabs: int,
        *,
        pin: bool | None = None,
        align: int = 4096,
        region: torch.Tensor | None = None,
    ) -> None:
        _check_sizes(slab_bytes, align)
        if num_slabs < 0:
            raise ValueError(f"num_slabs must be >= 0, got {num_slabs}")
        self._slab_bytes = align_up(slab_bytes, align)
        self._num_slabs = num_slabs
        if region is None:
            region = self._allocate(num_slabs * self._slab_bytes + align, pin)
        else:
            # Memory someone else owns and touched (a shared-memory mapping): cut, not
            # allocated; pinning it is its owner's business.
            self._pinned = False
            if region.dtype != torch.uint8 or region.device.type != "cpu" or region.dim() != 1:
                raise ValueError("region must be a 1-D uint8 CPU tensor")
            if -region.data_ptr() % align + num_slabs * self._slab_bytes > region.numel():
                raise ValueError(f"a region of {region.numel()} bytes cannot hold the slabs")
        start = -region.data_ptr() % align
        whole = region.numpy().data  # a memoryview that keeps the tensor alive
        bounds = [start + i * self._slab_bytes for i in range(num_slabs)]
        self._first_offset = start
        self._region: torch.Tensor | None = region
        self._views = [whole[b : b + self._slab_bytes] for b in bounds]
        self._tensors = [region[b : b + self._slab_bytes] for b in bounds]
        # Invariant (under _lock): an index is on _free exactly when its count is 0.
        # _free is a stack: the slab released last is reused first, while still in cache.
        self._refcounts = [0] * num_slabs
        self._free = list(reversed(range(num_slabs)))
        self._lock = threading.Lock()
        self._closed = False

    def _allocate(self, size: int, pin: bool | None) -> torch.Tensor:
        """A new region of ``size`` bytes, every page touched (and pinned, per ``pin``)."""
        cuda = torch.cuda.is_available()
        if pin and not cuda:
            raise ValueError("pinned memory needs CUDA (pin=True on a machine without it)")
        self._pinned = cuda if pin is None else pin
        physical = physical_memory_bytes()
        if physical is not None and size > physical:
            raise CapacityError(
                f"the host pool would need {format_size(size)} of host memory, more than this "
                f"machine's {format_size(physical)}: lower cpu.capacity_bytes or "
                "cpu.staging_bytes"
            )
        # `align` spare bytes let the first slab start on a boundary wherever the
        # allocator put the region. zero_() touches every page now, not on the hot path.
        try:
            region = torch.empty(size, dtype=torch.uint8, pin_memory=self._pinned)
            region.zero_()
        except (RuntimeError, MemoryError) as exc:
            raise CapacityError(
                f"cannot allocate {format_size(size)} of host memory for the host pool "
                f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}): lower "
                "cpu.capacity_bytes or cpu.staging_bytes"
            ) from exc
        return region

    @classmethod
    def for_chunks(
        cls, chunk_bytes: int, capacity_bytes: int, *, pin: bool | None = None, align: int = 4096
    ) -> HostPool:
        """A pool of as many ``chunk_bytes`` slabs as fit in ``capacity_bytes``.

        ``capacity_bytes == 0`` gives an empty pool; a positive capacity too small for
        one (aligned) slab is a :class:`CapacityError`, since such a tier could hold
        nothing and every put would silently miss.
        """
        _check_sizes(chunk_bytes, align)
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        stride = align_up(chunk_bytes, align)
        num_slabs = capacity_bytes // stride
        if capacity_bytes > 0 and num_slabs == 0:
            raise CapacityError(
                f"host pool capacity of {capacity_bytes} bytes cannot hold one chunk of "
                f"{chunk_bytes} bytes ({stride} bytes once aligned to {align})"
            )
        return cls(chunk_bytes, num_slabs, pin=pin, align=align)

    @property
    def first_slab_offset(self) -> int:
        """Where slab 0 starts in the region (slab ``i`` is ``i * slab_bytes`` further)."""
        return self._first_offset

    @property
    def slab_bytes(self) -> int:
        """Usable bytes per slab: the requested size rounded up to ``align``."""
        return self._slab_bytes

    @property
    def num_slabs(self) -> int:
        """How many slabs the pool has in all."""
        return self._num_slabs

    @property
    def num_free(self) -> int:
        """How many slabs no lease holds (a snapshot: other threads may change it)."""
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        """How many slabs at least one lease holds."""
        return self._num_slabs - len(self._free)

    @property
    def pinned(self) -> bool:
        """Whether the region is page-locked (pinned) for CUDA copies."""
        return self._pinned

    @property
    def nbytes(self) -> int:
        """Usable bytes in all slabs; the region is up to ``align`` bytes larger."""
        return self._num_slabs * self._slab_bytes

    def acquire(self) -> SlabHandle | None:
        """Lease a free slab (ref count 1), or return ``None`` when every slab is in use.

        ``None`` is expected under load: the caller evicts and tries again.
        """
        with self._lock:
            self._check_open()
            if not self._free:
                return None
            index = self._free.pop()
            self._refcounts[index] = 1
        return SlabHandle(self, index)

    def close(self) -> None:
        """Drop the region; later use of any handle raises. Idempotent.

        Leases still held are leaks in the caller and are logged as a warning. Views
        already handed out keep their memory alive until they are dropped, so a late
        reader sees stale bytes, never freed memory.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            in_use = self._num_slabs - len(self._free)
            self._views = []
            self._tensors = []
            self._region = None
        if in_use:
            logger.warning(
                "HostPool closed with %d of %d slabs still leased (leaked handles)",
                in_use,
                self._num_slabs,
            )

    def _check_open(self) -> None:
        if self._closed:
            raise HandleError("HostPool used after close()")

    def __repr__(self) -> str:
        return (
            f"HostPool(slab_bytes={self._slab_bytes}, num_slabs={self._num_slabs}, "
            f"num_free={self.num_free}, pinned={self._pinned})"
        )


DIRECT_IO_ALIGN = 4096
"""Alignment of memory that O_DIRECT reads land in (a page)."""


def open_host_pool(
    slab_bytes: int,
    *,
    cached_bytes: int,
    staging_bytes: int,
    direct_io: bool,
    region: Callable[[int], torch.Tensor] | None = None,
) -> tuple[HostPool, int]:
    """The host pool of a cache (its cached slabs, then staging) and how many slabs
    the CPU tier gets: ``cached_bytes`` (``cpu.capacity_bytes`` when the CPU tier is
    on, else 0) plus ``staging_bytes`` (``cpu.staging_bytes``), in whole slabs of
    ``slab_bytes``, allocated now. It takes numbers, not the configuration, so that
    storage stays above config and a pool can be opened without one.

    Slabs are aligned to the chunk format's payload alignment (64 bytes), or to a page
    where a tier reads with O_DIRECT into them (``direct_io``: the disk's ``o_direct``):
    a 32 KiB chunk then takes 32.25 KiB of host memory, not 36. ConfigError when the
    settings leave no slab at all. ``region(size)``, when given, supplies the memory
    (the sidecar's shared mapping) instead of an allocation.
    """
    align = DIRECT_IO_ALIGN if direct_io else PAYLOAD_ALIGN
    stride = align_up(slab_bytes, align)
    cache_slabs = cached_bytes // stride
    staging_slabs = staging_bytes // stride
    if cached_bytes and not cache_slabs:
        raise ConfigError(
            f"cpu.capacity_bytes of {format_size(cached_bytes)} holds no chunk of "
            f"{format_size(stride)}; raise it, or set cpu.enabled: false"
        )
    if not cache_slabs + staging_slabs:
        raise ConfigError(
            f"cpu.staging_bytes of {format_size(staging_bytes)} holds no chunk of "
            f"{format_size(stride)} and the CPU tier holds none: raise cpu.staging_bytes"
        )
    num_slabs = cache_slabs + staging_slabs
    memory = None if region is None else region(num_slabs * stride + align)
    pool = HostPool(slab_bytes, num_slabs, align=align, region=memory)
    logger.info(
        "host memory: %s = %d cached + %d staging chunks of %s%s",
        format_size(pool.nbytes),
        cache_slabs,
        staging_slabs,
        format_size(pool.slab_bytes),
        " (pinned)" if pool.pinned else "",
    )
    return pool, cache_slabs
