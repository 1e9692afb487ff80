"""``lmtier serve``'s malloc settings (lmtier.sidecar.heap): applied on glibc, never
over the operator's own."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from lmtier.sidecar import heap

PROBE = "from lmtier.sidecar.heap import keep_freed_memory; print(keep_freed_memory())"
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def applied(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_the_settings_apply_on_glibc_unless_the_environment_sets_its_own() -> None:
    assert applied() == "True"
    for name in USER_SETTINGS:
        assert (
            applied(**{name: "glibc.malloc.trim_threshold=0" if name == "GLIBC_TUNABLES" else "0"})
            == "False"
        )


def test_another_c_library_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap.platform, "libc_ver", lambda: ("musl", ""))
    assert heap.keep_freed_memory() is False
