"""The paged chunk layouts (LBHSC, LBSHC) in the transfer engine, on CPU: bit-exact
block copies for every vLLM 0.33 page order (KVCacheLayout) and both chunk layouts,
every dtype, consecutive and scattered block ids, both scatter mechanisms, every public
entry point, layer-by-layer saves, the checks that say what to configure, and LKTHD
still moving the same pages."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import pytest
import torch

from lmtier.chunks.format import decode
from lmtier.chunks.keys import ChunkKey
from lmtier.kv_spec import KVSpec, chunk_tensor, payload_tensor, seal_slab
from lmtier.storage.host_pool import HostPool
from lmtier_connector.device import page_copy, transfer
from lmtier_connector.device.paged_kv import PagedKVCache, paged_chunk_layout
from lmtier_connector.device.transfer import (
    TransferEngine,
    gather,
    load_chunk_from_slab,
    save_chunk_into_slab,
    scatter,
)
from support.kv_bits import randomize, same_bits

L, N, H, S, D = 3, 24, 2, 4, 8  # layers, blocks, KV heads, slots per block, head dim
DTYPES = ["float16", "bfloat16", "float32", "float8_e4m3fn"]

VLLM_ORDERS = {  # vllm.v1.kv_cache_layout.KVCacheLayout: physical order of [L, B, H, N, C]
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
HND = {"LBHNC", "LHBNC", "BLHNC", "BHLNC"}  # heads before slots: LBHSC's own order
RUNS = {  # name: (source ids, target ids), 3 blocks each
    "consecutive": ([4, 5, 6], [10, 11, 12]),
    "scattered": ([9, 2, 17], [0, 23, 13]),
}


def vllm_layers(order: tuple[int, ...], dtype: str = "float16") -> list[torch.Tensor]:
    """Per-layer [B, H, N, C] views of one raw buffer in the physical ``order``, as
    vllm.v1.worker.utils.allocate_kv_cache makes them (no padding)."""
    logical = (L, N, H, S, 2 * D)
    raw = torch.zeros([logical[axis] for axis in order], dtype=getattr(torch, dtype))
    randomize(raw, sum(order))
    return list(raw.permute(*[order.index(axis) for axis in range(5)]).unbind(0))


def spec_of(layout: str, dtype: str = "float16", block_size: int = S) -> KVSpec:
    return KVSpec(L, H, D, dtype, layout, block_size=block_size)


def reference(layers: list[torch.Tensor], layout: str, ids: list[int]) -> torch.Tensor:
    """The chunk of blocks ``ids``, built without the module: (L, B, H, S, C) or
    (L, B, S, H, C)."""
    chunk = torch.stack([layer[ids] for layer in layers])
    return chunk if layout == "LBHSC" else chunk.transpose(2, 3)


def index_copy_scatters(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scatter non-consecutive ids with index_copy_ (the CUDA mechanism) on CPU too."""

    def write(
        pages: torch.Tensor, ids: torch.Tensor, first: int | None, blocks: torch.Tensor
    ) -> None:
        if first is not None:
            page_copy.write_blocks(pages, ids, first, blocks)
        else:
            page_copy.index_copy_blocks(pages, ids, blocks)

    monkeypatch.setattr(transfer, "write_blocks", write)


@pytest.mark.parametrize("numpy", [True, False], ids=["numpy", "index_copy"])
@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("layout", ["LBHSC", "LBSHC"])
@pytest.mark.parametrize("order", list(VLLM_ORDERS))
def test_every_vllm_page_order_round_trips_bit_exactly(
    order: str, layout: str, run: str, numpy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not numpy:
        index_copy_scatters(monkeypatch)
    layers = vllm_layers(VLLM_ORDERS[order])
    pages = PagedKVCache.from_tensors(spec_of(layout), layers)
    assert (pages.layout, pages.block_size, pages.stacked_blocks is not None) == ("NHSC", S, True)
    src, dst = RUNS[run]
    chunk = torch.empty(spec_of(layout).shape(12), dtype=torch.float16)
    gather(pages, src, chunk)
    assert same_bits(chunk, reference(layers, layout, src))
    before = [layer.clone() for layer in layers]
    scatter(chunk, pages, dst)
    others = [b for b in range(N) if b not in dst]
    for layer, old in zip(layers, before, strict=True):
        assert same_bits(layer[dst], old[src])  # written through to vLLM's own views
        assert same_bits(layer[others], old[others])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["LBHSC", "LBSHC"])
def test_every_dtype_and_separate_layer_tensors(dtype: str, layout: str) -> None:
    """Layers that share no storage go layer by layer (no stacked view)."""
    spec = spec_of(layout, dtype)
    layers = [randomize(torch.empty(N, H, S, 2 * D, dtype=spec_dtype(dtype)), i) for i in range(L)]
    pages = PagedKVCache.from_tensors(spec, layers)
    assert pages.stacked_blocks is None
    for src, dst in RUNS.values():
        chunk = torch.empty(spec.shape(12), dtype=spec_dtype(dtype))
        gather(pages, src, chunk)
        assert same_bits(chunk, reference(layers, layout, src))
        scatter(chunk, pages, dst)
        assert all(same_bits(layer[dst], layer[src]) for layer in layers)


def spec_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


@pytest.mark.parametrize("layout", ["LBHSC", "LBSHC"])
def test_own_allocation_stores_blocks_in_the_chunk_order(layout: str) -> None:
    spec = spec_of(layout, "bfloat16")
    pages = PagedKVCache(spec, N)  # block_size from the spec
    assert (pages.layout, pages.block_size) == ("NHSC", S)
    stacked = pages.stacked_blocks
    assert stacked is not None and stacked.is_contiguous()  # every block one row of bytes
    assert paged_chunk_layout(pages.layer(0)) == layout
    randomize(stacked, 3)
    chunk = torch.empty(spec.shape(8), dtype=torch.bfloat16)
    gather(pages, [20, 3], chunk)
    assert same_bits(chunk, reference([pages.layer(i) for i in range(L)], layout, [20, 3]))


@pytest.mark.parametrize("order", list(VLLM_ORDERS))
def test_paged_chunk_layout_names_the_pages_own_order(order: str) -> None:
    expected = "LBHSC" if order in HND else "LBSHC"
    assert paged_chunk_layout(vllm_layers(VLLM_ORDERS[order])[0]) == expected


def test_the_engine_says_what_to_configure() -> None:
    layers = vllm_layers(VLLM_ORDERS["BLHNC"])
    with pytest.raises(ValueError, match=r"KVSpec\(block_size=4\)"):
        PagedKVCache.from_tensors(spec_of("LBHSC", block_size=8), layers)
    with pytest.raises(ValueError, match=r"blocks of 16 slots.*KVSpec\(block_size=16\)"):
        PagedKVCache(spec_of("LBHSC"), N, block_size=16)
    flash = [torch.zeros(2, N, S, H, D, dtype=torch.float16) for _ in range(L)]
    with pytest.raises(ValueError, match="configure the chunk layout LKTHD"):
        PagedKVCache.from_tensors(spec_of("LBSHC"), flash)
    pages = PagedKVCache.from_tensors(spec_of("LBHSC"), layers)
    with pytest.raises(ValueError, match="these pages need"):
        gather(pages, [1], torch.empty(spec_of("LBSHC").shape(4), dtype=torch.float16))
    with pytest.raises(ValueError, match="these pages need"):
        gather(pages, [1], torch.empty(spec_of("LBHSC").shape(4), dtype=torch.float32))
    with pytest.raises(ValueError, match="fill 2 blocks"):
        gather(pages, [1, 2, 3], torch.empty(spec_of("LBHSC").shape(8), dtype=torch.float16))
    with pytest.raises(ValueError, match="repeats"):
        scatter(torch.zeros(spec_of("LBHSC").shape(8), dtype=torch.float16), pages, [5, 5])
    lkthd = PagedKVCache.from_tensors(KVSpec(L, H, D, "float16"), layers)
    with pytest.raises(ValueError, match="paged chunk layouts"):
        lkthd.blocks(0)


def test_lkthd_still_moves_the_same_pages() -> None:
    """The same vLLM tensors under a token layout: the same KV, in token order."""
    layers = vllm_layers(VLLM_ORDERS["BLHNC"])
    paged = PagedKVCache.from_tensors(spec_of("LBHSC"), layers)
    tokens = PagedKVCache.from_tensors(KVSpec(L, H, D, "float16"), layers)
    blocks = torch.empty(spec_of("LBHSC").shape(12), dtype=torch.float16)
    gather(paged, [9, 2, 17], blocks)
    by_token = torch.empty(KVSpec(L, H, D, "float16").shape(10), dtype=torch.float16)
    gather(tokens, [9, 2, 17], by_token)  # a partial chunk: 10 of 12 slots
    as_tokens = blocks.view(L, 3, H, S, 2, D).permute(0, 4, 1, 3, 2, 5).reshape(L, 2, 12, H, D)
    assert same_bits(by_token, as_tokens[:, :, :10])


# --- the engine's entry points -------------------------------------------------------------


@pytest.mark.parametrize("layout", ["LBHSC", "LBSHC"])
def test_slabs_encode_and_load_back(layout: str) -> None:
    spec = spec_of(layout, "bfloat16")
    layers = vllm_layers(VLLM_ORDERS["BLNHC"], "bfloat16")
    pages = PagedKVCache.from_tensors(spec, layers)
    pool = HostPool(spec.encoded_chunk_bytes(12), 1, pin=False)
    handle = pool.acquire()
    assert handle is not None
    meta = dataclasses.replace(spec.meta(ChunkKey(bytes(range(32))), 12), created=2.0)
    length = save_chunk_into_slab(pages, [9, 2, 17], handle, meta)
    chunk = decode(handle.view[:length])  # both checksums
    assert chunk.meta == meta
    assert same_bits(chunk_tensor(chunk), reference(layers, layout, [9, 2, 17]))
    load_chunk_from_slab(chunk, pages, [0, 1, 2])  # block 2 was a source: overwritten
    assert same_bits(reference(layers, layout, [0, 1, 2]), chunk_tensor(chunk))
    handle.release()
    pool.close()


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("layout", ["LBHSC", "LBSHC"])
def test_layerwise_saves_equal_whole_saves_and_loads_land(layout: str, stacked: bool) -> None:
    spec = spec_of(layout)
    if stacked:
        layers = vllm_layers(VLLM_ORDERS["LBHNC" if layout == "LBHSC" else "LBNHC"])
    else:
        layers = [randomize(torch.empty(N, H, S, 2 * D, dtype=torch.float16), i) for i in range(L)]
    pages = PagedKVCache.from_tensors(spec, layers)
    assert (pages.stacked_blocks is not None) == stacked
    engine = TransferEngine(pages)
    runs = [[4, 8], [15, 16, 17]]
    outs = [torch.zeros(spec.shape(n), dtype=torch.float16) for n in (8, 12)]
    handle = engine.begin_save(runs, outs)
    handle.save_layer(2)
    handle.save_layer(0)
    assert handle.pending_layers == [1] and not bool(outs[0][1].any())
    handle.save_all()
    handle.wait()
    assert handle.done()
    whole = [torch.zeros_like(out) for out in outs]
    whole_save = engine.begin_save(runs, whole)  # every layer at once, in one save_all
    whole_save.save_all()
    whole_save.wait()
    for run, out, again in zip(runs, outs, whole, strict=True):
        assert same_bits(out, reference(layers, layout, run))
        assert same_bits(again, out)

    targets = [[20, 0], [1, 2, 3]]
    load = engine.start_load(outs, targets)
    assert load.done() and load.events == ()
    load.wait()
    for target, run in zip(targets, runs, strict=True):
        assert all(same_bits(layer[target], layer[run]) for layer in layers)


def test_cuda_branches_move_paged_chunks_layer_by_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA code paths, run on CPU tensors with stand-in streams and events: per layer
    one scatter (H2D, then blocks) per chunk on load; one gather per chunk on save."""
    calls: list[str] = []

    class Stream:
        def wait_stream(self, other: object) -> None:
            calls.append("wait")

        def wait_event(self, event: object) -> None:
            calls.append("wait_event")

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            pass

        def record(self, stream: object) -> None:
            calls.append("record")

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            calls.append("sync")

    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    for name in ("_scatter_run", "_gather_run"):
        original = getattr(transfer, name)

        def traced(
            *args: object, non_blocking: bool, fn: Callable[..., None] = original, what: str = name
        ) -> None:
            assert non_blocking
            calls.append(what)
            fn(*args, non_blocking=non_blocking)

        monkeypatch.setattr(transfer, name, traced)

    spec = spec_of("LBSHC")
    layers = vllm_layers(VLLM_ORDERS["BLNHC"])
    pages = PagedKVCache.from_tensors(spec, layers)
    engine = TransferEngine(pages)
    engine._load_stream = engine._save_stream = Stream()  # type: ignore[assignment]
    chunks = [reference(layers, "LBSHC", [1, 2]), reference(layers, "LBSHC", [7, 3])]
    load = engine.start_load(chunks, [[10, 11], [20, 5]])
    load.wait()
    assert calls == ["wait"] + ["_scatter_run", "_scatter_run", "record"] * L + ["wait_event"]
    assert all(same_bits(layer[[10, 11, 20, 5]], layer[[1, 2, 7, 3]]) for layer in layers)
    calls.clear()
    outs = [torch.zeros_like(chunk) for chunk in chunks]
    save = engine.begin_save([[10, 11], [20, 5]], outs)
    save.save_all()
    save.wait()
    assert calls == ["wait", "_gather_run", "_gather_run", "record"] * L + ["sync"]
    assert all(same_bits(a, b) for a, b in zip(outs, chunks, strict=True))


def test_the_vllm_allocator_builds_what_these_tests_build() -> None:
    """vLLM's own allocate_kv_cache, for each KVCacheLayout, makes the views the tests
    above replicate; the engine moves blocks between them bit-exactly."""
    layout_module = pytest.importorskip("vllm.v1.kv_cache_layout")
    interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    utils = pytest.importorskip("vllm.v1.worker.utils")
    names = [f"layers.{i}" for i in range(L)]
    spec = interface.FullAttentionSpec(
        block_size=S, num_kv_heads=H, head_size=D, dtype=torch.float16
    )
    for member in layout_module.KVCacheLayout:
        layer_stride, block_stride, *_ = interface.compute_layout_strides(spec, N, L, member)
        tensor = interface.KVCacheTensor(
            size=spec.page_size_bytes * N * L,
            layers=names,
            layer_stride=layer_stride,
            block_stride=block_stride,
        )
        config = interface.KVCacheConfig(
            num_blocks=N,
            kv_cache_tensors=[tensor],
            kv_cache_groups=[interface.KVCacheGroupSpec(names, spec)],
        )
        views = utils.allocate_kv_cache(config, torch.device("cpu"), member)
        layers = [views[name] for name in names]
        mine = vllm_layers(VLLM_ORDERS[member.name])
        assert [t.stride() for t in layers] == [t.stride() for t in mine], member.name
        for t in layers:
            randomize(t, 7)
        chunk_layout = paged_chunk_layout(layers[0])
        pages = PagedKVCache.from_tensors(spec_of(chunk_layout), layers)
        payload = torch.empty(spec_of(chunk_layout).shape(12), dtype=torch.float16)
        gather(pages, [9, 2, 17], payload)
        assert same_bits(payload, reference(layers, chunk_layout, [9, 2, 17]))
        scatter(payload, pages, [0, 1, 2])
        assert same_bits(reference(layers, chunk_layout, [0, 1, 2]), payload)


def test_a_slab_payload_is_a_layer_major_paged_chunk() -> None:
    """What the CUDA path copies per layer (one H2D/D2H each) is contiguous in a slab."""
    spec = spec_of("LBHSC")
    pool = HostPool(spec.encoded_chunk_bytes(16), 1, pin=False)
    handle = pool.acquire()
    assert handle is not None
    payload = payload_tensor(handle, spec.meta(ChunkKey(bytes(32)), 16))
    assert payload.shape == (L, 4, H, S, 2 * D)
    assert all(payload[i].is_contiguous() for i in range(L))
    pages = PagedKVCache.from_tensors(spec, vllm_layers(VLLM_ORDERS["BHLNC"]))
    gather(pages, [3, 1, 4, 15], payload)
    assert seal_slab(handle, spec.meta(ChunkKey(bytes(32)), 16)) > payload.numel()
    handle.release()
    pool.close()
