"""The vLLM connector's caches per process: keyed by the frozen config (no secret in
a key's repr), shared and counted within a process, never inherited across a fork."""

from __future__ import annotations

import os
import warnings

import pytest

pytest.importorskip("vllm")


with warnings.catch_warnings():  # vLLM's imports of torch's deprecated parts
    warnings.simplefilter("ignore", DeprecationWarning)
    from lmtier_connector.vllm import caches as registry
    from support.vllm_caches import fake_registry
    from support.vllm_caches import registry_key as key

pytestmark = pytest.mark.integration


@pytest.fixture
def caches(monkeypatch: pytest.MonkeyPatch) -> registry.Caches:
    return fake_registry(monkeypatch)


def test_a_forked_child_opens_its_own_and_leaves_the_parents(caches: registry.Caches) -> None:
    parent = caches.acquire(key())
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running pytest's teardown
        status = 1
        try:
            inherited = len(caches)
            mine = caches.acquire(key())
            caches.release(key())
            verdict = (
                inherited == 0
                and mine is not parent
                and mine.pid == os.getpid()  # type: ignore[attr-defined]
                and mine.closes == 1  # type: ignore[attr-defined]
                and parent.closes == 0  # type: ignore[attr-defined]
            )
            os.write(write, b"ok" if verdict else b"bad")
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    answer = os.read(read, 16)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert answer == b"ok"
    # The parent's cache is still its own, open and counted once.
    assert len(caches) == 1 and caches.acquire(key()) is parent
    assert parent.closes == 0  # type: ignore[attr-defined]
