"""The CPU tier: conformance, LRU order, capacity bounds, and chunks in use never evicted."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmtier.chunks.keys import ChunkKey
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.host_pool import HostPool, SlabHandle
from lmtier.testing import make_chunk
from lmtier.testing.conformance import TierConformance


class TestCPUTierConformance(TierConformance):
    @pytest.fixture
    def make_tier(self):  # type: ignore[no-untyped-def]
        pool = HostPool(64 * 1024, 256)

        async def factory() -> CPUTier:
            return CPUTier(pool)

        yield factory
        assert pool.num_in_use == 0, "the CPU tier leaked slabs"
        pool.close()


def _tier(num_slabs: int, capacity_slabs: int | None = None) -> CPUTier:
    pool = HostPool(16 * 1024, num_slabs)
    capacity = None if capacity_slabs is None else capacity_slabs * pool.slab_bytes
    return CPUTier(pool, capacity)


def test_lru_eviction_order_and_capacity() -> None:
    tier = _tier(8, capacity_slabs=3)
    chunks = [make_chunk(num_tokens=4, hidden=16) for _ in range(5)]
    keys = [key for key, _ in chunks]

    async def body() -> None:
        await tier.put(chunks[:3])
        tier.share(keys[0])[0].release()  # touch the oldest: now most recently used
        await tier.put(chunks[3:])
        assert len(tier) == 3
        present = [await tier.contains([k]) for k in keys]
        assert present == [1, 0, 0, 1, 1]
        assert tier.stats.evictions == 2

    asyncio.run(body())


def test_chunk_in_use_is_never_evicted() -> None:
    tier = _tier(4, capacity_slabs=2)
    a, b, c = (make_chunk(num_tokens=4, hidden=16) for _ in range(3))

    async def body() -> None:
        await tier.put([a, b])
        lease, size = tier.share(a[0]) or (None, 0)
        assert lease is not None
        await tier.put([c])  # must evict b, the only idle chunk, though a is older
        assert await tier.contains([a[0]]) == 1
        assert await tier.contains([b[0]]) == 0
        assert bytes(lease.view[:size]) == a[1]
        lease.release()

    asyncio.run(body())


def test_full_of_readers_refuses_without_blocking() -> None:
    tier = _tier(2)
    a, b, c = (make_chunk(num_tokens=4, hidden=16) for _ in range(3))

    async def body() -> None:
        await tier.put([a, b])
        leases = [tier.share(a[0]), tier.share(b[0])]
        assert await tier.put([c]) == 0
        assert tier.stats.errors == 1
        assert tier.acquire_slab() is None
        for lease in leases:
            assert lease is not None
            lease[0].release()
        assert await tier.put([c]) == 1

    asyncio.run(body())


def test_evicted_chunks_go_to_the_callback_with_a_lease() -> None:
    tier = _tier(4, capacity_slabs=1)
    evicted: list[tuple[ChunkKey, bytes]] = []

    def on_evict(key: ChunkKey, handle: SlabHandle, size: int) -> None:
        evicted.append((key, bytes(handle.view[:size])))
        handle.release()

    tier.on_evict = on_evict
    a, b = make_chunk(num_tokens=4, hidden=16), make_chunk(num_tokens=4, hidden=16)
    asyncio.run(tier.put([a, b]))
    assert evicted == [a]


class CPUTierMachine(RuleBasedStateMachine):
    """Random put/share/release/delete against a model of LRU order and leases."""

    def __init__(self) -> None:
        super().__init__()
        self.tier = _tier(6, capacity_slabs=4)
        self.model: OrderedDict[ChunkKey, bytes] = OrderedDict()
        self.leases: list[tuple[ChunkKey, SlabHandle, int]] = []
        self.chunks = [make_chunk(num_tokens=4, hidden=16, seed=i) for i in range(8)]
        self.loop = asyncio.new_event_loop()

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def _in_use(self) -> set[ChunkKey]:
        return {key for key, _, _ in self.leases}

    @rule(index=st.integers(0, 7))
    def put(self, index: int) -> None:
        key, data = self.chunks[index]
        # Slabs are held by cached entries and by leases (a lease outlives a delete).
        lease_slabs = {handle.index for _, handle, _ in self.leases}
        entry_slabs = {k: e.handle.index for k, e in self.tier._entries.items()}
        stored = self.run(self.tier.put([(key, data)]))
        if key in self.model:
            self.model.move_to_end(key)
            assert stored == 1
            return
        idle = [k for k in self.model if entry_slabs[k] not in lease_slabs]
        used = len(set(entry_slabs.values()) | lease_slabs)
        # First a free slab (evicting if the pool is exhausted), then room in the index.
        for full in (lambda: used >= self.tier.pool.num_slabs, lambda: len(self.model) >= 4):
            if full():
                if not idle:
                    assert stored == 0
                    return
                del self.model[idle.pop(0)]  # the least recently used idle chunk goes
        assert stored == 1
        self.model[key] = data

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(list(self.model)))
        shared = self.tier.share(key)
        assert shared is not None
        handle, size = shared
        assert bytes(handle.view[:size]) == self.model[key]
        self.model.move_to_end(key)
        self.leases.append((key, handle, size))

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.leases) - 1))
        _, handle, _ = self.leases.pop(index)
        handle.release()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(list(self.model)))
        assert self.run(self.tier.delete([key])) == 1
        del self.model[key]

    @invariant()
    def matches_model(self) -> None:
        assert list(self.tier._entries) == list(self.model)
        assert len(self.tier) <= 4
        for key, handle, size in self.leases:
            assert bytes(handle.view[:size]) == dict(self.chunks)[key]

    def teardown(self) -> None:
        for _, handle, _ in self.leases:
            handle.release()
        self.run(self.tier.close())
        self.loop.close()
        assert self.tier.pool.num_in_use == 0
        self.tier.pool.close()


TestCPUTierMachine = CPUTierMachine.TestCase
TestCPUTierMachine.settings = settings(max_examples=50, stateful_step_count=25, deadline=None)
