"""The transfer engine's CUDA paths: side streams, per-layer events, pinned slabs,
non_blocking copies, layer-wise overlap, and saves that never wait for the host.

Skipped without CUDA; ``benchmarks/gpu_check.py`` runs them on a GPU machine.
"""

from __future__ import annotations

import time

import pytest
import torch

from lmtier.chunks.format import decode
from lmtier.chunks.keys import ChunkKey
from lmtier.kv_spec import KVSpec, chunk_tensor, payload_tensor, seal_slab
from lmtier.storage.host_pool import HostPool, SlabHandle
from lmtier_connector.device.paged_kv import PagedKVCache
from lmtier_connector.device.transfer import TransferEngine, gather

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

KEY = ChunkKey(bytes(32))


def random_pages(spec: KVSpec, num_blocks: int, block_size: int = 16) -> PagedKVCache:
    pages = PagedKVCache(spec, num_blocks, block_size, device="cuda")
    assert pages.stacked is not None
    pages.stacked.copy_(torch.randn(pages.stacked.shape, device="cuda"))
    return pages


def host_copy(pages: PagedKVCache, ids: list[int], num_tokens: int) -> torch.Tensor:
    out = torch.empty(pages.spec.shape(num_tokens), dtype=pages.dtype)
    gather(pages, ids, out)  # the synchronous path, as the reference
    return out


def slabs(spec: KVSpec, count: int, chunk_tokens: int) -> tuple[HostPool, list[SlabHandle]]:
    pool = HostPool(spec.encoded_chunk_bytes(chunk_tokens), count, pin=True)
    leases = [pool.acquire() for _ in range(count)]
    handles = [handle for handle in leases if handle is not None]
    assert pool.pinned and len(handles) == count
    return pool, handles


def close(pool: HostPool, handles: list[SlabHandle]) -> None:
    for handle in handles:
        handle.release()
    pool.close()


def test_async_save_then_load_round_trip_through_pinned_slabs() -> None:
    spec = KVSpec(4, 8, 128, "bfloat16")
    pages = random_pages(spec, 64)
    engine = TransferEngine(pages)
    runs, counts = [[3, 9, 1, 40], [7, 8, 60]], [64, 37]  # a full chunk and a partial one
    pool, handles = slabs(spec, 2, 64)
    metas = [spec.meta(KEY, n) for n in counts]
    outs = [payload_tensor(h, m) for h, m in zip(handles, metas, strict=True)]
    assert all(out.is_pinned() for out in outs)

    save = engine.begin_save(runs, outs)
    save.save_all()
    save.wait()
    assert save.done()
    chunks = [decode(h.view[: seal_slab(h, m)]) for h, m in zip(handles, metas, strict=True)]
    for chunk, run, n in zip(chunks, runs, counts, strict=True):
        assert torch.equal(chunk_tensor(chunk), host_copy(pages, run, n))

    target = PagedKVCache(spec, 64, 16, device="cuda")
    new_runs = [[10, 11, 12, 13], [0, 63, 5]]
    load = engine_for(target).start_load(chunks, new_runs)
    load.wait()  # the current stream waits; host reads below are ordered after it
    for chunk, run, n in zip(chunks, new_runs, counts, strict=True):
        assert torch.equal(host_copy(target, run, n), chunk_tensor(chunk))
    assert load.done() and len(load.events) == spec.num_layers
    close(pool, handles)


def engine_for(pages: PagedKVCache) -> TransferEngine:
    return TransferEngine(pages, timing=True)


def test_wait_layer_in_any_order_orders_compute_after_that_layer() -> None:
    spec = KVSpec(6, 8, 128, "float16")
    source = random_pages(spec, 32)
    pool, handles = slabs(spec, 1, 256)
    meta = spec.meta(KEY, 256)
    run = list(range(16))
    gather(source, run, payload_tensor(handles[0], meta))
    pages = PagedKVCache(spec, 32, 16, device="cuda")
    load = engine_for(pages).start_load([payload_tensor(handles[0], meta)], [run[::-1]])
    for layer in (5, 0, 3, 1, 4, 2):
        load.wait_layer(layer)  # reads below are ordered after that layer's copies
        assert torch.equal(pages.layer(layer)[:, run[::-1]], source.layer(layer)[:, run])
    close(pool, handles)


def test_layer_zero_is_usable_before_the_last_layer_lands() -> None:
    spec = KVSpec(8, 8, 128, "bfloat16")  # 32 MiB per layer for 8192 tokens
    num_tokens = 8192
    pages = PagedKVCache(spec, num_tokens // 16, 16, device="cuda")
    pool, handles = slabs(spec, 1, num_tokens)
    payload = payload_tensor(handles[0], spec.meta(KEY, num_tokens))
    payload.fill_(1.0)
    compute = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    load = engine_for(pages).start_load([payload], [list(range(num_tokens // 16))])
    started = []
    for layer in range(spec.num_layers):
        load.wait_layer(layer)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        started.append(event)
        compute = compute @ compute.T / 4096
    torch.cuda.synchronize()
    # Layer i's compute starts after layer i landed; layer 0's before the last layer landed.
    for layer, event in enumerate(started):
        assert load.events[layer].elapsed_time(event) > -1e-3  # ms; timer resolution
    assert started[0].elapsed_time(load.events[-1]) > 0
    close(pool, handles)


def test_saves_do_not_block_the_host_and_wait_for_compute() -> None:
    spec = KVSpec(4, 8, 128, "bfloat16")
    pages = random_pages(spec, 64)
    pool, handles = slabs(spec, 1, 256)
    out = payload_tensor(handles[0], spec.meta(KEY, 256))
    engine = TransferEngine(pages)
    warm_up = engine.begin_save([list(range(16))], [out])  # kernels and allocations
    warm_up.save_all()
    warm_up.wait()
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    for _ in range(20):  # tens of ms of work on the compute stream
        busy = busy @ busy / 8192
    begin = time.perf_counter()
    save = engine.begin_save([list(range(16))], [out])
    save.save_all()
    enqueue_s = time.perf_counter() - begin
    assert not save.done()  # the save stream waits for the compute enqueued before it
    save.wait()
    assert enqueue_s < 0.05
    assert torch.equal(out, host_copy(pages, list(range(16)), 256))
    close(pool, handles)


def test_async_paths_refuse_pageable_or_non_layer_major_host_chunks() -> None:
    spec = KVSpec(2, 4, 64, "float16")
    engine = TransferEngine(PagedKVCache(spec, 8, 16, device="cuda"))
    pageable = torch.empty(spec.shape(16), dtype=torch.float16)
    with pytest.raises(ValueError, match="pinned"):
        engine.start_load([pageable], [[0]])
    kv_first = KVSpec(2, 4, 64, "float16", "KLTHD")
    engine = TransferEngine(PagedKVCache(kv_first, 8, 16, device="cuda"))
    pinned = torch.empty(kv_first.shape(16), dtype=torch.float16).pin_memory()
    with pytest.raises(ValueError, match="layer-major"):
        engine.begin_save([[0]], [pinned])


# --- paged chunk layouts (LBHSC, LBSHC): block copies between vLLM pages and slabs --------

VLLM_ORDERS = {"BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4)}


def vllm_pages(order: str, layout: str, num_blocks: int = 64) -> PagedKVCache:
    """Random per-layer [B, H, N, C] bf16 CUDA views of one buffer in vLLM's ``order``,
    wrapped for the paged chunk ``layout`` (4 layers, 8 heads, 128 head dim, block 16)."""
    spec = KVSpec(4, 8, 128, "bfloat16", layout, block_size=16)
    logical = (4, num_blocks, 8, 16, 256)
    physical = VLLM_ORDERS[order]
    raw = torch.randn([logical[a] for a in physical], device="cuda").to(torch.bfloat16)
    layers = raw.permute(*[physical.index(a) for a in range(5)]).unbind(0)
    return PagedKVCache.from_tensors(spec, list(layers))


@pytest.mark.parametrize(
    ("order", "layout"), [("BLHNC", "LBHSC"), ("BLNHC", "LBSHC"), ("LHBNC", "LBHSC")]
)
def test_paged_chunks_round_trip_through_pinned_slabs(order: str, layout: str) -> None:
    pages = vllm_pages(order, layout)
    spec = pages.spec
    engine = TransferEngine(pages)
    runs = [[3, 9, 1, 40], [7, 8, 9, 10]]  # scattered, consecutive: 64 tokens each
    pool, handles = slabs(spec, 2, 64)
    metas = [spec.meta(KEY, 64)] * 2
    outs = [payload_tensor(h, m) for h, m in zip(handles, metas, strict=True)]
    save = engine.begin_save(runs, outs)
    for layer in range(spec.num_layers):
        save.save_layer(layer)
    save.wait()
    chunks = [decode(h.view[: seal_slab(h, m)]) for h, m in zip(handles, metas, strict=True)]
    for chunk, run in zip(chunks, runs, strict=True):
        expected = torch.stack([pages.blocks(i)[run] for i in range(spec.num_layers)])
        assert torch.equal(chunk_tensor(chunk), expected.cpu())
        assert torch.equal(chunk_tensor(chunk), host_copy(pages, run, 64))

    target = vllm_pages(order, layout)
    new_runs = [[10, 11, 12, 13], [0, 63, 5, 6]]
    load = engine_for(target).start_load(chunks, new_runs)
    for layer in reversed(range(spec.num_layers)):
        load.wait_layer(layer)
        for chunk, run in zip(chunks, new_runs, strict=True):
            assert torch.equal(target.blocks(layer)[run].cpu(), chunk_tensor(chunk)[layer])
    assert load.done() and len(load.events) == spec.num_layers
    close(pool, handles)


def test_paged_saves_wait_for_compute_and_refuse_pageable_chunks() -> None:
    pages = vllm_pages("BLHNC", "LBHSC")
    spec = pages.spec
    pool, handles = slabs(spec, 1, 256)
    out = payload_tensor(handles[0], spec.meta(KEY, 256))
    engine = TransferEngine(pages)
    warm_up = engine.begin_save([list(range(16))], [out])  # kernels and allocations
    warm_up.save_all()
    warm_up.wait()
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    for _ in range(20):
        busy = busy @ busy / 8192
    save = engine.begin_save([list(range(16))], [out])
    save.save_all()
    assert not save.done()
    save.wait()
    assert torch.equal(out, host_copy(pages, list(range(16)), 256))
    with pytest.raises(ValueError, match="pinned"):
        engine.start_load([torch.empty(spec.shape(16), dtype=torch.bfloat16)], [[0]])
    close(pool, handles)
