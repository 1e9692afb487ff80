"""Starting the cluster's processes detached, and stopping them by their own pids.

Each process starts in a session of its own (``start_new_session``), so its pid is
its process group's id: a signal to the group reaches whatever it started too (a
server's workers), and nothing else. A process is recognised by its pid *and* its
start time (``/proc/<pid>/stat``, field 22), so a ``down`` long after a reboot or a
crash never signals an unrelated process that was given a recycled pid.

Stopping is SIGTERM to the group, a wait with a deadline, SIGKILL to what remains, a
shorter wait, then a check that no member of the group runs. A zombie does not run:
where the launcher is the parent it reaps its children; where it is not (``lmtier
cluster down`` after ``up`` returned), the orphans belong to init, and an init that
does not reap (some container and VM inits) leaves zombies that hold no resources.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from lmtier_apps.cluster.state import ProcessInfo

__all__ = [
    "Children",
    "group_members",
    "is_running",
    "process_start_time",
    "running_groups",
    "spawn",
    "stop_processes",
]

POLL_S = 0.05
"""How often a wait looks again (a condition polled with a deadline, never a fixed sleep)."""
KILL_WAIT_S = 10.0
"""How long SIGKILLed processes get to disappear before they are reported."""
_PROC = Path("/proc")

Children = Mapping[int, "subprocess.Popen[bytes]"]
"""The processes this launcher started, by pid: reaped as they exit."""


def spawn(
    role: str, command: Sequence[str], *, env: Mapping[str, str], log: Path, cwd: Path
) -> tuple[subprocess.Popen[bytes], ProcessInfo]:
    """Start ``command`` in a new session, stdin closed, stdout and stderr appended to
    ``log``; the process and its record."""
    with log.open("ab") as out:
        process = subprocess.Popen(  # noqa: S603 - our own command lines, no shell
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
        )
    info = ProcessInfo(role, process.pid, process_start_time(process.pid), str(log))
    return process, info


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()  # the name may hold spaces and parens


def process_start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot; None without /proc or process."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def is_running(info: ProcessInfo, children: Children | None = None) -> bool:
    """Whether the process ``info`` records runs: the pid exists, is not a zombie, and
    (where known) started when recorded. A child of ours that exited is reaped here."""
    child = (children or {}).get(info.pid)
    if child is not None and child.poll() is not None:
        return False
    if not _PROC.is_dir():
        return _signal_reaches(info.pid)
    fields = _stat_fields(info.pid)
    if fields is None or fields[0] == "Z":
        return False
    return info.start_time is None or process_start_time(info.pid) == info.start_time


def _signal_reaches(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running_groups() -> dict[int, list[int]]:
    """Running (not zombie) processes by process group id, from one pass over /proc."""
    groups: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and fields[0] != "Z":
                groups.setdefault(int(fields[2]), []).append(int(entry.name))
    return groups


def group_members(
    pgid: int, groups: Callable[[], dict[int, list[int]]] = running_groups
) -> list[int]:
    """The pids of running (not zombie) processes in process group ``pgid``;
    ``groups`` gives them all (a cached :func:`running_groups` for many questions)."""
    if not _PROC.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    return groups().get(pgid, [])


def _signal_group(info: ProcessInfo, sig: signal.Signals) -> str | None:
    """Send ``sig`` to the process's group; a problem, or None."""
    try:
        os.killpg(info.pid, sig)
    except ProcessLookupError:
        return None
    except PermissionError:
        return f"{info.role} (pid {info.pid}): not allowed to signal it"
    return None


def _owns_group(info: ProcessInfo) -> bool:
    """Whether the process group ``info.pid`` is still the one started as ``info``.
    While the leader exists (zombie or not) its start time tells; once it is gone,
    members left in its group are its own: the kernel gives no new process a pid that
    is still some group's id."""
    fields = _stat_fields(info.pid)
    if fields is None or info.start_time is None or len(fields) <= 19:
        return True
    return int(fields[19]) == info.start_time


def _alive(
    info: ProcessInfo,
    children: Children,
    groups: Callable[[], dict[int, list[int]]] = running_groups,
) -> bool:
    """The process, or another member of its group, still runs."""
    if is_running(info, children):
        return True
    return _owns_group(info) and bool(group_members(info.pid, groups))


def _wait_gone(infos: Sequence[ProcessInfo], children: Children, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        # One pass over /proc per look, and only once some leader has exited.
        groups = functools.cache(running_groups)
        if not any(_alive(info, children, groups) for info in infos):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def stop_processes(
    stages: Sequence[tuple[Sequence[ProcessInfo], float]], children: Children
) -> list[str]:
    """Stop each stage's processes (SIGTERM, up to its timeout, then SIGKILL), stage
    after stage; the problems, one line each (empty when everything stopped). A
    process already gone, or whose pid now belongs to another process, is left alone."""
    problems: list[str] = []
    for infos, timeout_s in stages:
        ours = [info for info in infos if _alive(info, children)]
        for info in ours:
            problem = _signal_group(info, signal.SIGTERM)
            if problem is not None:
                problems.append(problem)
        if _wait_gone(ours, children, timeout_s):
            continue
        for info in ours:
            if _alive(info, children):
                _signal_group(info, signal.SIGKILL)
        _wait_gone(ours, children, KILL_WAIT_S)
    for infos, _ in stages:
        for info in infos:
            if _alive(info, children):
                members = sorted({info.pid, *group_members(info.pid)})
                problems.append(f"{info.role} (pid {info.pid}) still runs: pids {members}")
    return problems
