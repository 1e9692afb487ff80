"""One event loop, owned explicitly, with a thin synchronous bridge for engine code.

All tier I/O in a process runs on the loop of one :class:`Runtime`, in a daemon
thread. Engine code (a forward pass, a scheduler) is synchronous and multi-threaded:
it calls :meth:`Runtime.run` from any thread, which schedules the coroutine on the
loop and waits for it. Tiers therefore never see two threads: their state needs no
locks. The exceptions have their own: the host pool (leases are released from
engine threads) and host-memory state, which a store changes from its own thread
under the StorageManager's lock, so that it never waits for this loop.

The loop is started by :meth:`start` (or ``with Runtime() as rt``), never in the
constructor, and :meth:`stop` cancels what is left and joins the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

__all__ = ["Runtime"]

T = TypeVar("T")


class Runtime:
    """An asyncio loop in a daemon thread, and a way to call into it synchronously."""

    def __init__(self, name: str = "lmtier-runtime") -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop; RuntimeError before :meth:`start` or after :meth:`stop`."""
        if self._loop is None:
            raise RuntimeError(f"{self.name} is not started")
        return self._loop

    def start(self) -> Runtime:
        """Start the loop thread (idempotent); returns self."""
        if self._loop is not None:
            return self
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        self._thread = threading.Thread(target=serve, name=self.name, daemon=True)
        self._thread.start()
        ready.wait()
        self._loop = loop
        return self

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop from any thread; returns a thread-safe future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (from any thread but the loop's).

        On timeout the coroutine is cancelled and TimeoutError raised.
        """
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(
                "Runtime.run called from the runtime's own loop thread; await the coroutine"
            )
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{self.name}: call did not finish in {timeout} s") from None

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run the plain function ``fn(*args)`` on the loop's thread and return its
        result: for state only that thread may touch (tiers, the StorageManager).

        A plain callback, not a task: about half the cost of :meth:`run`'s hop, which
        a store pays twice per batch."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("Runtime.call called from the runtime's own loop thread")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def on_loop() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # handed to the caller, raised there
                    future.set_exception(exc)

        self.loop.call_soon_threadsafe(on_loop)
        return future.result()

    def stop(self) -> None:
        """Cancel remaining tasks, stop the loop and join its thread. Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def cancel_rest() -> None:
            current = asyncio.current_task()
            tasks = [task for task in asyncio.all_tasks() if task is not current]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_rest(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
        self._loop = None
        self._thread = None

    def __enter__(self) -> Runtime:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
