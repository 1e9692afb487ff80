"""HostPool: leasing, ref counting, misuse detection, alignment, sizing, thread safety."""

from __future__ import annotations

import logging
import random
import sys
import threading

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmtier.errors import CapacityError, HandleError
from lmtier.storage.host_pool import HostPool, SlabHandle


def address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def leased(pool: HostPool, n: int) -> list[SlabHandle]:
    """``n`` slabs leased one at a time with acquire(), which must not run out."""
    handles = [pool.acquire() for _ in range(n)]
    assert all(handle is not None for handle in handles), "the pool ran out"
    return [handle for handle in handles if handle is not None]


def test_acquire_until_exhausted_then_none_and_release_returns_the_slab() -> None:
    pool = HostPool(100, 3, pin=False)
    handles = [pool.acquire() for _ in range(3)]
    assert all(h is not None for h in handles)
    assert sorted(h.index for h in handles if h is not None) == [0, 1, 2]
    assert pool.num_free == 0
    assert pool.num_in_use == 3
    assert pool.acquire() is None
    assert pool.acquire() is None  # asking again does not change anything
    first = handles[1]
    assert first is not None
    first.release()
    assert first.released
    assert pool.num_free == 1
    again = pool.acquire()
    assert again is not None
    assert again.index == first.index
    assert again.refcount == 1


def test_slab_is_freed_only_after_its_last_lease() -> None:
    pool = HostPool(64, 1, pin=False)
    owner = pool.acquire()
    assert owner is not None
    reader = owner.share()
    other = reader.share()
    assert reader is not owner
    assert reader.index == other.index == owner.index
    assert owner.refcount == 3
    owner.release()
    assert reader.refcount == 2
    assert pool.num_free == 0
    reader.view[0] = 7  # a live lease still works after another owner released
    other.release()
    assert pool.num_free == 0
    assert reader.tensor[0].item() == 7
    reader.release()
    assert pool.num_free == 1
    assert owner.refcount == 0


def test_double_release_raises_and_names_the_slab() -> None:
    pool = HostPool(64, 4, pin=False)
    handles = leased(pool, 3)
    victim = handles[2]
    shared = victim.share()
    victim.release()
    with pytest.raises(HandleError, match=rf"slab {victim.index}\b"):
        victim.release()
    # The failed second release did not take the other owner's count.
    assert shared.refcount == 1
    assert pool.num_free == 1


@pytest.mark.parametrize("use", ["view", "tensor", "share"])
def test_use_after_release_raises(use: str) -> None:
    pool = HostPool(64, 2, pin=False)
    handle = pool.acquire()
    assert handle is not None
    keeper = handle.share()
    handle.release()
    with pytest.raises(HandleError, match="released"):
        handle.share() if use == "share" else getattr(handle, use)
    assert keeper.refcount == 1


def test_handle_is_a_context_manager_that_releases_once() -> None:
    pool = HostPool(64, 1, pin=False)
    with pool.acquire() as handle:  # type: ignore[union-attr]
        assert pool.num_free == 0
    assert handle.released
    assert pool.num_free == 1
    with pytest.raises(HandleError), pool.acquire() as inner:  # type: ignore[union-attr]
        inner.release()  # released by hand, then again by __exit__


@pytest.mark.parametrize("align", [64, 512, 4096, 65536])
@pytest.mark.parametrize("slab_bytes", [1, 1000, 4096, 5000])
def test_every_slab_is_aligned_and_sized(slab_bytes: int, align: int) -> None:
    pool = HostPool(slab_bytes, 5, pin=False, align=align)
    assert pool.slab_bytes % align == 0
    assert slab_bytes <= pool.slab_bytes < slab_bytes + align
    assert pool.nbytes == 5 * pool.slab_bytes
    handles = leased(pool, 5)
    for h in handles:
        assert h.tensor.data_ptr() % align == 0
        assert address(h.view) == h.tensor.data_ptr()
        assert len(h.view) == h.tensor.numel() == pool.slab_bytes
        assert h.tensor.dtype == torch.uint8
        assert not h.view.readonly


def test_view_and_tensor_share_memory_and_slabs_do_not_overlap() -> None:
    pool = HostPool(5000, 7, pin=False)
    handles = leased(pool, 7)
    for h in handles:
        h.view[:] = bytes([h.index + 1]) * pool.slab_bytes
    for h in handles:
        assert bool((h.tensor == h.index + 1).all())
        assert bytes(h.view) == bytes([h.index + 1]) * pool.slab_bytes
    by_index = {h.index: h for h in handles}
    by_index[3].tensor.fill_(200)
    assert set(bytes(by_index[3].view)) == {200}
    assert set(bytes(by_index[2].view)) == {3}
    assert set(bytes(by_index[4].view)) == {5}


def test_views_are_made_once_not_per_call() -> None:
    pool = HostPool(64, 1, pin=False)
    handle = pool.acquire()
    assert handle is not None
    assert handle.view is handle.view
    assert handle.tensor is handle.share().tensor


def test_empty_pool_is_always_exhausted() -> None:
    pool = HostPool(4096, 0, pin=False)
    assert pool.num_slabs == pool.num_free == pool.num_in_use == pool.nbytes == 0
    assert pool.acquire() is None


@pytest.mark.parametrize(
    ("slab_bytes", "num_slabs", "align", "match"),
    [
        (-1, 1, 4096, "slab size"),
        (0, 1, 4096, "slab size"),
        (64, -1, 4096, "num_slabs"),
        (64, 1, 0, "align"),
        (64, 1, 3000, "align"),
    ],
)
def test_bad_sizes_raise_value_error(
    slab_bytes: int, num_slabs: int, align: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        HostPool(slab_bytes, num_slabs, pin=False, align=align)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: pinning works here")
def test_pin_without_cuda_raises_and_default_does_not_pin() -> None:
    with pytest.raises(ValueError, match="pinned memory needs CUDA"):
        HostPool(64, 1, pin=True)
    assert not HostPool(64, 1).pinned
    assert not HostPool(64, 1, pin=False).pinned


def test_for_chunks_fits_as_many_aligned_slabs_as_capacity_allows() -> None:
    pool = HostPool.for_chunks(5000, 40_000, pin=False)
    assert pool.slab_bytes == 8192
    assert pool.num_slabs == 4
    assert pool.nbytes <= 40_000
    assert HostPool.for_chunks(4096, 4096 * 3, pin=False).num_slabs == 3
    assert HostPool.for_chunks(100, 1000, pin=False, align=64).num_slabs == 7
    assert HostPool.for_chunks(5000, 0, pin=False).num_slabs == 0
    with pytest.raises(CapacityError, match=r"8000 bytes.*5000 bytes"):
        HostPool.for_chunks(5000, 8000, pin=False)
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostPool.for_chunks(5000, -1, pin=False)


def test_close_reports_leaks_and_handles_fail_afterwards(caplog: pytest.LogCaptureFixture) -> None:
    pool = HostPool(64, 4, pin=False)
    leaked = leased(pool, 2)
    with caplog.at_level(logging.WARNING, logger="lmtier.storage.host_pool"):
        pool.close()
        pool.close()  # idempotent, and reports once
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "2 of 4" in warnings[0].getMessage()
    with pytest.raises(HandleError, match="closed"):
        _ = leaked[0].view
    with pytest.raises(HandleError, match="closed"):
        _ = leaked[0].tensor
    with pytest.raises(HandleError, match="closed"):
        leaked[0].share()
    with pytest.raises(HandleError, match="close"):
        pool.acquire()
    leaked[0].release()  # shutdown code may still release what it holds
    with pytest.raises(HandleError, match="twice"):
        leaked[0].release()


def test_close_without_leaks_is_silent(caplog: pytest.LogCaptureFixture) -> None:
    pool = HostPool(64, 2, pin=False)
    with pool.acquire() as _:  # type: ignore[union-attr]
        pass
    with caplog.at_level(logging.WARNING, logger="lmtier.storage.host_pool"):
        pool.close()
    assert not caplog.records


def test_concurrent_acquire_share_release_keeps_counts_consistent() -> None:
    num_slabs, num_threads, num_ops = 12, 8, 5000
    pool = HostPool(64, num_slabs, pin=False, align=64)
    guard = threading.Lock()
    owner: dict[int, int] = {}  # slab -> lineage (one acquire() and its shares)
    live: dict[int, int] = {}  # lineage -> leases still held
    mailbox: list[tuple[int, SlabHandle]] = []  # leases any thread may release
    errors: list[str] = []
    lineage_ids = iter(range(1, 10**9))
    start = threading.Barrier(num_threads)

    def release(lineage: int, handle: SlabHandle) -> None:
        stamp = bytes(handle.view[:8])
        if stamp != lineage.to_bytes(8, "little"):
            errors.append(f"slab {handle.index} overwritten while leased by {lineage}")
        with guard:
            live[lineage] -= 1
            if live[lineage] == 0:  # last lease: the slab is about to become free
                del live[lineage]
                del owner[handle.index]
        handle.release()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[tuple[int, SlabHandle]] = []
        start.wait()
        for _ in range(num_ops):
            op = rng.random()
            if op < 0.4:
                handle = pool.acquire()
                if handle is None:
                    continue
                with guard:
                    lineage = next(lineage_ids)
                    if handle.index in owner:
                        errors.append(f"slab {handle.index} handed out while leased")
                    owner[handle.index] = lineage
                    live[lineage] = 1
                handle.view[:8] = lineage.to_bytes(8, "little")
                mine.append((lineage, handle))
            elif op < 0.6 and mine:
                lineage, handle = rng.choice(mine)
                with guard:
                    live[lineage] += 1
                    mailbox.append((lineage, handle.share()))
            elif op < 0.8 and mine:
                release(*mine.pop(rng.randrange(len(mine))))
            else:
                with guard:
                    taken = mailbox.pop() if mailbox else None
                if taken is not None:
                    release(*taken)
        for lease in mine:
            release(*lease)

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so races get a chance
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(num_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)
    for lease in mailbox:
        release(*lease)

    assert not errors, errors[:5]
    assert not owner
    assert not live
    assert pool.num_free == num_slabs
    everything = leased(pool, num_slabs)
    assert pool.acquire() is None
    assert sorted(h.index for h in everything) == list(range(num_slabs))
    assert all(h.refcount == 1 for h in everything)


def test_concurrent_share_and_release_of_one_hot_slab() -> None:
    pool = HostPool(64, 1, pin=False, align=64)
    anchor = pool.acquire()
    assert anchor is not None
    start = threading.Barrier(8)

    def worker() -> None:
        start.wait()
        for _ in range(5000):
            anchor.share().release()

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert anchor.refcount == 1  # no lost increment or decrement
    assert pool.num_free == 0
    anchor.release()
    assert pool.num_free == 1


class PoolMachine(RuleBasedStateMachine):
    """acquire/share/release against a model: slab -> number of live leases."""

    NUM_SLABS = 4

    def __init__(self) -> None:
        super().__init__()
        self.pool = HostPool(64, self.NUM_SLABS, pin=False, align=64)
        self.counts: dict[int, int] = {}
        self.live: list[SlabHandle] = []
        self.released: list[SlabHandle] = []

    @rule()
    def acquire(self) -> None:
        handle = self.pool.acquire()
        if handle is None:
            assert len(self.counts) == self.NUM_SLABS
            return
        assert handle.index not in self.counts
        self.counts[handle.index] = 1
        self.live.append(handle)

    @rule(k=st.integers(min_value=0, max_value=NUM_SLABS))
    def acquire_several(self, k: int) -> None:
        """k acquires in a row: reaches multi-slab states (and exhaustion) in one step."""
        for _ in range(k):
            self.acquire()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        handle = data.draw(st.sampled_from(self.live))
        self.live.append(handle.share())
        self.counts[handle.index] += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        handle = data.draw(st.sampled_from(self.live))
        self.live.remove(handle)
        handle.release()
        self.released.append(handle)
        self.counts[handle.index] -= 1
        if self.counts[handle.index] == 0:
            del self.counts[handle.index]

    @precondition(lambda self: self.released)
    @rule(data=st.data())
    def release_again(self, data: st.DataObject) -> None:
        handle = data.draw(st.sampled_from(self.released))
        with pytest.raises(HandleError):
            handle.release()

    @invariant()
    def counts_match_the_model(self) -> None:
        assert self.pool.num_free == self.NUM_SLABS - len(self.counts)
        assert self.pool.num_in_use == len(self.counts)
        for handle in self.live:
            assert not handle.released
            assert handle.refcount == self.counts[handle.index]
        for handle in self.released:
            assert handle.released
            assert handle.refcount == self.counts.get(handle.index, 0)

    def teardown(self) -> None:
        for handle in self.live:
            handle.release()
        assert self.pool.num_free == self.NUM_SLABS
        self.pool.close()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
