"""Copies between host tensors on threads that wait without spinning, never through
torch's intra-op thread pool.

torch splits a large ``copy_`` over its intra-op threads (one per core by default),
which spin at the end of every copy until the slowest has finished. Beside an
inference engine the cores are busy: one thread preempted stalls the whole copy, and
the others burn the CPU it needs. Measured on 2 cores with one other busy process, a
2-thread ``copy_`` of a chunk's strided KV ran 3x slower than a 1-thread one (0.27
against 0.83 GB/s), and ``LMTier.store`` into host memory spent most of its time
there. The thread count is the engine's (a process-wide setting), so lmtier does not
change it: it copies host to host with numpy, which releases the GIL.

A large copy is cut into pieces that the calling thread and up to
``len(sched_getaffinity) - 1`` helper threads (at most :data:`MAX_HELPERS`) take one
at a time until none is left. On a quiet machine the helpers share the work, as
torch's threads would; on a busy one a helper that is not scheduled takes fewer
pieces, or none, and the calling thread waits only for a piece a helper has begun.
No thread spins: a helper waits for work on a queue, the caller on an event. Any
other copy (a device on either end, dtypes that differ) stays ``copy_``.

A copy may say what to do with each pair once it is copied (``then``): the thread
that copies a pair's last piece runs it at once, while the bytes are still in the
cache it wrote them through. A store hashes each chunk this way (a 2 MiB chunk hashes
at ~60 GB/s from the cache, ~22 GB/s from memory later).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

__all__ = ["MAX_HELPERS", "PIECE_BYTES", "copy_into", "copy_many"]

_SAME_WIDTH_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""What a dtype numpy lacks (bfloat16, float8) is viewed as for a bytewise copy."""

_NUMPY_DTYPES = frozenset(
    {
        torch.float16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)
"""Torch dtypes numpy has (``Tensor.numpy()`` takes them as they are)."""

PIECE_BYTES = 1 << 20
"""The least a piece of a shared copy holds: below this, handing it to another thread
costs about what it saves (a wake-up is ~10-50 us, 1 MiB ~100-200 us to copy)."""

MAX_HELPERS = 3
"""Helper threads at most: a host's memory bandwidth is spent by about four copiers."""

PIECES_PER_THREAD = 4
"""Pieces per thread that may copy: enough that a thread scheduled late costs the copy
at most about a quarter of its share."""


def copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)``, shared with helper threads when both are ordinary host
    tensors of one dtype and shape (module docstring); otherwise torch's own copy."""
    copy_many([(target, source)])


Then = Sequence[Callable[[], None] | None]
"""Per pair of a copy, what to run once that pair is copied (None: nothing)."""


def copy_many(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], then: Then = ()) -> None:
    """:func:`copy_into` for each ``(target, source)``, all of them one shared copy: a
    store's batch of chunks is cut into pieces together, so that chunks smaller than
    a piece are still copied by several threads at once. ``then[i]``, where given, runs
    once pair ``i`` is copied, on the thread that copied its last piece (module
    docstring); an exception it raises is raised here, after the whole copy."""
    if then and len(then) != len(pairs):
        raise ValueError(f"{len(then)} follow-ups for {len(pairs)} pairs")
    arrays: Pieces = []
    follow: list[Callable[[], None] | None] = []
    for at, (target, source) in enumerate(pairs):
        after = then[at] if then else None
        if _plain_host_pair(target, source):
            arrays.append((_as_numpy(target), _as_numpy(source)))
            follow.append(after)
        else:
            target.copy_(source)
            if after is not None:
                after()
    if arrays:
        _copy_arrays(arrays, follow)


def _plain_host_pair(target: torch.Tensor, source: torch.Tensor) -> bool:
    return (
        target.device.type == "cpu"
        and source.device.type == "cpu"
        and target.dtype == source.dtype
        and target.shape == source.shape
        and target.layout == source.layout == torch.strided
        and target.numel() > 0
        and not (target.is_conj() or source.is_conj() or target.is_neg() or source.is_neg())
    )


def _as_numpy(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    """A numpy view of ``tensor``'s memory (a same-width integer view where numpy has no
    such dtype): no copy, same strides."""
    tensor = tensor.detach()
    if tensor.dtype in _NUMPY_DTYPES:
        return tensor.numpy()
    # Asked first, not tried: torch's TypeError for bfloat16 cost 14 us a tensor, ten
    # times the view (1.6 ms of a 64-page SGLang load).
    return tensor.view(_SAME_WIDTH_INTS[tensor.element_size()]).numpy()


Pieces = list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]


def _copy_arrays(arrays: Pieces, then: list[Callable[[], None] | None]) -> None:
    helpers = _helpers()
    total = sum(target.nbytes for target, _ in arrays)
    if helpers == 0 or total < 2 * PIECE_BYTES:
        for (target, source), after in zip(arrays, then, strict=True):
            np.copyto(target, source, casting="no")
            if after is not None:
                after()
        return
    size = max(PIECE_BYTES, total // ((helpers + 1) * PIECES_PER_THREAD))
    cuts = [_pieces(*pair, size) for pair in arrays]
    pieces = [(target, source, at) for at, cut in enumerate(cuts) for target, source in cut]
    shared = _SharedCopy(pieces, [len(cut) for cut in cuts], then)
    pool = _Pool.get(helpers)
    for _ in range(min(helpers, len(pieces) - 1)):
        pool.submit(shared.work)
    shared.work()
    shared.wait()


def _pieces(target: np.ndarray[Any, Any], source: np.ndarray[Any, Any], size: int) -> Pieces:
    """``target`` and ``source`` cut along one axis (the first long enough, else the
    longest) into pieces of about ``size`` bytes; whole when they hold less."""
    count = target.nbytes // size
    if count < 2:
        return [(target, source)]
    shape = target.shape
    axis = next((i for i, n in enumerate(shape) if n >= count), int(np.argmax(shape)))
    count = min(count, shape[axis])
    if count < 2:
        return [(target, source)]
    bounds = [shape[axis] * i // count for i in range(count + 1)]
    lead = (slice(None),) * axis
    return [
        (target[(*lead, slice(a, b))], source[(*lead, slice(a, b))])
        for a, b in itertools.pairwise(bounds)
    ]


class _SharedCopy:
    """Pieces taken one at a time by whichever thread asks next (module docstring);
    each piece names its pair, whose follow-up runs after the pair's last piece."""

    def __init__(
        self,
        pieces: list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], int]],
        counts: list[int],
        then: list[Callable[[], None] | None],
    ) -> None:
        self._pieces = pieces
        self._next = itertools.count()  # next() is atomic under the GIL
        self._left = len(pieces)
        self._pair_left = counts
        self._then = then
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: BaseException | None = None

    def work(self) -> None:
        """Copy pieces until none is left to take."""
        pieces = self._pieces
        while (index := next(self._next)) < len(pieces):
            target, source, pair = pieces[index]
            try:
                np.copyto(target, source, casting="no")
            except BaseException as exc:  # raised in the caller's thread (wait)
                self._error = exc
            with self._lock:
                self._pair_left[pair] -= 1
                after = self._then[pair] if self._pair_left[pair] == 0 else None
            if after is not None and self._error is None:
                try:
                    after()
                except BaseException as exc:
                    self._error = exc
            with self._lock:
                self._left -= 1
                if self._left == 0:
                    self._done.set()

    def wait(self) -> None:
        """Until every piece is copied (those a helper has begun included)."""
        self._done.wait()
        if self._error is not None:
            raise self._error


def _helpers() -> int:
    """Helper threads for this process: the CPUs it may run on, less the caller's."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    return max(0, min(MAX_HELPERS, cpus - 1))


class _Pool:
    """The helper threads, started on first use (none in a process that never copies)."""

    lock = threading.Lock()
    executor: ThreadPoolExecutor | None = None

    @classmethod
    def get(cls, helpers: int) -> ThreadPoolExecutor:
        with cls.lock:
            if cls.executor is None:
                cls.executor = ThreadPoolExecutor(helpers, thread_name_prefix="lmtier-copy")
            return cls.executor

    @classmethod
    def forget(cls) -> None:
        """In a forked child: the parent's helper threads do not exist here (work handed
        to them would wait forever, holding its arrays), so a new pool starts on use."""
        cls.lock, cls.executor = threading.Lock(), None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_Pool.forget)
