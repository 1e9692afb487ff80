"""Closing the caches a program leaves open, before interpreter exit stops their threads.

A program that ends without ``close()`` (a script that falls off its end, a
``sys.exit`` deep in a call) still has background writes queued for the tiers below
host memory: ``store()`` counted them. They must land, within a bound.

Why not ``atexit``: at exit, CPython first calls the hooks registered with
``threading._register_atexit``, then joins the non-daemon threads, and only then
runs ``atexit`` handlers. ``concurrent.futures`` registers a hook there
(``concurrent.futures.thread._python_exit``) that stops the workers of every
ThreadPoolExecutor, after which ``submit`` raises "cannot schedule new futures after
(interpreter) shutdown". The runtime's event loop runs on (a daemon thread), but the
pools it needs are gone: the sealing thread, the disk tier's I/O threads, asyncio's
default executor. Writers then failed with that message, and 1-176 of 240 chunks
stored reached the disk. An ``atexit`` handler would run after that, too late.

So the hook here is registered with ``threading._register_atexit`` as well. Those
hooks run last registered first, and ``concurrent.futures.thread`` is imported
(below) before ours is registered, so ours runs while every pool still works. The
function is private to CPython (3.9 and later, unchanged through 3.13); where it is
missing, ``atexit`` is the fallback (the writes may then be lost, as before), and
``tests/unit/test_exiting.py`` fails if the order it relies on changes.

One hook serves every cache: it closes each one still registered (weakly: an
unreachable cache is not kept alive) in the process that registered it (a forked
child has no runtime thread to flush with). Each cache bounds its own close
(``close_flush_s``).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours
import logging
import os
import threading
import weakref
from typing import Protocol

__all__ = ["ClosesAtExit", "close_at_exit", "forget"]

logger = logging.getLogger(__name__)


class ClosesAtExit(Protocol):
    """What the exit hook closes: something with a bounded close for exit time."""

    def close_at_exit(self) -> None:
        """Close, waiting at most a bounded time for queued writes; never raises."""


class _Hook:
    """The caches to close at exit, and whether the hook is registered (one per process)."""

    def __init__(self) -> None:
        self.open: weakref.WeakSet[ClosesAtExit] = weakref.WeakSet()
        self.owner = os.getpid()
        self.registered = False
        self.lock = threading.Lock()

    def add(self, cache: ClosesAtExit) -> None:
        with self.lock:
            if os.getpid() != self.owner:  # a forked child: its parent's caches are not its own
                self.open.clear()
                self.owner = os.getpid()
            self.open.add(cache)
            if self.registered:
                return
            register = getattr(threading, "_register_atexit", None)
            try:
                if register is None:
                    atexit.register(self.close_all)
                else:
                    register(self.close_all)
            except RuntimeError:  # opened while the interpreter is already exiting
                return
            self.registered = True

    def discard(self, cache: ClosesAtExit) -> None:
        with self.lock:
            self.open.discard(cache)

    def close_all(self) -> None:
        with self.lock:
            caches = list(self.open) if os.getpid() == self.owner else []
            self.open.clear()
        for cache in caches:
            try:
                cache.close_at_exit()
            except Exception:  # one cache's failure must not cost the others their writes
                logger.exception("lmtier: closing a cache at exit failed")


_hook = _Hook()


def close_at_exit(cache: ClosesAtExit) -> None:
    """Close ``cache`` when the interpreter exits, unless :func:`forget` is called first."""
    _hook.add(cache)


def forget(cache: ClosesAtExit) -> None:
    """``cache`` was closed: nothing to do for it at exit."""
    _hook.discard(cache)
