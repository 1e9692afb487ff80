"""lmtier's tier events in vLLM's wire format (lmtier.events.wire), read back by
vLLM's own decoder: named chunks as vLLM's blocks (runs joined where each chunk
continues the last, with the parent of the run's first), unnamed ones under their
keys, integer hashes as vLLM makes them."""

from __future__ import annotations

import pytest

from lmtier.chunks.keys import ChunkKey
from lmtier.events.wire import all_cleared, encode_batch, vllm_events
from lmtier.storage.events import ChunkName, TierEvent
from lmtier.testing import random_key

kv_events = pytest.importorskip("vllm.distributed.kv_events")
msgspec = pytest.importorskip("msgspec")
DECODER = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
CHUNK = 64  # four blocks of 16


def block(n: int) -> bytes:
    return n.to_bytes(32, "big")


def names(keys: list[ChunkKey], first: int = 0) -> dict[ChunkKey, ChunkName]:
    out: dict[ChunkKey, ChunkName] = {}
    for j, key in enumerate(keys):
        blocks = tuple(block(first + 4 * j + b) for b in range(4))
        out[key] = (block(first + 4 * j - 1) if first + j else None, blocks)
    return out


def decode(events: list[dict[str, object]]) -> list[object]:
    batch = DECODER.decode(encode_batch(1.5, events, 3))
    assert batch.ts == 1.5 and batch.data_parallel_rank == 3
    return list(batch.events)


def test_named_chunks_are_vllms_blocks_and_the_others_their_keys() -> None:
    keys = [random_key() for _ in range(3)]
    stranger = random_key()
    table = names(keys)
    out, cleared = vllm_events(
        [TierEvent("stored", "disk", (*keys[:2], stranger, keys[2]))], CHUNK, table.get
    )
    assert not cleared
    first, alone, last = decode(out)
    assert first.block_hashes == [block(n) for n in range(8)] and first.parent_block_hash is None
    assert first.block_size == 16 and first.medium == "DISK" and first.token_ids == []
    assert alone.block_hashes == [bytes(stranger)] and alone.block_size == CHUNK
    assert last.block_hashes == [block(n) for n in range(8, 12)]
    assert last.parent_block_hash == block(7), "a new run names the block before it"


def test_removals_clears_and_integers() -> None:
    keys = [random_key() for _ in range(2)]
    table = names(keys, first=4)
    out, cleared = vllm_events(
        [TierEvent("removed", "cpu", tuple(keys)), TierEvent("cleared", "redis", namespace=b"x")],
        CHUNK,
        table.get,
        int_hashes=True,
    )
    assert cleared
    (gone,) = decode(out)
    assert isinstance(gone, kv_events.BlockRemoved) and gone.medium == "CPU"
    assert gone.block_hashes == list(range(4, 12)), "the low 64 bits, as integers"
    assert isinstance(decode([all_cleared()])[0], kv_events.AllBlocksCleared)
