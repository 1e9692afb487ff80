"""``lmtier serve``'s malloc settings (lmtier.remote.heap) in fresh processes: applied
on glibc, never over the operator's own."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

PROBE = (
    "from lmtier.remote.heap import keep_freed_memory, reuses_freed_memory as r\n"
    "before = r()\n"
    "print(before, keep_freed_memory(), r())"
)
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
BOTH = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=268435456"


def probe(**env: str) -> list[str]:
    """In a fresh process: reuses before, keep_freed_memory(), reuses after."""
    base = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.split()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_the_settings_apply_on_glibc_unless_the_environment_sets_its_own() -> None:
    assert probe() == ["False", "True", "True"]
    assert probe(MALLOC_MMAP_THRESHOLD_="0") == ["False", "False", "False"]  # one of two
    assert probe(MALLOC_TRIM_THRESHOLD_="0") == ["False", "False", "False"]
    assert probe(MALLOC_MMAP_THRESHOLD_="33554432", MALLOC_TRIM_THRESHOLD_="268435456") == [
        "True",
        "False",
        "True",
    ]
    assert probe(GLIBC_TUNABLES=BOTH) == ["True", "False", "True"]
