"""How long one call to a tier may take, and how a slow call is told from a hung one.

A single timeout per call cannot serve both ends of a tier's calls. Half a second is
long enough for one Redis GET and far too short for a batch of 200 chunks of 2 MiB on
a loaded machine (measured: such batches took 0.25 s when planned and 0.5 s or more
when the CPU was shared, and the whole batch became a miss); a timeout long enough for
the batch would let a hung server hold every small call for as long. So a call's
deadline grows with the work it carries (:class:`CallBudget`)::

    deadline = timeout_s + num_bytes / min_bytes_per_s + num_keys * per_key_s

``timeout_s`` covers what does not grow with the call (a round trip, connection set-up,
being scheduled on a busy machine); ``min_bytes_per_s`` is the slowest transfer rate
still counted as healthy, so a call moving its bytes faster than that finishes in
time whatever its size; ``per_key_s`` is for lookups, whose cost is one request per
key (S3 HEADs) rather than bytes.

A large deadline alone would make a hung server (SIGSTOPped, a dead link that drops
packets) cost a large call its whole deadline. A tier that moves bytes itself ticks a
:class:`Progress` count whenever bytes arrive or leave, or a request is answered; the
:class:`~lmtier.storage.guard.TierGuard` gives up on a call once the count has not
moved for ``timeout_s``. So a hang costs about ``timeout_s`` (at most twice that),
however large the call, while a slow but live server keeps its call going up to the
deadline. A tier without a meter gets the deadline only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

__all__ = ["CallBudget", "Progress"]


@dataclass(frozen=True, slots=True)
class CallBudget:
    """The deadline of one tier call, from the work it carries (module docstring).

    ``min_bytes_per_s`` None and ``per_key_s`` 0 (the defaults) give every call the
    same ``timeout_s``: the behaviour of a tier that declares nothing else.
    """

    timeout_s: float
    """Seconds every call gets, whatever it carries; also how long a call whose tier
    reports :class:`Progress` may go without any before it counts as hung."""
    min_bytes_per_s: float | None = None
    """Slowest transfer rate counted as healthy: each byte a call moves adds
    ``1 / min_bytes_per_s`` seconds to its deadline (None: bytes add nothing)."""
    per_key_s: float = 0.0
    """Seconds added per key a lookup asks about."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.min_bytes_per_s is not None and not self.min_bytes_per_s > 0:
            raise ValueError(f"min_bytes_per_s must be > 0 or None, got {self.min_bytes_per_s}")
        if not self.per_key_s >= 0:
            raise ValueError(f"per_key_s must be >= 0, got {self.per_key_s}")

    @property
    def seconds_per_byte(self) -> float:
        """What one byte adds to a deadline (0 without ``min_bytes_per_s``)."""
        return 0.0 if self.min_bytes_per_s is None else 1.0 / self.min_bytes_per_s

    def seconds(self, *, num_bytes: int = 0, num_keys: int = 0) -> float:
        """The deadline of a call moving ``num_bytes`` or asking about ``num_keys``."""
        return (
            self.timeout_s
            + max(0, num_bytes) * self.seconds_per_byte
            + max(0, num_keys) * self.per_key_s
        )


class Progress:
    """A count a tier advances whenever its I/O moves: bytes received or sent, a
    request answered. The guard only asks whether it changed (module docstring).

    Ticked from the event loop and from worker threads alike, without a lock: every
    tick stores a value no other tick stores (``next`` of an ``itertools.count`` is
    atomic), so two equal readings mean no tick finished between them. A ``+= 1``
    from two threads could store the same value twice.
    """

    __slots__ = ("_ticks", "count")

    def __init__(self) -> None:
        self._ticks = itertools.count(1)
        self.count = 0
        """The latest tick's number (0: none yet)."""

    def tick(self) -> None:
        """Record that some I/O moved."""
        self.count = next(self._ticks)
