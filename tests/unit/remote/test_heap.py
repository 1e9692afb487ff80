"""``lmtier serve``'s malloc settings (lmtier.remote.heap): applied on glibc, never
over the operator's own; and whether a process keeps freed buffers."""

from __future__ import annotations

import pytest

from lmtier.remote import heap


def test_another_c_library_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap.platform, "libc_ver", lambda: ("musl", ""))
    assert heap.keep_freed_memory() is False
