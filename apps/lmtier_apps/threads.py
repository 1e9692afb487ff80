"""How many intra-op threads torch should use: the CPUs this process may really use.

torch sizes its intra-op pool to every core it can see, which in a container or under
``taskset`` is more than the process may run on: the CPU affinity mask and the cgroup
CPU quota (``docker run --cpus``, a Kubernetes CPU limit) both cut it down, and torch
reads neither. Too many threads is not harmless: on a 2-core machine with one other
busy process, ``lmtier demo``'s cached requests ran 10x slower with torch's default
(its overall TTFT speedup fell from 8x to 1.2x) while one thread restored it: the
threads of one matmul wait for each other at every barrier, and a throttled or
preempted thread stalls them all.

:func:`usable_cpus` is the affinity count capped by the quota of cgroup v2
(``cpu.max``) and of cgroup v1 (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``),
rounded up, at least 1. Other processes' work counts too: with one busy process beside
it on 2 cores, the demo's TTFT speedup fell from 8x to 1.5x with both cores' threads.
So :func:`default_threads` leaves to the others what the load average says they run:
the usable CPUs, at most the machine's CPUs minus its 1-minute load (rounded), at
least 1. :func:`set_torch_threads` applies it (or an explicit count) once, at
start-up: a long-running server keeps what it started with.
The cgroup files are read at the root of the cgroup mount, which is the process's
own cgroup inside a container (its cgroup namespace); on a host, a process in a
nested cgroup is not capped by it. The ``root`` parameter lets tests feed fake files.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

__all__ = ["cgroup_cpu_limit", "default_threads", "set_torch_threads", "usable_cpus"]

logger = logging.getLogger(__name__)

_CGROUP_V2 = "sys/fs/cgroup/cpu.max"
# cgroup v1 mounts the cpu controller under one of these names (distributions differ).
_CGROUP_V1_DIRS = ("sys/fs/cgroup/cpu", "sys/fs/cgroup/cpu,cpuacct", "sys/fs/cgroup/cpuacct,cpu")


def cgroup_cpu_limit(root: Path = Path("/")) -> int | None:
    """The CPUs the cgroup quota allows under ``root`` (quota / period, rounded up, at
    least 1), or None when there is no quota or no cgroup file can be read."""
    limits = [_cgroup_v2_limit(root / _CGROUP_V2)]
    limits += [_cgroup_v1_limit(root / directory) for directory in _CGROUP_V1_DIRS]
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def usable_cpus(root: Path = Path("/"), affinity: int | None = None) -> int:
    """The CPUs this process may really use: its affinity mask (``affinity`` overrides
    it, for tests) capped by the cgroup quota under ``root``; at least 1."""
    if affinity is None:
        affinity = _affinity_count()
    limit = cgroup_cpu_limit(root)
    return max(1, min(affinity, limit) if limit is not None else affinity)


def default_threads(
    usable: int | None = None, cpu_count: int | None = None, load: float | None = None
) -> int:
    """The threads to use when none is asked for (module docstring): ``usable`` CPUs
    (:func:`usable_cpus`), at most the ``cpu_count`` CPUs of the machine minus the
    ``load`` the others put on it (the 1-minute load average), at least 1. The load
    average counts every runnable process of the machine, so it is compared with the
    machine's CPUs, not with a container's share of them."""
    usable = usable_cpus() if usable is None else usable
    cpu_count = (os.cpu_count() or usable) if cpu_count is None else cpu_count
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    free = math.floor(cpu_count - load + 0.5)
    return max(1, min(usable, free))


def set_torch_threads(requested: int | None = None) -> int:
    """Set torch's intra-op threads to ``requested``, or to :func:`default_threads` when
    None; returns the count set. Call it before the model's first forward pass."""
    import torch  # noqa: PLC0415 - keep this module importable without torch

    if requested is not None and requested < 1:
        raise ValueError(f"the thread count must be >= 1, got {requested}")
    count = requested if requested is not None else default_threads()
    if count != torch.get_num_threads():
        logger.info("torch intra-op threads: %d (was %d)", count, torch.get_num_threads())
        torch.set_num_threads(count)
    return count


def _affinity_count() -> int:
    if hasattr(os, "sched_getaffinity"):  # Linux; not macOS
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _cgroup_v2_limit(path: Path) -> int | None:
    """``cpu.max`` holds "QUOTA PERIOD" in microseconds; QUOTA "max" means none."""
    fields = _read_fields(path)
    if fields is None or len(fields) != 2 or fields[0] == "max":
        return None
    return _quota_cpus(fields[0], fields[1])


def _cgroup_v1_limit(directory: Path) -> int | None:
    """``cpu.cfs_quota_us`` is -1 when there is no quota."""
    quota = _read_fields(directory / "cpu.cfs_quota_us")
    period = _read_fields(directory / "cpu.cfs_period_us")
    if quota is None or period is None or len(quota) != 1 or len(period) != 1:
        return None
    return _quota_cpus(quota[0], period[0])


def _quota_cpus(quota_text: str, period_text: str) -> int | None:
    try:
        quota, period = int(quota_text), int(period_text)
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def _read_fields(path: Path) -> list[str] | None:
    try:
        return path.read_text(encoding="ascii").split()
    except (OSError, UnicodeDecodeError):
        return None
