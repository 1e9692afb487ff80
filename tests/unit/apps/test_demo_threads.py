"""Thread sizing for ``lmtier demo`` and ``lmtier demo serve``: the affinity count capped
by the cgroup v2 or v1 CPU quota, read from fake cgroup files under a root directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmtier_apps.threads import (
    cgroup_cpu_limit,
    default_threads,
    set_torch_threads,
    usable_cpus,
)


def write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_no_cgroup_files_means_the_affinity_count(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path) is None
    assert usable_cpus(tmp_path, affinity=6) == 6


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [
        ("max 100000\n", None),  # no quota
        ("200000 100000\n", 2),
        ("150000 100000\n", 2),  # 1.5 CPUs: rounded up
        ("50000 100000\n", 1),  # half a CPU: at least 1
        ("garbage\n", None),
        ("", None),
    ],
)
def test_cgroup_v2_quota(tmp_path: Path, cpu_max: str, expected: int | None) -> None:
    write(tmp_path, "sys/fs/cgroup/cpu.max", cpu_max)
    assert cgroup_cpu_limit(tmp_path) == expected


def test_the_quota_caps_the_affinity_count_and_never_raises_it(tmp_path: Path) -> None:
    write(tmp_path, "sys/fs/cgroup/cpu.max", "300000 100000\n")
    assert usable_cpus(tmp_path, affinity=16) == 3
    assert usable_cpus(tmp_path, affinity=2) == 2


@pytest.mark.parametrize("directory", ["cpu", "cpu,cpuacct"])
def test_cgroup_v1_quota(tmp_path: Path, directory: str) -> None:
    write(tmp_path, f"sys/fs/cgroup/{directory}/cpu.cfs_quota_us", "250000\n")
    write(tmp_path, f"sys/fs/cgroup/{directory}/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(tmp_path) == 3
    assert usable_cpus(tmp_path, affinity=8) == 3


def test_cgroup_v1_without_quota(tmp_path: Path) -> None:
    write(tmp_path, "sys/fs/cgroup/cpu/cpu.cfs_quota_us", "-1\n")
    write(tmp_path, "sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(tmp_path) is None


def test_the_smallest_quota_wins(tmp_path: Path) -> None:
    write(tmp_path, "sys/fs/cgroup/cpu.max", "400000 100000\n")
    write(tmp_path, "sys/fs/cgroup/cpu/cpu.cfs_quota_us", "100000\n")
    write(tmp_path, "sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n")
    assert usable_cpus(tmp_path, affinity=8) == 1


def test_this_machine_gives_at_least_one() -> None:
    assert usable_cpus() >= 1


def test_set_torch_threads_applies_and_restores() -> None:
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    try:
        assert set_torch_threads(1) == 1
        assert torch.get_num_threads() == 1
        chosen = set_torch_threads(None)
        assert 1 <= chosen <= usable_cpus()
        assert torch.get_num_threads() == chosen
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match=">= 1"):
        set_torch_threads(0)


@pytest.mark.parametrize(
    ("usable", "cpu_count", "load", "expected"),
    [
        (2, 2, 0.1, 2),  # an idle machine: every usable CPU
        (2, 2, 1.0, 1),  # one busy process beside the demo: one thread (8x, not 1.5x)
        (2, 2, 12.0, 1),  # a very loaded machine: one, never zero
        (2, 2, 0.6, 1),  # the load rounded: 1.4 CPUs free is one
        (8, 8, 3.4, 5),
        (2, 64, 40.0, 2),  # a 2-CPU container on a busy 64-core host: the host has room
        (4, 64, 62.0, 2),
    ],
)
def test_the_default_leaves_the_others_their_load(
    usable: int, cpu_count: int, load: float, expected: int
) -> None:
    """It used every usable CPU whatever else ran (the demo's speedup fell to 1.5x)."""
    assert default_threads(usable, cpu_count, load) == expected
