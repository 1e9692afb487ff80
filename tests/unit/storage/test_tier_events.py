"""The StorageManager's event feed (lmtier.storage.events): a view rebuilt from the
events alone equals what every tier holds, after stores, evictions, promotions,
purges and deletes of corrupt chunks; subscribers are bounded and count what they
lose."""

from __future__ import annotations

import asyncio
import random

import pytest

from lmtier.chunks.keys import ChunkKey
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.events import TierEvent, TierEvents
from lmtier.storage.host_pool import HostPool
from lmtier.storage.manager import StorageManager
from lmtier.storage.tier import TierProperties
from lmtier.testing import DictTier, make_chunk, random_key

SLAB = 16 * 1024
NS_A = b"namespace-aaaaa!"
NS_B = b"namespace-bbbbb!"


class View:
    """What each tier holds, as the events tell it (a ``cleared`` forgets the
    namespace in that tier)."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[ChunkKey]] = {}

    def apply(self, events: list[TierEvent]) -> None:
        for event in events:
            held = self.tiers.setdefault(event.tier, set())
            if event.kind == "stored":
                held.update(event.keys)
            elif event.kind == "removed":
                held.difference_update(event.keys)
            else:
                held.difference_update({k for k in held if k.startswith(event.namespace)})


def put(manager: StorageManager, key: ChunkKey, data: bytes) -> None:
    (handle,) = manager.acquire_slabs(1)
    handle.view[: len(data)] = data
    manager.put(key, handle, len(data))


def test_a_view_built_from_the_events_equals_the_tiers() -> None:
    async def case() -> None:
        pool = HostPool(SLAB, 24)
        cpu = CPUTier(pool, 8 * pool.slab_bytes)
        disk = DictTier("disk")
        remote = DictTier("remote", TierProperties(shared=True, write_policy="write_back"))
        manager = StorageManager(cpu, [disk, remote])
        await manager.start()
        feed = manager.events.subscribe()
        view = View()
        rng = random.Random(7)
        stored: list[ChunkKey] = []
        try:
            for step in range(120):
                action = rng.random()
                if action < 0.6:  # a store (evicting the CPU tier's LRU when full)
                    key, data = make_chunk(
                        random_key(rng.choice((NS_A, NS_B))), num_tokens=4, hidden=16, seed=step
                    )
                    put(manager, key, data)
                    stored.append(key)
                elif action < 0.75 and stored:  # a load: promotes lower tiers' hits
                    keys = rng.sample(stored, min(3, len(stored)))
                    for chunk in await manager.get(keys[:1]):
                        chunk.release()
                elif action < 0.85 and disk.data:  # a corrupt chunk on disk, found on read
                    victim = rng.choice(sorted(disk.data))
                    disk.data[victim] = b"\x00" * len(disk.data[victim])
                    await cpu.delete([victim])
                    for chunk in await manager.get([victim]):
                        chunk.release()
                elif action < 0.9:
                    await manager.purge(rng.choice((NS_A, NS_B)))
                await manager.flush()
                view.apply(feed.take())
                assert view.tiers.get("cpu", set()) == set(cpu.keys()), f"step {step}"
                assert view.tiers.get("disk", set()) == set(disk.data), f"step {step}"
                assert view.tiers.get("remote", set()) == set(remote.data), f"step {step}"
            assert feed.lost == 0
            assert cpu.stats.evictions and disk.stats.corrupt and remote.data, "all exercised"
        finally:
            feed.close()
            await manager.close()
        pool.close()

    asyncio.run(case())


def test_a_subscriber_that_falls_behind_loses_the_oldest_and_counts_them() -> None:
    hub = TierEvents()
    assert not hub.active
    hub.emit("stored", "cpu", [random_key()])  # nobody listens: nothing kept
    slow, fast = hub.subscribe(max_events=3), hub.subscribe()
    keys = [random_key() for _ in range(5)]
    for key in keys:
        hub.emit("stored", "cpu", [key])
    hub.emit("removed", "cpu", [])  # no keys: no event
    assert [event.keys[0] for event in slow.take()] == keys[2:]
    assert slow.lost == 2 and fast.lost == 0
    assert len(fast.take()) == 5 and fast.take() == []
    slow.close()
    hub.emit("cleared", "disk", namespace=NS_A)
    assert slow.take() == [] and fast.take()[0].namespace == NS_A
    with pytest.raises(ValueError, match="at least 1"):
        hub.subscribe(max_events=0)
