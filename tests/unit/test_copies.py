"""lmtier.copies: host copies shared by the calling thread and helper threads."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lmtier import copies
from lmtier.copies import PIECE_BYTES, copy_into, copy_many


def big(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_large_strided_copy_in_pieces_equals_torchs(dtype: torch.dtype) -> None:
    # A run of chunks copied into the token axis of a larger tensor, as LoadResult.kv
    # does: several pieces, each strided on both sides.
    source = big(12, 4, 2, 512, 64, dtype=dtype)
    assert source.numel() * source.element_size() >= 4 * PIECE_BYTES
    out = torch.zeros(4, 2, 12 * 512 + 7, 64, dtype=dtype)
    target = out.narrow(2, 7, 12 * 512).view(4, 2, 12, 512, 64).movedim(2, 0)
    copy_into(target, source)
    assert torch.equal(target, source)
    assert torch.count_nonzero(out.narrow(2, 0, 7)) == 0  # nothing outside the target


def test_many_small_pairs_are_all_copied() -> None:
    sources = [big(64, 1024, seed=i) for i in range(40)]  # 256 KiB each, 10 MiB in all
    targets = [torch.empty_like(s) for s in sources]
    copy_many(list(zip(targets, sources, strict=True)))
    assert all(torch.equal(t, s) for t, s in zip(targets, sources, strict=True))


def test_pairs_numpy_cannot_take_stay_torchs_copy() -> None:
    # Dtypes that differ: torch converts, as copy_ always did.
    source, target = big(3, 5), torch.empty(3, 5, dtype=torch.float64)
    small_same = (torch.empty(4), torch.arange(4.0))
    copy_many([(target, source), small_same])
    assert torch.equal(target, source.double())
    assert torch.equal(small_same[0], small_same[1])


def test_without_helpers_the_caller_copies_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copies, "MAX_HELPERS", 0)
    source = big(16, 1024, 64)
    target = torch.empty_like(source)
    copy_into(target, source)
    assert torch.equal(target, source)


class NeverRuns:
    """A pool whose threads are never scheduled (a starved machine; a forked child,
    where the parent's helper threads do not exist)."""

    def __init__(self) -> None:
        self.submitted = 0

    def submit(self, *_args: Any) -> None:
        self.submitted += 1


def test_the_caller_never_waits_for_a_helper_that_has_not_begun(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = NeverRuns()
    monkeypatch.setattr(copies._Pool, "get", classmethod(lambda _cls, _helpers: pool))
    monkeypatch.setattr(copies, "_helpers", lambda: 3)
    source = big(16, 1024, 64)
    target = torch.empty_like(source)
    copy_into(target, source)  # returns: every piece was left for the caller to take
    assert pool.submitted == 3 and torch.equal(target, source)


def test_a_forked_child_starts_its_own_helpers() -> None:
    source = big(16, 1024, 64)
    copy_into(torch.empty_like(source), source)
    assert copies._Pool.executor is not None
    copies._Pool.forget()  # what os.register_at_fork runs in a child
    assert copies._Pool.executor is None
    copy_into(target := torch.empty_like(source), source)
    assert copies._Pool.executor is not None and torch.equal(target, source)


@pytest.mark.parametrize("helpers", [0, 3])
def test_each_pairs_follow_up_runs_once_after_that_pair_is_copied(
    monkeypatch: pytest.MonkeyPatch, helpers: int
) -> None:
    monkeypatch.setattr(copies, "MAX_HELPERS", helpers)
    sources = [big(32, 1024, 64, seed=i) for i in range(3)]  # 8 MiB each: 2+ pieces each
    targets = [torch.zeros_like(s) for s in sources]
    seen: list[tuple[int, bool]] = []

    def check(at: int) -> None:  # what the copying thread sees: the pair whole
        seen.append((at, torch.equal(targets[at], sources[at])))

    then: list[Callable[[], None] | None] = [functools.partial(check, at) for at in range(3)]
    then[1] = None
    copy_many(list(zip(targets, sources, strict=True)), then)
    assert sorted(seen) == [(0, True), (2, True)]


def test_a_follow_up_that_fails_fails_the_copy_after_it_is_done() -> None:
    sources = [big(8, 1024, 64, seed=i) for i in range(4)]
    targets = [torch.zeros_like(s) for s in sources]

    def fail() -> None:
        raise RuntimeError("follow-up failed")

    with pytest.raises(RuntimeError, match="follow-up failed"):
        copy_many(list(zip(targets, sources, strict=True)), [None, fail, None, None])
    assert torch.equal(targets[3], sources[3])  # the other pairs were still copied
    with pytest.raises(ValueError, match="2 follow-ups for 4 pairs"):
        copy_many(list(zip(targets, sources, strict=True)), [None, None])
