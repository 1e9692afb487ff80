"""Stand-ins for torch's CUDA streams and events that record what waits on what, so
the transfer engine's CUDA branches run on CPU tensors in tests: each entry of the log
is ``(who, what, whom)``, e.g. ``("load", "waits for", "compute")``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch


class FakeStream:
    """Stands in for torch.cuda.Stream; records what waits on what."""

    def __init__(self, name: str, log: list[tuple[str, ...]]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append((self.name, "waits for", other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append((self.name, "waits for", event.name))


class FakeEvent:
    def __init__(self, log: list[tuple[str, ...]], enable_timing: bool = False) -> None:
        self.log, self.name = log, f"event{sum(1 for e in log if e[1] == 'records')}"

    def record(self, stream: FakeStream) -> None:
        self.log.append((stream.name, "records", self.name))

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.log.append(("host", "waits for", self.name))


def fake_cuda(monkeypatch: pytest.MonkeyPatch, log: list[tuple[str, ...]]) -> list[FakeStream]:
    """Make ``torch.cuda.stream``, ``current_stream`` and ``Event`` the stand-ins, logging
    into ``log``; returns the stack of current streams (its last is current, at first
    one named "compute")."""
    current = [FakeStream("compute", log)]

    @contextlib.contextmanager
    def use(stream: FakeStream) -> Iterator[None]:
        current.append(stream)
        yield
        current.pop()

    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: FakeEvent(log))
    return current
