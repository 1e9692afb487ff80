"""StorageManager: waterfall lookup, promotion, write policies, queues, failing tiers."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import pytest

from lmtier.chunks.keys import ChunkKey
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.host_pool import HostPool
from lmtier.storage.manager import StorageManager, TierSpan
from lmtier.storage.tier import TierProperties
from lmtier.testing import DictTier, make_chunk

SLAB = 16 * 1024


def chunks(n: int) -> list[tuple[ChunkKey, bytes]]:
    return [make_chunk(num_tokens=4, hidden=16, seed=i) for i in range(n)]


def run(
    body: Callable[[StorageManager, DictTier, DictTier], Awaitable[None]],
    *,
    cpu_slabs: int = 32,
    pool_slabs: int = 48,
    lower_props: TierProperties | None = None,
    timeout_s: float | None = None,
) -> None:
    async def case() -> None:
        pool = HostPool(SLAB, pool_slabs)
        cpu_tier = CPUTier(pool, cpu_slabs * pool.slab_bytes)
        disk = DictTier("disk", lower_props)
        remote = DictTier("remote", TierProperties(shared=True))
        manager = StorageManager(cpu_tier, [disk, remote], call_timeout_s=timeout_s)
        await manager.start()
        try:
            await body(manager, disk, remote)
        finally:
            await manager.close()
        assert pool.num_in_use == 0, "slabs leaked"
        pool.close()

    asyncio.run(case())


async def put_all(manager: StorageManager, items: list[tuple[ChunkKey, bytes]]) -> None:
    for key, data in items:
        handle = manager.cpu_tier.acquire_slab()
        assert handle is not None
        handle.view[: len(data)] = data
        manager.put(key, handle, len(data))


def test_waterfall_asks_each_tier_only_about_the_rest() -> None:
    async def body(manager: StorageManager, disk: DictTier, remote: DictTier) -> None:
        items = chunks(6)
        keys = [k for k, _ in items]
        await manager.cpu_tier.put(items[:2])
        disk.data.update(items[2:4])
        remote.data.update(items[4:5])
        found = await manager.lookup(keys)
        assert found.num_chunks == 5
        assert found.spans == (
            TierSpan("cpu", 0, 2),
            TierSpan("disk", 2, 4),
            TierSpan("remote", 4, 5),
        )
        assert disk.asked == [keys[2:]]
        assert remote.asked == [keys[4:]]

    run(body)


def test_full_memory_hit_asks_no_lower_tier() -> None:
    async def body(manager: StorageManager, disk: DictTier, remote: DictTier) -> None:
        items = chunks(3)
        await manager.cpu_tier.put(items)
        assert (await manager.lookup([k for k, _ in items])).num_chunks == 3
        assert disk.calls == {} and remote.calls == {}

    run(body)


def test_get_promotes_to_memory_and_to_tiers_above_the_source() -> None:
    async def body(manager: StorageManager, disk: DictTier, remote: DictTier) -> None:
        items = chunks(4)
        keys = [k for k, _ in items]
        await manager.cpu_tier.put(items[:1])
        remote.data.update(items[1:])
        loaded = await manager.get(keys)
        assert [c.key for c in loaded] == keys
        assert [c.tier for c in loaded] == ["cpu", "remote", "remote", "remote"]
        for chunk, (_, data) in zip(loaded, items, strict=True):
            assert bytes(chunk.handle.view[: len(data)]) == data
            assert chunk.chunk.meta.namespace + chunk.chunk.meta.key == chunk.key
            chunk.release()
        await manager.flush()
        assert manager.cpu_tier.count_prefix(keys) == 4
        assert set(disk.data) == set(keys[1:])  # promoted down the waterfall's upper part

    run(body)


def test_put_writes_through_in_the_background() -> None:
    async def body(manager: StorageManager, disk: DictTier, remote: DictTier) -> None:
        items = chunks(5)
        await put_all(manager, items)
        assert manager.cpu_tier.count_prefix([k for k, _ in items]) == 5
        await manager.flush()
        assert disk.data == dict(items)
        assert remote.data == dict(items)

    run(body)


def test_a_chunk_put_again_while_cached_is_not_written_again() -> None:
    async def body(manager: StorageManager, disk: DictTier, remote: DictTier) -> None:
        items = chunks(3)
        await put_all(manager, items)
        await manager.flush()
        await put_all(manager, items)  # a store that did not skip what is cached
        await manager.flush()
        assert (disk.stats.puts, remote.stats.puts) == (3, 3)
        assert manager.cpu_tier.stats.puts == 3

    run(body)


def test_write_back_tier_gets_only_evicted_chunks() -> None:
    props = TierProperties(shared=False, write_policy="write_back")

    async def body(manager: StorageManager, disk: DictTier, remote: DictTier) -> None:
        items = chunks(6)
        await put_all(manager, items)
        await manager.flush()
        evicted = [k for k, _ in items[:2]]  # CPU tier holds 4: the two oldest go
        assert sorted(disk.data) == sorted(evicted)
        assert len(remote.data) == 6
        assert (await manager.lookup([k for k, _ in items])).spans[0] == TierSpan("disk", 0, 2)

    run(body, cpu_slabs=4, lower_props=props)


def test_full_queue_drops_and_counts_instead_of_blocking() -> None:
    props = TierProperties(shared=False, queue_depth=2)

    async def body(manager: StorageManager, disk: DictTier, remote: DictTier) -> None:
        disk.hang = True
        items = chunks(10)
        started = time.perf_counter()
        await put_all(manager, items)
        assert time.perf_counter() - started < 10.0  # a blocked put would never return
        await asyncio.sleep(0)
        assert disk.stats.queue_drops >= 10 - 2 - 1  # queue depth 2, one batch in flight
        disk.hang = False

    run(body, lower_props=props, timeout_s=0.2)


def test_failing_tier_is_a_miss_not_an_error() -> None:
    async def body(manager: StorageManager, disk: DictTier, remote: DictTier) -> None:
        items = chunks(3)
        remote.data.update(items)
        disk.fail = True
        found = await manager.lookup([k for k, _ in items])
        assert found.num_chunks == 3  # disk failed: asked remote about everything
        assert disk.stats.errors == 1
        remote.fail = True
        assert (await manager.lookup([k for k, _ in items])).num_chunks == 0
        assert await manager.get([k for k, _ in items]) == []

    run(body)


def test_hung_tier_times_out_into_a_miss() -> None:
    async def body(manager: StorageManager, disk: DictTier, remote: DictTier) -> None:
        items = chunks(2)
        disk.data.update(items)
        disk.hang = True
        started = time.perf_counter()
        assert (await manager.lookup([k for k, _ in items])).num_chunks == 0
        assert time.perf_counter() - started < 10.0  # the hung tier never answers
        assert disk.stats.errors == 1
        disk.hang = False

    run(body, timeout_s=0.1)


def test_get_stops_at_a_corrupt_chunk_without_gaps() -> None:
    async def body(manager: StorageManager, disk: DictTier, remote: DictTier) -> None:
        items = chunks(4)
        disk.data.update(items)
        key, data = items[1]
        disk.data[key] = data[:-1] + bytes([data[-1] ^ 1])
        loaded = await manager.get([k for k, _ in items])
        assert [c.key for c in loaded] == [items[0][0]]
        loaded[0].release()
        assert disk.stats.corrupt == 1
        assert key not in disk.data

    run(body)


def test_close_flushes_queued_writes() -> None:
    async def case() -> None:
        pool = HostPool(SLAB, 16)
        disk = DictTier("disk")
        manager = StorageManager(CPUTier(pool), [disk])
        await manager.start()
        await put_all(manager, chunks(5))
        await manager.close()
        assert len(disk.data) == 5
        assert pool.num_in_use == 0

    asyncio.run(case())


def test_stats_cover_every_tier() -> None:
    async def body(manager: StorageManager, disk: DictTier, remote: DictTier) -> None:
        await manager.lookup([make_chunk()[0]])
        stats = manager.stats()
        assert list(stats) == ["cpu", "disk", "remote"]
        assert stats["cpu"]["lookups"] == 1
        assert "queue_depth" in stats["disk"]

    run(body)


def test_lookup_now_answers_only_from_in_memory_indexes() -> None:
    async def body(manager: StorageManager, disk: DictTier, remote: DictTier) -> None:
        items = chunks(3)
        keys = [k for k, _ in items]
        await manager.cpu_tier.put(items)
        assert manager.lookup_now(keys) == await manager.lookup(keys)  # memory answers all
        assert disk.calls == {}
        # A tier without an in-memory index must be asked asynchronously: no answer now.
        assert manager.lookup_now([*keys, make_chunk()[0]]) is None

    run(body)


@pytest.mark.parametrize("write_back", [False, True])
def test_evict_listeners_see_every_evicted_key_in_order(write_back: bool) -> None:
    policy = "write_back" if write_back else "write_through"
    props = TierProperties(shared=False, write_policy=policy)

    async def body(manager: StorageManager, disk: DictTier, remote: DictTier) -> None:
        seen: list[ChunkKey] = []
        manager.add_evict_listener(seen.append)
        items = chunks(8)
        await put_all(manager, items[:7])
        keys = [k for k, _ in items]
        assert seen == keys[:3]  # the CPU tier holds 4: the three oldest go, in order
        manager.remove_evict_listener(seen.append)
        manager.remove_evict_listener(seen.append)  # not registered: ignored
        await put_all(manager, items[7:])
        assert seen == keys[:3]
        await manager.flush()
        if write_back:  # write-back still gets every evicted chunk
            assert sorted(disk.data) == sorted(keys[:4])
        else:
            assert disk.data == dict(items)

    run(body, cpu_slabs=4, lower_props=props)


def test_a_raising_evict_listener_never_breaks_eviction(caplog: pytest.LogCaptureFixture) -> None:
    props = TierProperties(shared=False, write_policy="write_back")

    async def body(manager: StorageManager, disk: DictTier, remote: DictTier) -> None:
        seen: list[ChunkKey] = []

        def broken(key: ChunkKey) -> None:
            raise RuntimeError("listener bug")

        manager.add_evict_listener(broken)
        manager.add_evict_listener(seen.append)
        items = chunks(6)
        with caplog.at_level(logging.ERROR, logger="lmtier.storage.manager"):
            await put_all(manager, items)
        keys = [k for k, _ in items]
        assert seen == keys[:2]
        assert manager.cpu_tier.count_prefix(keys[2:]) == 4
        await manager.flush()
        assert sorted(disk.data) == sorted(keys[:2])  # write-back unaffected
        assert sum("listener" in r.getMessage() for r in caplog.records) == 2

    run(body, cpu_slabs=4, lower_props=props)
