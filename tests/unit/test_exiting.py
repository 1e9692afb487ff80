"""lmtier.exiting: the CPython surface its exit hook depends on, and what the hook
closes. (The whole path, a real process exiting without close(), is
tests/integration/test_storage_disk.py::test_an_exit_without_close_writes_every_chunk_stored.)"""

from __future__ import annotations

import concurrent.futures.thread
import threading

from lmtier import exiting


class Closer:
    def __init__(self, fail: bool = False) -> None:
        self.closed = 0
        self.fail = fail

    def close_at_exit(self) -> None:
        self.closed += 1
        if self.fail:
            raise RuntimeError("boom")


def test_the_hook_runs_before_concurrent_futures_stops_its_pools() -> None:
    # threading._shutdown calls these hooks last registered first; if CPython renames
    # them or changes the order, writes queued at exit are lost again.
    closer = Closer()
    exiting.close_at_exit(closer)
    exiting.forget(closer)
    hooks = [getattr(call, "func", call) for call in threading._threading_atexits]  # type: ignore[attr-defined]
    stop_pools = hooks.index(concurrent.futures.thread._python_exit)  # type: ignore[attr-defined]
    assert hooks.index(exiting._hook.close_all) > stop_pools
    assert hooks.count(exiting._hook.close_all) == 1


def test_the_hook_closes_what_is_still_open_and_survives_a_failure() -> None:
    failing, open_one, closed_one = Closer(fail=True), Closer(), Closer()
    for closer in (failing, open_one, closed_one):
        exiting.close_at_exit(closer)
    exiting.forget(closed_one)
    exiting._hook.close_all()
    assert (failing.closed, open_one.closed, closed_one.closed) == (1, 1, 0)
    exiting._hook.close_all()  # nothing is closed twice
    assert open_one.closed == 1


def test_the_hook_does_not_keep_a_cache_alive() -> None:
    closer = Closer()
    exiting.close_at_exit(closer)
    assert closer in exiting._hook.open
    del closer
    assert len([c for c in exiting._hook.open if isinstance(c, Closer)]) == 0
