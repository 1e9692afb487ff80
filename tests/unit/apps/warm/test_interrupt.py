"""lmtier_apps.warm.interrupt: a SIGINT is recorded as well as raised, so that a
KeyboardInterrupt lost on the way (CPython drops one raised inside a ``__del__``)
still stops the run; within ``deferred`` the first one is only recorded."""

from __future__ import annotations

import signal
import sys
import threading

import pytest

from lmtier_apps.warm.interrupt import Interrupt


class _Swallows:
    """An object whose finaliser takes the SIGINT: CPython prints the KeyboardInterrupt
    raised there as "Exception ignored" and drops it."""

    def __del__(self) -> None:
        signal.raise_signal(signal.SIGINT)
        for _ in range(100):  # the handler runs here, inside __del__, at a loop's jump
            pass


def test_a_sigint_is_raised_and_recorded() -> None:
    before = signal.getsignal(signal.SIGINT)
    with Interrupt() as interrupt:
        assert not interrupt.received
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert interrupt.received
        with pytest.raises(KeyboardInterrupt):
            interrupt.check()
    assert signal.getsignal(signal.SIGINT) is before, "the previous handler is back"


def test_a_sigint_whose_exception_was_dropped_is_still_known(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dropped: list[type[BaseException] | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: dropped.append(info.exc_type))
    with Interrupt() as interrupt:
        _Swallows()  # made and dropped: its __del__ runs now
        assert dropped == [KeyboardInterrupt], "CPython dropped it"
        assert interrupt.received
        with pytest.raises(KeyboardInterrupt):
            interrupt.check()


def test_deferred_records_the_first_and_raises_the_second() -> None:
    with Interrupt() as interrupt, interrupt.deferred():
        signal.raise_signal(signal.SIGINT)
        assert interrupt.received
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_outside_the_main_thread_it_changes_nothing() -> None:
    before = signal.getsignal(signal.SIGINT)
    seen: list[object] = []

    def body() -> None:
        with Interrupt() as interrupt:
            seen.append(signal.getsignal(signal.SIGINT))
            interrupt.check()

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [before]
