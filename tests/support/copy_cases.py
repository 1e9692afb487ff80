"""Random transfers for the fused copy kernels' tests: pages in every layout, runs of
random blocks, partial chunks; and the check that a plan's launches save and load what
the torch path does, bit for bit (tests/unit/connector/test_copy_plans.py runs the CPU
reference, tests/integration/connector/test_copy_kernels.py the CUDA source as C++)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from lmtier.kv_spec import KVSpec
from lmtier_connector.device.kernels.plan import CopyPlan, plan_copy
from lmtier_connector.device.paged_kv import PagedKVCache
from lmtier_connector.device.transfer import gather, scatter
from support.kv_bits import bits, randomize

L, N, H, D = 3, 20, 2, 8  # layers, blocks, KV heads, head dim
DTYPES = ["float32", "float16", "bfloat16", "int8", "float8_e4m3fn"]
VLLM_ORDERS = [(0, 1, 2, 3, 4), (0, 1, 3, 2, 4), (0, 2, 1, 3, 4), (1, 0, 2, 3, 4), (1, 0, 3, 2, 4)]
PAGES = ["own", "nhsc", "separate", "nkshd"]
MANY = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
FEW = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


def make_pages(data: st.DataObject, spec: KVSpec, block_size: int) -> PagedKVCache:
    """Random pages of ``spec`` in a drawn layout, filled with random bits."""
    kind = data.draw(st.sampled_from(["own", "nhsc"] if spec.paged else PAGES), label="pages")
    dtype = getattr(torch, spec.dtype)
    if spec.latent:
        shape = (N, block_size, D) if kind == "own" else (N, 1, block_size, D)
        layers = [torch.empty(shape, dtype=dtype) for _ in range(L)]
    elif kind == "own":
        pages = PagedKVCache(spec, N, block_size)
        for i in range(L):
            randomize(pages.layer(i), i)
        return pages
    elif kind == "nhsc":
        order = data.draw(st.sampled_from(VLLM_ORDERS), label="order")
        logical = (L, N, H, block_size, 2 * D)
        raw = torch.empty([logical[axis] for axis in order], dtype=dtype)
        layers = list(raw.permute(*[order.index(axis) for axis in range(5)]).unbind(0))
    elif kind == "separate":
        layers = [torch.empty(2, N, block_size, H, D, dtype=dtype) for _ in range(L)]
    else:
        layers = list(torch.empty(L, N, 2, block_size, H, D, dtype=dtype).unbind(0))
    for i, layer in enumerate(layers):
        randomize(layer, 10 + i)
    return PagedKVCache.from_tensors(spec, layers, block_size=block_size)


Case = tuple[PagedKVCache, list[list[int]], list[int], list[torch.Tensor]]


def make_case(data: st.DataObject) -> Case:
    """Pages, 1-3 disjoint runs of random blocks, their token counts, empty chunks."""
    layouts = ["LKTHD", "KLTHD", "KTLHD", "LTD", "TLD", "LBHSC", "LBSHC"]
    layout = data.draw(st.sampled_from(layouts), label="layout")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    block_size = data.draw(st.sampled_from([1, 2, 4, 16]), label="block_size")
    paged = layout in ("LBHSC", "LBSHC")
    heads = 1 if layout in ("LTD", "TLD") else H
    spec = KVSpec(L, heads, D, dtype, layout, block_size=block_size * paged)
    pages = make_pages(data, spec, block_size)
    free = data.draw(st.permutations(range(N)), label="blocks")
    runs, counts = [], []
    for _ in range(data.draw(st.integers(1, 3), label="chunks")):
        most = min(len(free) * block_size, 40)
        if most < block_size:
            break
        tokens = data.draw(st.integers(1, most), label="tokens")
        if paged:
            tokens = max(block_size, tokens // block_size * block_size)
        need = -(-tokens // block_size)
        runs.append(free[:need])
        free = free[need:]
        counts.append(tokens)
    chunks = [torch.zeros(spec.shape(n), dtype=getattr(torch, dtype)) for n in counts]
    return pages, runs, counts, chunks


def planned(
    pages: PagedKVCache, runs: list[list[int]], counts: list[int], chunks: list
) -> CopyPlan:
    plan = plan_copy(pages, runs, counts, [pages.chunk_view(c) for c in chunks])
    assert isinstance(plan, CopyPlan), plan
    return plan


def page_bits(pages: PagedKVCache) -> list[torch.Tensor]:
    return [bits(pages.layer(i)).clone() for i in range(L)]


def restore(pages: PagedKVCache, saved: list[torch.Tensor]) -> None:
    for i, old in enumerate(saved):
        bits(pages.layer(i)).copy_(old)


Runner = Callable[..., None]
"""``run(plan, tensors, save=, layer0=, num_layers=)``: one launch's work; ``tensors``
are every CPU tensor its addresses point into."""


def check_against_torch(case: Case, run: Runner, layer_by_layer: bool) -> None:
    """The plans save and load what torch's gather and scatter do, bit for bit."""
    pages, runs, counts, chunks = case
    expected = [torch.zeros_like(c) for c in chunks]
    for ids, out in zip(runs, expected, strict=True):
        gather(pages, ids, out)
    sources = [randomize(torch.empty_like(c), 99 + j) for j, c in enumerate(chunks)]
    tensors = [*(pages.layer(i) for i in range(L)), *chunks, *sources]
    spans = [(layer, 1) for layer in range(L)] if layer_by_layer else [(0, L)]

    plan = planned(pages, runs, counts, chunks)
    for layer0, count in spans:
        run(plan, tensors, save=True, layer0=layer0, num_layers=count)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(chunks, expected, strict=True))

    before = page_bits(pages)  # load fresh chunks into the same runs: against scatter
    for ids, chunk in zip(runs, sources, strict=True):
        scatter(chunk, pages, ids)
    by_torch = page_bits(pages)
    restore(pages, before)
    plan = planned(pages, runs, counts, sources)
    for layer0, count in spans:
        run(plan, tensors, save=False, layer0=layer0, num_layers=count)
    assert all(torch.equal(a, b) for a, b in zip(page_bits(pages), by_torch, strict=True))
