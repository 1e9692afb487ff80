"""Ctrl-C (SIGINT) during ``lmtier warm``: recorded as well as raised, so that an
interrupted run always ends as one (exit 130), with what it stored flushed.

Python turns SIGINT into a KeyboardInterrupt raised wherever the main thread is when
its handler runs. Raised inside a ``__del__``, a weakref or gc callback (the
collector runs them at any allocation, finalising torch, asyncio and transformers
objects), it is printed as "Exception ignored in ..." and dropped. A warm then knows
nothing of the signal: if it was waiting for more input, it waits on and, when the
input ends, exits 0 as if it had never been interrupted (seen once in a loaded CI).
Here the handler also records the signal; the loop checks the record before and
after each prompt and at its end, so a dropped exception costs at most one prompt.

Once the loop has stopped, the first SIGINT is only recorded: it must not cut short
the flush that keeps what was stored (a second one raises, for a user who insists).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Any

__all__ = ["Interrupt"]


class Interrupt:
    """SIGINT while installed (``with Interrupt() as interrupt:``): :attr:`received`
    is set and KeyboardInterrupt raised, as Python's own handler raises it, except
    within :meth:`deferred`. Installed only from the main thread (the only one signal
    handlers may be set from); elsewhere it records nothing and changes nothing."""

    def __init__(self) -> None:
        self.received = False
        """A SIGINT arrived (whether or not its KeyboardInterrupt reached anyone)."""
        self._deferring = False
        self._deferred = 0
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> Interrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def check(self) -> None:
        """Raise KeyboardInterrupt if a SIGINT arrived (its own exception may have been
        dropped on the way: module docstring)."""
        if self.received:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Within: the first SIGINT is recorded, not raised (a flush runs to its end);
        a second one raises."""
        self._deferring, self._deferred = True, 0
        try:
            yield
        finally:
            self._deferring = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        if self._deferring:
            self._deferred += 1
            if self._deferred < 2:
                return
        raise KeyboardInterrupt
