"""LoadResult.kv: the copy out of slabs, whatever order and spacing the slabs have."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from lmtier import KVSpec
from lmtier.chunks.format import decode
from lmtier.errors import InvalidKVError
from lmtier.kv_spec import encode_kv_into
from lmtier.results import LoadResult
from lmtier.storage.host_pool import HostPool
from lmtier.storage.lookup import LoadedChunk
from lmtier.testing import random_key

CHUNK = 16
SPECS = [
    KVSpec(num_layers=2, num_kv_heads=2, head_dim=8),
    KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", layout="KLTHD"),
    KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", layout="KTLHD"),
    KVSpec(num_layers=3, num_kv_heads=1, head_dim=8, layout="LTD"),
    KVSpec(num_layers=3, num_kv_heads=1, head_dim=4, layout="TLD"),
    KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, layout="LBHSC", block_size=4),
]
ORDERS = {
    "adjacent": [0, 1, 2, 3, 4, 5],  # one run: one copy
    "spaced": [1, 3, 5, 7, 9, 11],  # one run, every other slab
    "descending": [5, 4, 3, 2, 1, 0],  # no run: a copy per chunk
    "mixed": [0, 1, 2, 7, 6, 9, 11, 13, 3],  # runs of 3, 1, 1 and 3 chunks, then 1
}


@pytest.fixture
def pool() -> Iterator[HostPool]:
    opened = HostPool(KVSpec(3, 2, 8).encoded_chunk_bytes(CHUNK), 16, pin=False)
    yield opened
    opened.close()


def load_into(pool: HostPool, spec: KVSpec, kv: torch.Tensor, slabs: list[int]) -> LoadResult:
    """A LoadResult of ``kv``'s chunks, chunk i in slab ``slabs[i]``."""
    taken = {}
    while len(taken) < pool.num_slabs:
        handle = pool.acquire()
        assert handle is not None
        taken[handle.index] = handle
    chunks = []
    for i, index in enumerate(slabs):
        handle = taken.pop(index)
        key = random_key()
        meta = spec.meta(key, CHUNK)
        size = encode_kv_into(handle, meta, spec.narrow_tokens(kv, i * CHUNK, CHUNK))
        chunks.append(LoadedChunk(key, "cpu", decode(handle.view[:size]), handle))
    for handle in taken.values():
        handle.release()
    return LoadResult(chunks, CHUNK, spec)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.layout}-{s.dtype}")
def test_kv_is_the_chunks_in_order_whatever_slabs_hold_them(
    pool: HostPool, spec: KVSpec, order: str
) -> None:
    slabs = ORDERS[order]
    tokens = len(slabs) * CHUNK
    kv = torch.randn(spec.shape(tokens)).to(getattr(torch, spec.dtype))
    with load_into(pool, spec, kv, slabs) as loaded:
        assert torch.equal(loaded.kv(), kv)
        into = torch.full(spec.shape(tokens), -1.0, dtype=kv.dtype)
        assert loaded.kv(out=into) is into
        assert torch.equal(into, kv)
    assert pool.num_free == pool.num_slabs


def test_kv_writes_into_a_strided_out(pool: HostPool) -> None:
    spec = SPECS[0]
    kv = torch.randn(spec.shape(4 * CHUNK))
    # The same shape with the token axis outermost in memory: no axis is contiguous
    # the way a chunk's is.
    into = torch.empty(spec.shape(4 * CHUNK)).transpose(0, 2).contiguous().transpose(0, 2)
    with load_into(pool, spec, kv, [2, 3, 4, 6]) as loaded:
        loaded.kv(out=into)
    assert torch.equal(into, kv)


def test_kv_refuses_an_out_of_another_shape(pool: HostPool) -> None:
    spec = SPECS[0]
    kv = torch.randn(spec.shape(2 * CHUNK))
    with load_into(pool, spec, kv, [0, 1]) as loaded:
        for wrong in (spec.shape(CHUNK), spec.shape(3 * CHUNK)):
            with pytest.raises(InvalidKVError, match="out has shape"):
                loaded.kv(out=torch.empty(wrong))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.layout}-{s.dtype}")
def test_copy_to_puts_each_chunk_in_its_own_target_whatever_its_strides(
    pool: HostPool, spec: KVSpec
) -> None:
    kv = torch.randn(spec.shape(3 * CHUNK)).to(getattr(torch, spec.dtype))
    chunk = spec.shape(CHUNK)
    # pages apart and strided, as in an engine's host pool: chunk i in a transposed view
    pages = [torch.full(chunk[::-1], -1.0, dtype=kv.dtype).permute(*range(len(chunk))[::-1])]
    pages += [torch.zeros(chunk, dtype=kv.dtype) for _ in range(3)]
    with load_into(pool, spec, kv, [5, 1, 3]) as loaded:
        assert loaded.copy_to(pages) == 3  # four targets, three chunks
        assert loaded.copy_to(pages[:2]) == 2  # two targets
        for i in range(3):
            assert torch.equal(pages[i], spec.narrow_tokens(kv, i * CHUNK, CHUNK))
        assert torch.count_nonzero(pages[3]) == 0  # no chunk for it: untouched
        with pytest.raises(InvalidKVError, match="target 1 has shape"):
            loaded.copy_to([pages[0], torch.empty(spec.shape(2 * CHUNK), dtype=kv.dtype)])
    assert pool.num_free == pool.num_slabs
