"""The fused copy kernels on a GPU: chosen where cupy is, and bit-exact against the torch
path for every page layout, chunk layout and dtype, partial chunks, layer-by-layer and
whole saves, pinned host slabs, device chunk buffers and a registered shared mapping
(what a sidecar client's pool is).

Skipped without CUDA or without cupy; ``benchmarks/gpu_check.py`` runs them.
"""

from __future__ import annotations

import mmap

import pytest
import torch

from lmtier.kv_spec import KVSpec
from lmtier_connector.device.kernels.cuda import kernels_unavailable
from lmtier_connector.device.paged_kv import PagedKVCache, paged_chunk_layout
from lmtier_connector.device.transfer import TransferEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

L, N, H, D, S = 4, 64, 8, 128, 16
RUNS, COUNTS = [[3, 9, 1, 40], [7, 8, 60], [20]], [64, 37, 5]  # full, partial, one token
DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn"]


def need_kernels() -> None:
    why = kernels_unavailable(torch.device("cuda"))
    if why is not None:
        pytest.skip(why)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def random_layers(spec: KVSpec, order: tuple[int, ...] | None) -> PagedKVCache:
    """Own allocation (order None) or vLLM's per-layer [N, H, S, C] views in ``order``."""
    dtype = getattr(torch, spec.dtype)
    if order is None:
        pages = PagedKVCache(spec, N, S, device="cuda")
        for i in range(L):
            bits(pages.layer(i)).random_()
        return pages
    logical = (L, N, spec.num_kv_heads, S, 2 * D)
    raw = torch.empty([logical[a] for a in order], device="cuda", dtype=dtype)
    bits(raw).random_()
    return PagedKVCache.from_tensors(spec, list(raw.permute(*[order.index(a) for a in range(5)])))


CASES = {  # name: (chunk layout or None for the paged one matching the pages, page order)
    "own LKTHD": ("LKTHD", None),
    "vllm HND page": (None, (0, 1, 2, 3, 4)),
    "vllm NHD page": (None, (1, 0, 3, 2, 4)),
    "vllm HND LKTHD": ("LKTHD", (1, 0, 2, 3, 4)),
}


def make(case: str, dtype: str) -> tuple[PagedKVCache, list[list[int]], list[int]]:
    layout, order = CASES[case]
    if layout is None:  # the connector's default: whole blocks in the pages' own order
        probe = torch.empty([(L, N, H, S, 2 * D)[a] for a in order], device="meta")
        layer = probe.permute(*[order.index(a) for a in range(5)])[0]
        spec = KVSpec(L, H, D, dtype, paged_chunk_layout(layer), block_size=S)
        return random_layers(spec, order), [r for r in RUNS if len(r) > 1][:2], [64, 48]
    return random_layers(KVSpec(L, H, D, dtype, layout), order), RUNS, COUNTS


def buffers(spec: KVSpec, counts: list[int], where: str) -> list[torch.Tensor]:
    dtype = getattr(torch, spec.dtype)
    if where == "device":
        return [torch.zeros(spec.shape(n), dtype=dtype, device="cuda") for n in counts]
    return [torch.zeros(spec.shape(n), dtype=dtype).pin_memory() for n in counts]


def test_the_kernels_are_chosen_where_cupy_is() -> None:
    need_kernels()
    engine = TransferEngine(PagedKVCache(KVSpec(2, 2, 64, "float16"), 8, 16, device="cuda"))
    assert engine.kernels


@pytest.mark.parametrize("where", ["pinned", "device"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_both_paths_save_and_load_the_same_bytes(case: str, dtype: str, where: str) -> None:
    need_kernels()
    pages, runs, counts = make(case, dtype)
    spec = pages.spec
    fused, plain = TransferEngine(pages, kernels=True), TransferEngine(pages, kernels=False)
    saved = {}
    for name, engine in (("fused", fused), ("plain", plain)):
        for layer_by_layer in (False, True):
            outs = buffers(spec, counts, where)
            save = engine.begin_save(runs, outs)
            if layer_by_layer:
                for layer in reversed(range(L)):
                    save.save_layer(layer)
            else:
                save.save_all()
            save.wait()
            saved[name, layer_by_layer] = [bits(out).cpu() for out in outs]
    reference = saved["plain", False]
    for key, outs in saved.items():
        assert all(torch.equal(a, b) for a, b in zip(outs, reference, strict=True)), key

    # Load those chunks elsewhere with each path: the same pages, untouched slots kept.
    sources = buffers(spec, counts, where)
    for source, data in zip(sources, reference, strict=True):
        bits(source).copy_(data)
    targets = [[b + 1 for b in run] for run in runs]  # distinct, other blocks
    before = [bits(pages.layer(i)).clone() for i in range(L)]
    landed = {}
    for name, engine in (("fused", fused), ("plain", plain)):
        for i in range(L):
            bits(pages.layer(i)).copy_(before[i])
        load = engine.start_load(sources, targets)
        load.synchronize()
        landed[name] = [bits(pages.layer(i)).clone() for i in range(L)]
    assert all(torch.equal(a, b) for a, b in zip(landed["fused"], landed["plain"], strict=True))


def test_the_kernels_read_and_write_a_registered_shared_mapping() -> None:
    """A sidecar client's pool is a shared mapping registered with cudaHostRegister, not
    memory torch pinned: the kernels address it in place."""
    need_kernels()
    pages, runs, counts = make("own LKTHD", "bfloat16")
    spec = pages.spec
    sizes = [spec.bytes_per_token * n for n in counts]
    mapping = mmap.mmap(-1, sum(sizes))
    region = torch.frombuffer(mapping, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(region.data_ptr(), region.numel(), 0)) == 0
    outs: list[torch.Tensor] = []
    try:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        outs = [
            region[start : start + size].view(torch.bfloat16).view(spec.shape(n))
            for start, size, n in zip(starts, sizes, counts, strict=True)
        ]
        assert all(out.is_pinned() for out in outs)
        save = TransferEngine(pages, kernels=True).begin_save(runs, outs)
        save.save_all()
        save.wait()
        expected = buffers(spec, counts, "pinned")
        plain = TransferEngine(pages, kernels=False).begin_save(runs, expected)
        plain.save_all()
        plain.wait()
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(outs, expected, strict=True))
    finally:
        outs.clear()
        cudart.cudaHostUnregister(region.data_ptr())
