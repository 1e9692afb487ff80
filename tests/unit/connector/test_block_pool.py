"""The device prefix-cache block pool: the reference walk-through, rules, a model, vLLM."""

from __future__ import annotations

import dataclasses
import random
import types
import warnings
from collections import Counter
from typing import Any

import pytest
import xxhash
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmtier.chunks.keys import Namespace
from lmtier_connector.device.block_pool import (
    Block,
    BlockHash,
    BlockHashMap,
    BlockPool,
    FreeBlockQueue,
    PrefixCache,
    block_hashes,
)

NAMESPACE = Namespace(model_id="test-block-pool")


def ids(blocks: Any) -> list[int]:
    return [block.block_id for block in blocks]


def free_ids(pool: BlockPool) -> list[int]:
    pool.free_queue.check_links()
    return ids(pool.free_queue.get_all_free_blocks())


# --- The reference document's block_size=4 walk-through (section 6) ---------------------


def manual_chain(tokens: list[int], block_size: int) -> list[bytes]:
    """h[i] = H(h[i-1], tokens of block i), spelled out from lmtier.chunks.keys' definition."""
    digest = dataclasses.replace(NAMESPACE, chunk_size=block_size).digest
    parent, hashes = digest, []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        body = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + block_size])
        parent = xxhash.xxh3_128_digest(parent + b"\x04" + body)
        hashes.append(digest + parent)
    return hashes


def test_walkthrough_block_size_4_requests_a_and_b() -> None:
    pool = BlockPool(16)  # block 0 is the null block; 1..15 are usable
    cache = PrefixCache(pool, block_size=4)
    # Other requests hold blocks 1..11; those holding 11, 9, 7, 5 end (one unhashed
    # block each, so each goes to the queue front), which puts A on 5/7/9/11.
    for block_id in range(1, 12):
        assert ids(cache.allocate(f"other{block_id}", 4) or []) == [block_id]
    for block_id in (11, 9, 7, 5):
        cache.free(f"other{block_id}")
    assert free_ids(pool) == [5, 7, 9, 11, 12, 13, 14, 15]

    # Step 0: A (16 tokens, 4 blocks) is prefilled on blocks 5/7/9/11 and cached.
    tokens_a = list(range(16))
    hashes_a = block_hashes(tokens_a, NAMESPACE, 4)
    assert hashes_a == manual_chain(tokens_a, 4)  # H(NONE,[t0..t3]), H(h0,[t4..t7]), ...
    assert cache.find_longest_cache_hit(hashes_a, 16) == ([], 0)
    assert ids(cache.allocate("A", 16) or []) == [5, 7, 9, 11]
    cache.cache("A", hashes_a, 16)
    assert [pool.blocks[i].ref_cnt for i in (5, 7, 9, 11)] == [1, 1, 1, 1]
    for block_id, block_hash in zip([5, 7, 9, 11], hashes_a, strict=True):
        assert pool.blocks[block_id].block_hash == block_hash
        assert pool.get_cached_block(block_hash) is pool.blocks[block_id]
    assert free_ids(pool) == [12, 13, 14, 15]

    # free(A): ref counts reach 0, blocks join the back in reverse (11 nearest the
    # front), still cached: valid hits.
    cache.free("A")
    assert [pool.blocks[i].ref_cnt for i in (5, 7, 9, 11)] == [0, 0, 0, 0]
    assert free_ids(pool) == [12, 13, 14, 15, 11, 9, 7, 5]
    assert pool.get_cached_block(hashes_a[3]) is pool.blocks[11]
    # The same prompt again hits only 3 blocks: its last token is recomputed.
    hit_a, num_hit_a = cache.find_longest_cache_hit(hashes_a, 16)
    assert (ids(hit_a), num_hit_a) == ([5, 7, 9], 12)

    # Step 1: B shares blocks 0..2 with A; its block 3 is t20..t23.
    tokens_b = [*tokens_a[:12], 20, 21, 22, 23]
    hashes_b = block_hashes(tokens_b, NAMESPACE, 4)
    assert hashes_b[:3] == hashes_a[:3] and hashes_b[3] != hashes_a[3]
    hit, num_hit_tokens = cache.find_longest_cache_hit(hashes_b, 16)  # max 15 // 4 = 3 blocks
    assert (ids(hit), num_hit_tokens) == ([5, 7, 9], 12)
    new_blocks = cache.allocate("B", 16, hit)  # touch revives 5/7/9: ref 0 -> 1
    assert ids(new_blocks or []) == [12]
    assert [pool.blocks[i].ref_cnt for i in (5, 7, 9)] == [1, 1, 1]
    assert free_ids(pool) == [13, 14, 15, 11]
    cache.cache("B", hashes_b, 16)  # H(h2, [t20..t23]) -> block 12
    assert pool.get_cached_block(hashes_b[3]) is pool.blocks[12]
    assert pool.get_cached_block(hashes_a[3]) is pool.blocks[11]  # A's tail: free, cached
    assert ids(cache.get_blocks("B")) == [5, 7, 9, 12]

    # Block granularity: sharing 10 tokens with A hits 2 blocks (8 tokens), not 10.
    tokens_c = [*tokens_a[:10], 30, 31, 32, 33]
    hit_c, num_hit_c = cache.find_longest_cache_hit(block_hashes(tokens_c, NAMESPACE, 4), 14)
    assert (ids(hit_c), num_hit_c) == ([5, 7], 8)


def test_walkthrough_step_2_a_still_running_shares_blocks_with_b() -> None:
    pool = BlockPool(16)
    cache = PrefixCache(pool, block_size=4)
    tokens_a = list(range(16))
    hashes_a = block_hashes(tokens_a, NAMESPACE, 4)
    assert ids(cache.allocate("A", 16) or []) == [1, 2, 3, 4]
    cache.cache("A", hashes_a, 16)

    tokens_b = [*tokens_a[:12], 20, 21, 22, 23]
    hashes_b = block_hashes(tokens_b, NAMESPACE, 4)
    hit, _ = cache.find_longest_cache_hit(hashes_b, 16)
    assert ids(cache.allocate("B", 16, hit) or []) == [5]
    cache.cache("B", hashes_b, 16)
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [2, 2, 2, 1, 1]  # zero copy
    assert cache.num_common_prefix_blocks("A", 2) == cache.num_common_prefix_blocks("B", 2) == 3

    cache.free("A")  # 1/2/3 back to ref 1 and kept; A's own tail 4 goes to the back
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 1, 0]
    assert free_ids(pool) == [*range(6, 16), 4]
    cache.free("B")
    assert free_ids(pool) == [*range(6, 16), 4, 5, 3, 2, 1]
    assert pool.usage == 0.0


# --- Rules, one at a time ---------------------------------------------------------------


def test_free_order_unhashed_to_front_hashed_to_back_tail_first() -> None:
    pool = BlockPool(10)
    cache = PrefixCache(pool, block_size=4)
    tokens = list(range(10))  # two full blocks and a partial one
    assert ids(cache.allocate("r", 10) or []) == [1, 2, 3]
    cache.cache("r", block_hashes(tokens, NAMESPACE, 4), 10)
    assert pool.blocks[3].block_hash is None and pool.blocks[2].block_hash is not None
    cache.free("r")
    assert free_ids(pool) == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    # The next allocation reuses the unhashed block first, then never-used ones,
    # and reaches the cached blocks (evicting their hashes) last, tail first.
    assert ids(pool.get_new_blocks(8) or []) == [3, 4, 5, 6, 7, 8, 9, 2]
    assert pool.blocks[2].block_hash is None and pool.blocks[1].block_hash is not None


def test_free_blocks_keeps_the_given_order_within_each_side() -> None:
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(6)
    assert blocks is not None
    pool.cache_full_blocks(blocks, [BlockHash(bytes([i]) * 32) for i in range(6)], 0, 3)
    pool.free_blocks([blocks[4], blocks[0], blocks[3], blocks[1], blocks[5], blocks[2]])
    assert free_ids(pool) == [5, 4, 6, 7, 1, 2, 3]


def test_duplicates_in_the_hash_map_keep_block_tables_append_only() -> None:
    pool = BlockPool(12)
    cache = PrefixCache(pool, block_size=4)
    tokens = list(range(9))
    hashes = block_hashes(tokens, NAMESPACE, 4)
    # Both requests miss before either caches: they compute the same blocks twice.
    for request_id in ("first", "second"):
        assert cache.find_longest_cache_hit(hashes, 9) == ([], 0)
        assert cache.allocate(request_id, 9) is not None
    cache.cache("first", hashes, 9)
    cache.cache("second", hashes, 9)
    assert ids(cache.get_blocks("first")) == [1, 2, 3]
    assert ids(cache.get_blocks("second")) == [4, 5, 6]  # not rewritten to 1, 2
    assert sorted((h, b.block_id) for h, b in pool.cached_blocks.items()) == sorted(
        [(hashes[0], 1), (hashes[0], 4), (hashes[1], 2), (hashes[1], 5)]
    )
    assert pool.get_cached_block(hashes[0]) is pool.blocks[1]  # the earliest cached
    pool.evict_blocks([1])
    assert pool.get_cached_block(hashes[0]) is pool.blocks[4]  # the duplicate still serves
    assert len(pool.cached_blocks) == 2


def test_hash_map_single_and_duplicate_entries() -> None:
    hash_map = BlockHashMap()
    a, b = Block(1), Block(2)
    key = BlockHash(b"k" * 32)
    hash_map.insert(key, a)
    hash_map.insert(key, a)  # the same block twice is one entry
    assert list(hash_map.items()) == [(key, a)]
    hash_map.insert(key, b)
    assert hash_map.pop(key, 3) is None
    assert hash_map.pop(key, 1) is a and hash_map.get_one(key) is b
    assert hash_map.pop(key, 2) is b and len(hash_map) == 0 and hash_map.get_one(key) is None


def test_double_free_raises_and_names_the_block() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    assert blocks is not None
    pool.free_blocks(blocks)
    with pytest.raises(RuntimeError, match="double free of block 1"):
        pool.free_blocks(blocks[:1])
    assert [b.ref_cnt for b in pool.blocks] == [0, 0, 0, 0]
    # Twice in one call: the first reference is released and queued, then it raises.
    again = pool.get_new_blocks(1)
    assert again is not None
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([again[0], again[0]])
    assert sorted(free_ids(pool)) == [1, 2, 3]


def test_touch_of_a_block_outside_the_queue_with_ref_0_raises() -> None:
    pool = BlockPool(4)
    stray = Block(9)
    with pytest.raises(RuntimeError, match="not in the free queue"):
        pool.touch([stray])


def test_reset_refuses_while_blocks_are_in_use() -> None:
    pool = BlockPool(8)
    cache = PrefixCache(pool, block_size=2)
    hashes = block_hashes([1, 2, 3, 4, 5], NAMESPACE, 2)
    cache.allocate("r", 5)
    cache.cache("r", hashes, 5)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(hashes[0]) is not None
    cache.free("r")
    assert pool.reset_prefix_cache() is True
    assert len(pool.cached_blocks) == 0
    assert all(block.block_hash is None for block in pool.blocks)
    assert cache.find_longest_cache_hit(hashes, 5) == ([], 0)


def test_num_common_prefix_blocks() -> None:
    pool = BlockPool(32)
    cache = PrefixCache(pool, block_size=2)
    shared = [7, 7, 8, 8]
    for index, request_id in enumerate(("a", "b", "c")):
        tokens = [*shared, index, index, 9]
        hashes = block_hashes(tokens, NAMESPACE, 2)
        hit, _ = cache.find_longest_cache_hit(hashes, len(tokens))
        cache.allocate(request_id, len(tokens), hit)
        cache.cache(request_id, hashes, len(tokens))
    assert [cache.num_common_prefix_blocks(r, 3) for r in "abc"] == [2, 2, 2]
    cache.allocate("d", 3)  # a fourth request sharing nothing
    assert cache.num_common_prefix_blocks("a", 4) == 0
    assert cache.num_common_prefix_blocks("d", 4) == 0


def test_shortage_is_a_value_and_changes_nothing() -> None:
    pool = BlockPool(5)
    cache = PrefixCache(pool, block_size=2)
    hashes = block_hashes([1, 2, 3, 4, 5], NAMESPACE, 2)
    cache.allocate("a", 5)
    cache.cache("a", hashes, 5)
    cache.free("a")  # 3 and then 2, 1 (cached) are free again, plus block 4
    hit, _ = cache.find_longest_cache_hit(hashes, 5)
    assert ids(hit) == [1, 2]
    before = free_ids(pool)
    assert pool.get_new_blocks(5) is None
    # 4 free blocks: reviving the 2 hit blocks leaves 2, and 9 tokens need 3 more.
    assert cache.allocate("b", 9, hit) is None
    assert free_ids(pool) == before and [b.ref_cnt for b in pool.blocks] == [0] * 5
    with pytest.raises(KeyError, match="unknown request 'b'"):
        cache.get_blocks("b")
    assert cache.allocate("b", 8, hit) is not None
    assert pool.usage == 1.0


def test_allocation_evicts_cached_blocks_when_everything_is_cached() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    assert blocks is not None
    hashes = [BlockHash(bytes([i]) * 32) for i in range(4)]
    pool.cache_full_blocks(blocks, hashes, 0, 4)
    pool.free_blocks(reversed(blocks))
    assert ids(pool.get_new_blocks(1) or []) == [4]
    assert pool.get_cached_block(hashes[3]) is None
    assert pool.get_cached_block(hashes[2]) is pool.blocks[3]


def test_evict_blocks_drops_hashes_but_not_references() -> None:
    pool = BlockPool(6)
    cache = PrefixCache(pool, block_size=2)
    hashes = block_hashes([1, 2, 3, 4, 5], NAMESPACE, 2)
    cache.allocate("r", 5)
    cache.cache("r", hashes, 5)
    assert pool.evict_blocks([2, 2, 3]) == 1  # block 3 holds the partial tail: no hash
    assert pool.blocks[2].ref_cnt == 1 and pool.blocks[2].block_hash is None
    assert ids(cache.find_longest_cache_hit(hashes, 5)[0]) == [1]
    with pytest.raises(ValueError, match="outside the pool"):
        pool.evict_blocks([6])


def test_caching_a_block_under_a_second_prefix_raises() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(1)
    assert blocks is not None
    pool.cache_full_blocks(blocks, [BlockHash(b"a" * 32)], 0, 1)
    pool.cache_full_blocks(blocks, [BlockHash(b"a" * 32)], 0, 1)  # idempotent
    with pytest.raises(RuntimeError, match="already cached under another prefix"):
        pool.cache_full_blocks(blocks, [BlockHash(b"b" * 32)], 0, 1)


def test_caching_disabled_is_a_plain_allocator() -> None:
    pool = BlockPool(6, enable_caching=False)
    cache = PrefixCache(pool, block_size=2)
    hashes = block_hashes([1, 2, 3, 4, 5], NAMESPACE, 2)
    cache.allocate("r", 5)
    cache.cache("r", hashes, 5)
    assert len(pool.cached_blocks) == 0
    assert cache.find_longest_cache_hit(hashes, 5) == ([], 0)


def test_free_queue_operations() -> None:
    blocks = [Block(i) for i in range(6)]
    queue = FreeBlockQueue(blocks)
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[3])
    assert ids(queue.popleft_n(2)) == [1, 2]
    queue.append(blocks[0])
    queue.prepend_n([blocks[3], blocks[1]])
    queue.append_n([blocks[2]])
    assert ids(queue.get_all_free_blocks()) == [3, 1, 4, 5, 0, 2] and queue.num_free == 6
    queue.check_links()
    with pytest.raises(RuntimeError, match="already in the free queue"):
        queue.append(blocks[4])
    assert ids(queue.popleft_n(6)) == [3, 1, 4, 5, 0, 2]
    with pytest.raises(RuntimeError, match="not in the free queue"):
        queue.remove(blocks[0])
    with pytest.raises(RuntimeError, match="empty free queue"):
        queue.popleft()
    queue.check_links()


# --- A model-based stateful test --------------------------------------------------------

BS = 2
NUM_BLOCKS = 9
MAX_TOKENS = 10


class BlockPoolMachine(RuleBasedStateMachine):
    """Random request lives against a plain model of the queue order, hashes and refs."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.cache = PrefixCache(self.pool, BS)
        self.queue: list[int] = list(range(1, NUM_BLOCKS))
        self.hash_of: dict[int, BlockHash] = {}
        self.by_hash: dict[BlockHash, list[int]] = {}
        self.content: dict[int, tuple[int, ...]] = {}  # the prefix whose KV a block holds
        self.holders: dict[str, list[int]] = {}  # requests and pins
        self.tokens: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}
        self.prompts: list[list[int]] = []
        self.serial = 0

    def refs(self) -> Counter[int]:
        return Counter(b for blocks in self.holders.values() for b in blocks)

    def model_drop_hash(self, block_id: int) -> bool:
        block_hash = self.hash_of.pop(block_id, None)
        if block_hash is None:
            return False
        self.by_hash[block_hash].remove(block_id)
        if not self.by_hash[block_hash]:
            del self.by_hash[block_hash]
        return True

    def model_pop(self, num: int, got: list[Block] | None) -> bool:
        if num > len(self.queue):
            assert got is None
            return False
        assert got is not None and ids(got) == self.queue[:num]
        refs = self.refs()
        for block_id in self.queue[:num]:
            assert refs[block_id] == 0  # never hand out a block in use
            self.model_drop_hash(block_id)
        del self.queue[:num]
        return True

    def model_free(self, holder: str) -> None:
        released = self.holders.pop(holder)
        refs = self.refs()
        front = [b for b in reversed(released) if refs[b] == 0 and b not in self.hash_of]
        back = [b for b in reversed(released) if refs[b] == 0 and b in self.hash_of]
        self.queue = front + self.queue + back

    def running(self) -> list[str]:
        return sorted(self.tokens)

    @rule(
        data=st.data(),
        suffix=st.lists(st.integers(0, 2), min_size=1, max_size=4),
        prefill=st.booleans(),
    )
    def start_request(self, data: st.DataObject, suffix: list[int], prefill: bool) -> None:
        # Most prompts extend an earlier prompt's prefix, so hits are common.
        base = data.draw(st.sampled_from(self.prompts)) if self.prompts else []
        tokens = (base[: data.draw(st.integers(0, len(base)))] + suffix)[:MAX_TOKENS]
        self.prompts.append(tokens)
        hashes = block_hashes(tokens, NAMESPACE, BS)
        hit, num_hit = self.cache.find_longest_cache_hit(hashes, len(tokens))
        assert num_hit == len(hit) * BS and num_hit <= len(tokens) - 1  # last-token rule
        expected: list[int] = []
        for block_hash in hashes[: (len(tokens) - 1) // BS]:
            if block_hash not in self.by_hash:
                break
            expected.append(self.by_hash[block_hash][0])
        assert ids(hit) == expected
        for index, block_id in enumerate(expected):
            assert self.content[block_id] == tuple(tokens[: (index + 1) * BS])
        request_id = f"r{self.serial}"
        self.serial += 1
        num_new = max(-(-len(tokens) // BS) - len(hit), 0)
        refs = self.refs()
        num_revived = sum(1 for b in expected if refs[b] == 0)
        got = self.cache.allocate(request_id, len(tokens), hit)
        if num_new + num_revived > len(self.queue):
            assert got is None
            return
        self.queue = [b for b in self.queue if b not in expected]
        assert self.model_pop(num_new, got)
        self.holders[request_id] = expected + ids(got or [])
        self.tokens[request_id] = tokens
        self.num_cached[request_id] = len(hit)
        if prefill:
            self.model_cache(request_id)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def cache_request(self, data: st.DataObject) -> None:
        self.model_cache(data.draw(st.sampled_from(self.running())))

    def model_cache(self, request_id: str) -> None:
        tokens = self.tokens[request_id]
        hashes = block_hashes(tokens, NAMESPACE, BS)
        self.cache.cache(request_id, hashes, len(tokens))
        num_full = len(tokens) // BS
        for index in range(self.num_cached[request_id], num_full):
            block_id = self.holders[request_id][index]
            if block_id not in self.hash_of:
                self.hash_of[block_id] = hashes[index]
                self.by_hash.setdefault(hashes[index], []).append(block_id)
                self.content[block_id] = tuple(tokens[: (index + 1) * BS])
        self.num_cached[request_id] = max(self.num_cached[request_id], num_full)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def grow_request(self, data: st.DataObject, more: list[int]) -> None:
        request_id = data.draw(st.sampled_from(self.running()))
        tokens = self.tokens[request_id] + more
        got = self.cache.allocate(request_id, len(tokens))
        num_new = max(-(-len(tokens) // BS) - len(self.holders[request_id]), 0)
        if self.model_pop(num_new, got):
            self.holders[request_id] += ids(got or [])
            self.tokens[request_id] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def pin_blocks(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self.running()))
        self.pool.touch(self.cache.get_blocks(request_id))  # a second holder of its blocks
        self.holders[f"pin{self.serial}"] = list(self.holders[request_id])
        self.serial += 1

    @precondition(lambda self: any(h.startswith("pin") for h in self.holders))
    @rule(data=st.data())
    def unpin_blocks(self, data: st.DataObject) -> None:
        pins = sorted(h for h in self.holders if h.startswith("pin"))
        pin = data.draw(st.sampled_from(pins))
        self.pool.free_blocks([self.pool.blocks[b] for b in reversed(self.holders[pin])])
        self.model_free(pin)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free_request(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self.running()))
        self.cache.free(request_id)
        self.model_free(request_id)
        del self.tokens[request_id], self.num_cached[request_id]

    @rule(block_ids=st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=2))
    def evict(self, block_ids: list[int]) -> None:
        num_evicted = self.pool.evict_blocks(block_ids)
        assert num_evicted == sum(self.model_drop_hash(b) for b in block_ids)

    @rule()
    def reset(self) -> None:
        in_use = any(self.holders.values())
        assert self.pool.reset_prefix_cache() is not in_use
        if not in_use:
            self.hash_of.clear()
            self.by_hash.clear()

    @invariant()
    def matches_the_model(self) -> None:
        refs = self.refs()
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == refs[block.block_id] >= 0
            assert block.block_hash == self.hash_of.get(block.block_id)
        assert free_ids(self.pool) == self.queue  # also checks the links both ways
        assert set(self.queue) == {b for b in range(1, NUM_BLOCKS) if refs[b] == 0}
        assert self.pool.get_num_free_blocks() == len(self.queue)
        cached = sorted((h, b.block_id) for h, b in self.pool.cached_blocks.items())
        assert cached == sorted((h, b) for b, h in self.hash_of.items())
        null = self.pool.null_block
        assert null.ref_cnt == 0 and null.block_hash is None and refs[0] == 0


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, derandomize=True
)


# --- Against vLLM's own BlockPool -------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_block_pool() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
        except ImportError as exc:
            pytest.skip(f"vLLM not importable: {exc}")
    return VllmBlockPool


@pytest.mark.vllm
@pytest.mark.parametrize("seed", range(4))
def test_same_operations_as_vllm_block_pool(vllm_block_pool: Any, seed: int) -> None:
    rng = random.Random(seed)
    ours = BlockPool(NUM_BLOCKS)
    theirs = vllm_block_pool(NUM_BLOCKS, enable_caching=True, hash_block_size=BS)
    requests: dict[int, tuple[list[Block], list[Any]]] = {}
    for step in range(300):
        op = rng.random()
        if op < 0.45:
            tokens = [rng.randrange(3) for _ in range(rng.randint(1, 10))]
            hashes = block_hashes(tokens, NAMESPACE, BS)
            hit_ours: list[Block] = []
            hit_theirs: list[Any] = []
            for block_hash in hashes[: (len(tokens) - 1) // BS]:
                found = theirs.get_cached_block(block_hash, [0])
                assert (found is None) == (ours.get_cached_block(block_hash) is None)
                if found is None:
                    break
                hit_ours.append(ours.get_cached_block(block_hash))  # type: ignore[arg-type]
                hit_theirs.append(found[0])
            assert ids(hit_ours) == ids(hit_theirs)
            num_new = -(-len(tokens) // BS) - len(hit_ours)
            num_revived = sum(1 for b in hit_ours if b.ref_cnt == 0)
            if num_new + num_revived > ours.get_num_free_blocks():
                continue
            ours.touch(hit_ours)
            theirs.touch(hit_theirs)
            blocks_ours = hit_ours + (ours.get_new_blocks(num_new) or [])
            blocks_theirs = hit_theirs + theirs.get_new_blocks(num_new)
            assert ids(blocks_ours) == ids(blocks_theirs)
            num_full = len(tokens) // BS
            ours.cache_full_blocks(blocks_ours, hashes, len(hit_ours), num_full)
            request = types.SimpleNamespace(block_hashes=hashes)
            theirs.cache_full_blocks(request, blocks_theirs, len(hit_ours), num_full, BS, 0)
            requests[step] = (blocks_ours, blocks_theirs)
        elif op < 0.8 and requests:
            blocks_ours, blocks_theirs = requests.pop(rng.choice(sorted(requests)))
            ours.free_blocks(reversed(blocks_ours))
            theirs.free_blocks(reversed(blocks_theirs))
        elif op < 0.95:
            victims = {rng.randrange(NUM_BLOCKS) for _ in range(2)}
            ours.evict_blocks(victims)
            theirs.evict_blocks(victims)
        else:
            assert ours.reset_prefix_cache() == theirs.reset_prefix_cache()
        assert free_ids(ours) == ids(theirs.free_block_queue.get_all_free_blocks())
        assert [b.ref_cnt for b in ours.blocks[1:]] == [b.ref_cnt for b in theirs.blocks[1:]]
        assert [b.block_hash is None for b in ours.blocks] == [
            b.block_hash is None for b in theirs.blocks
        ]
