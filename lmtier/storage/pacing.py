"""How many chunks one call to a tier should carry, so that a slow tier still serves.

Every call to a byte tier runs under a deadline (:class:`~lmtier.storage.budget.CallBudget`):
``timeout_s``, plus the call's bytes at the tier's floor rate where it declares one. A
call that takes longer counts as a failure and its chunks are misses: 120 chunks over
a healthy 1.6 MB/s link never arrive within half a second, while 16 at a time do.

:class:`BatchPacer` sizes each call from the throughput the tier has shown: a batch is
as many chunks as the measured rate moves in ``TARGET_FRACTION`` of ``timeout_s``
(a quarter second for Redis, a second for S3 at the defaults). The batch's deadline
is at least ``timeout_s`` and grows with its bytes, so the margin between the time
planned and the time allowed is at least 1 / ``TARGET_FRACTION`` and grows with the
batch: a Redis batch of 200 chunks of 2 MiB planned for 0.25 s may take 6.8 s. (With
one fixed timeout per batch the margin was 2x and no more: such batches took over
0.5 s when the CPU was shared, and each was lost whole.) Batches are not made as
large as the deadline would allow: a batch's bookkeeping runs on the event loop in
one go (gathering 512 reads, decoding 1 GiB held it ~0.2 s), and a hang loses the
batch in flight.

Until a call has finished it starts small (``INITIAL_CHUNKS``: the first batch
measures a tier that may be slow); a rate measured on a small batch underestimates a
larger one (more requests in parallel), so growing straight to the rate's size is
safe. A call that times out halves the batch and lowers the rate estimate to what
that call proves (it moved less than its bytes in its deadline). The StorageManager
sends the batches of one load one after another and serves the leading run that
arrived, so a slow but healthy tier serves a long prompt at its own speed, and one
whose single chunk cannot arrive within its deadline is a miss (raise its
``timeout_s``).
"""

from __future__ import annotations

import math

from lmtier.storage.budget import CallBudget

__all__ = ["INITIAL_CHUNKS", "MAX_CHUNKS", "TARGET_FRACTION", "BatchPacer"]

INITIAL_CHUNKS = 4
"""Chunks in a tier's first batch, before its speed is known."""
MAX_CHUNKS = 512
"""Most chunks in one batch (a 128k-token prompt at chunk size 256)."""
TARGET_FRACTION = 0.5
"""A batch should take this fraction of ``timeout_s`` at the measured rate."""
_SMOOTHING = 0.3
"""Weight of the newest measurement in the rate estimate (an EWMA)."""


class BatchPacer:
    """Batch sizes for one tier and one direction (reads or writes); not thread-safe
    (the StorageManager uses it from its event loop only).

    ``budget``: the tier's :class:`~lmtier.storage.budget.CallBudget` (its guard's
    ``budget``); a number is a fixed timeout per call.
    """

    __slots__ = ("_limit", "budget", "rate")

    def __init__(self, budget: CallBudget | float) -> None:
        self.budget = budget if isinstance(budget, CallBudget) else CallBudget(budget)
        self.rate: float | None = None
        """Bytes per second the tier has shown (None until a call has finished)."""
        self._limit = INITIAL_CHUNKS

    @property
    def timeout_s(self) -> float:
        """The fixed part of a call's deadline."""
        return self.budget.timeout_s

    def size(self, chunk_bytes: int, remaining: int) -> int:
        """Chunks for the next call (1 to ``remaining``), chunks of about ``chunk_bytes``."""
        count = self._limit
        if self.rate is not None and chunk_bytes > 0:
            planned_s = self.budget.timeout_s * TARGET_FRACTION
            count = min(count, max(1, math.floor(self.rate * planned_s / chunk_bytes)))
        return max(1, min(count, remaining, MAX_CHUNKS))

    def succeeded(self, num_bytes: int, seconds: float, count: int) -> None:
        """A call of ``count`` chunks moved ``num_bytes`` in ``seconds``."""
        if num_bytes > 0 and seconds > 0:
            measured = num_bytes / seconds
            self.rate = (
                measured
                if self.rate is None
                else (1 - _SMOOTHING) * self.rate + _SMOOTHING * measured
            )
        self._limit = MAX_CHUNKS if num_bytes > 0 else min(MAX_CHUNKS, max(self._limit, 2 * count))

    def timed_out(self, num_bytes: int, count: int) -> None:
        """A call of ``count`` chunks (``num_bytes`` in all) did not finish in time."""
        self._limit = max(1, count // 2)
        proven = num_bytes / self.budget.seconds(num_bytes=num_bytes)  # it moved less
        self.rate = proven if self.rate is None else min(self.rate, proven)
