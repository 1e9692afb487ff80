"""The unit lane runs in this process only: a test that starts a process fails.

Unit tests must be fast and independent of the machine's load, so anything that
forks or execs (``subprocess``, ``asyncio``'s subprocesses, ``multiprocessing``,
``os.fork``, ``os.system``) belongs in ``tests/integration`` or ``tests/e2e``. The
fixture below replaces every way Python starts a process with one that fails the
test and says where it belongs: ``Popen``'s one door (which ``asyncio`` uses too), the
C-level ``fork_exec`` behind it and behind ``multiprocessing``'s spawn, and the ``os``
calls that fork or exec.
"""

from __future__ import annotations

import _posixsubprocess  # type: ignore[import-not-found]
import contextlib
import os
import subprocess
from typing import Any, NoReturn

import pytest

# matplotlib lists the system's fonts with `fc-list` the first time it is imported
# with an empty font cache (a fresh machine, or the suite's own XDG_CACHE_HOME): a
# library's one-time process, not a test's. Build that cache now, at collection,
# before the fixture below refuses processes; which test imported it first decided
# whether the demo's plot tests failed.
with contextlib.suppress(ImportError):
    import matplotlib.font_manager  # noqa: F401


class ProcessInUnitTest(AssertionError):
    """A unit test tried to start a process."""


def _refuse(what: str) -> Any:
    def refused(*_args: Any, **_kwargs: Any) -> NoReturn:
        raise ProcessInUnitTest(
            f"a unit test may not start a process ({what}): move it to tests/integration "
            "or tests/e2e, or test the code in this process"
        )

    return refused


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse("subprocess"))
    monkeypatch.setattr(subprocess, "_fork_exec", _refuse("fork_exec"), raising=False)
    monkeypatch.setattr(_posixsubprocess, "fork_exec", _refuse("fork_exec"))
    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse(f"os.{name}"))
    for name in ("execv", "execve", "execvp", "execvpe", "execl", "execle", "execlp", "execlpe"):
        monkeypatch.setattr(os, name, _refuse(f"os.{name}"))
