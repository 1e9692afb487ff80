"""How many chunks one call to a tier should carry, so that a slow tier still serves.

Every call to a byte tier runs under the tier's timeout (``timeout_s``): a call that
takes longer counts as a failure, and its chunks are misses. A batch sized without
regard to the tier's speed is all-or-nothing: 120 chunks over a healthy 1.6 MB/s
link never arrive within half a second, so a long prompt would miss on every try
while 16 chunks at a time fit easily.

:class:`BatchPacer` sizes each call from the throughput the tier has shown: a batch
is as many chunks as the measured rate moves in ``TARGET_FRACTION`` of the timeout.
Until a call has finished it starts small (``INITIAL_CHUNKS``); a rate measured on a
small batch underestimates a larger one (more requests in parallel), so growing
straight to the rate's size is safe. A call that times out halves the batch and
lowers the rate estimate to what that call proves. The
StorageManager sends the batches of one load one after another and serves the
leading run that arrived, so a slow but healthy tier serves a long prompt at its own
speed, and one whose single chunk cannot arrive within the timeout is a miss (raise
its ``timeout_s``).
"""

from __future__ import annotations

import math

__all__ = ["INITIAL_CHUNKS", "MAX_CHUNKS", "TARGET_FRACTION", "BatchPacer"]

INITIAL_CHUNKS = 4
"""Chunks in a tier's first batch, before its speed is known."""
MAX_CHUNKS = 512
"""Most chunks in one batch (a 128k-token prompt at chunk size 256)."""
TARGET_FRACTION = 0.5
"""A batch should take this fraction of the tier's timeout at the measured rate."""
_SMOOTHING = 0.3
"""Weight of the newest measurement in the rate estimate (an EWMA)."""


class BatchPacer:
    """Batch sizes for one tier and one direction (reads or writes); not thread-safe
    (the StorageManager uses it from its event loop only)."""

    __slots__ = ("_limit", "rate", "timeout_s")

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.rate: float | None = None
        """Bytes per second the tier has shown (None until a call has finished)."""
        self._limit = INITIAL_CHUNKS

    def size(self, chunk_bytes: int, remaining: int) -> int:
        """Chunks for the next call (1 to ``remaining``), chunks of about ``chunk_bytes``."""
        count = self._limit
        if self.rate is not None and chunk_bytes > 0:
            fits = math.floor(self.rate * self.timeout_s * TARGET_FRACTION / chunk_bytes)
            count = min(count, max(1, fits))
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
        proven = num_bytes / self.timeout_s  # it moved less than this
        self.rate = proven if self.rate is None else min(self.rate, proven)
