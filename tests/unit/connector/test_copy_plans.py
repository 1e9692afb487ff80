"""The fused CUDA copy kernels' plans, on the CPU: what they address, and that their
arithmetic (the CPU reference, :func:`reference_copy`) moves exactly what the torch
path moves, bit for bit, for every page layout (own allocation, vLLM's NHSC orders,
separate and FlashInfer-style layers, MLA), every chunk layout, every dtype, block
sizes 1 to 16, partial chunks, random block orders, several chunks per transfer, and
whole-model as well as layer-by-layer launches. Also: without a GPU the transfer
engine takes the torch path, and ``kernels=True`` says why it cannot.

The CUDA source itself (NVRTC, and compiled as C++ on these plans) is checked in
tests/integration/connector/test_copy_kernels.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lmtier.kv_spec import KVSpec
from lmtier_connector.device.kernels import cuda
from lmtier_connector.device.kernels.plan import CopyPlan, plan_copy, reference_copy
from lmtier_connector.device.paged_kv import PagedKVCache
from lmtier_connector.device.transfer import TransferEngine
from support.copy_cases import MANY, check_against_torch, make_case, planned
from support.kv_bits import bits, randomize


@MANY
@given(data=st.data(), layer_by_layer=st.booleans())
def test_the_reference_moves_what_the_torch_path_moves(
    data: st.DataObject, layer_by_layer: bool
) -> None:
    check_against_torch(make_case(data), reference_copy, layer_by_layer)


def test_rows_merge_while_both_sides_keep_them_contiguous() -> None:
    """NHD pages and LKTHD chunks: a full chunk's K (or V) half of a block is one row of
    16-byte vectors; a partial chunk copies per token, all heads at once; HND pages
    (vLLM's NHSC, heads before slots) copy one head's D elements per row."""
    spec = KVSpec(2, 8, 128, "bfloat16")
    pages = PagedKVCache(spec, 8, 16)
    full = planned(pages, [[3, 1]], [32], [torch.empty(spec.shape(32), dtype=torch.bfloat16)])
    assert (full.slots, full.rows, full.units * full.width, full.width) == (1, 1, 16 * 8 * 256, 16)
    part = planned(pages, [[3, 1]], [20], [torch.empty(spec.shape(20), dtype=torch.bfloat16)])
    assert (part.slots, part.rows, part.units * part.width) == (16, 1, 8 * 256)

    raw = torch.empty(8, 2, 8, 16, 256, dtype=torch.bfloat16)  # [N, L, H, S, C]: HND
    hnd = PagedKVCache.from_tensors(spec, list(raw.transpose(0, 1).unbind(0)))
    head = planned(hnd, [[3, 1]], [32], [torch.empty(spec.shape(32), dtype=torch.bfloat16)])
    assert (head.slots, head.rows, head.units * head.width, head.pairs) == (16, 8, 256, 2)

    paged = KVSpec(2, 8, 128, "bfloat16", "LBHSC", block_size=16)
    blocks = PagedKVCache.from_tensors(paged, list(raw.transpose(0, 1).unbind(0)))
    whole = planned(blocks, [[3, 1]], [32], [torch.empty(paged.shape(32), dtype=torch.bfloat16)])
    assert (whole.slots, whole.rows, whole.units * whole.width) == (1, 1, 8 * 16 * 512)


@pytest.mark.parametrize(
    ("head_dim", "dtype", "offset", "width"),
    [
        (128, "float16", 0, 16),
        (4, "float16", 0, 8),
        (3, "float16", 0, 2),
        (3, "int8", 0, 1),
        (8, "float16", 1, 2),
        (2, "float32", 0, 8),
    ],
)
def test_the_widest_vector_that_divides_every_address_and_stride(
    head_dim: int, dtype: str, offset: int, width: int
) -> None:
    spec = KVSpec(2, 1, head_dim, dtype)
    pages = PagedKVCache(spec, 4, 2)
    count = 3  # a partial block: one token's row per unit
    storage = torch.empty(2 * 2 * count * head_dim + offset, dtype=getattr(torch, dtype))
    chunk = storage[offset:].view(spec.shape(count))  # `offset` elements off the allocation
    plan = planned(pages, [[2, 0]], [count], [chunk])
    assert plan.width == width
    assert plan.units * plan.width == head_dim * chunk.element_size()


def test_what_the_kernels_cannot_address_goes_the_torch_path() -> None:
    spec = KVSpec(2, 2, 4, "float16")
    raw = torch.empty(2, 2, 6, 4, 2, 8, dtype=torch.float16)[..., ::2]  # strided rows
    pages = PagedKVCache.from_tensors(spec, list(raw.unbind(0)))
    chunk = torch.empty(spec.shape(4), dtype=torch.float16)
    assert plan_copy(pages, [[1]], [4], [chunk]) == "a row (the last axis) is strided"
    mixed = [
        torch.empty(2, 6, 4, 2, 4, dtype=torch.float16),
        torch.empty(2, 6, 4, 2, 4, dtype=torch.float16)
        .transpose(2, 3)
        .contiguous()
        .transpose(2, 3),
    ]
    pages = PagedKVCache.from_tensors(spec, mixed)
    assert "strides" in str(plan_copy(pages, [[1]], [4], [chunk]))
    assert "chunks" in str(plan_copy(pages, [], [], []))


def test_the_reference_refuses_an_address_outside_the_tensors() -> None:
    """The reference checks every address against the tensors it is given: a plan that
    strays (here: an id past the pages) fails instead of touching other memory."""
    spec = KVSpec(2, 2, 4, "float16")
    pages = PagedKVCache(spec, 4, 2)
    chunk = torch.zeros(spec.shape(4), dtype=torch.float16)
    plan = planned(pages, [[1, 2]], [4], [chunk])
    stray = CopyPlan(**{**{f: getattr(plan, f) for f in plan.__slots__}, "ids": (1, 9)})
    with pytest.raises(AssertionError, match="past the end"):
        reference_copy(stray, [pages.layer(0), pages.layer(1), chunk], save=True)


def test_without_a_gpu_the_engine_takes_the_torch_path() -> None:
    spec = KVSpec(2, 2, 4, "float16")
    pages = PagedKVCache(spec, 8, 4)
    randomize(pages.layer(0), 1)
    engine = TransferEngine(pages)
    assert not engine.kernels
    assert not TransferEngine(pages, kernels=False).kernels
    with pytest.raises(RuntimeError, match="kernels were asked for, but the pages are on cpu"):
        TransferEngine(pages, kernels=True)
    out = torch.empty(spec.shape(6), dtype=torch.float16)
    save = engine.begin_save([[5, 2]], [out])
    save.save_all()
    assert torch.equal(bits(out[0, :, :4]), bits(pages.layer(0)[:, 5])) and save.done()


def test_why_the_kernels_cannot_run_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each reason the kernels cannot run on a device is a line the engine logs (or
    raises, when they were asked for): cupy missing, a device that cannot address
    registered host memory, a source that does not load."""
    cuda0 = torch.device("cuda", 0)
    assert cuda.kernels_unavailable(torch.device("cpu")) == "the pages are on cpu, not CUDA"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda.kernels_unavailable(cuda0) == "torch sees no CUDA device"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def no_cupy() -> None:
        raise ImportError("No module named 'cupy'")

    monkeypatch.setattr(cuda, "_cupy", no_cupy)
    assert "cupy is not installed (pip install -e '.[cuda]')" in str(
        cuda.kernels_unavailable(cuda0)
    )
    with pytest.raises(RuntimeError, match="asked for, but cupy is not installed"):
        cuda.use_kernels(cuda0, True)
    assert cuda.use_kernels(cuda0, None) is False
    assert cuda.use_kernels(cuda0, False) is False

    attribute = {"value": 0}
    runtime = type("runtime", (), {
        "cudaDevAttrCanUseHostPointerForRegisteredMem": 91,
        "deviceGetAttribute": staticmethod(lambda attr, device: attribute["value"]),
    })  # fmt: skip
    fake = type("cupy", (), {"cuda": type("cuda", (), {"runtime": runtime})})
    monkeypatch.setattr(cuda, "_cupy", lambda: fake)
    assert "cannot use host pointers" in str(cuda.kernels_unavailable(cuda0))

    def refuse(device: int) -> None:
        raise RuntimeError("NVRTC_ERROR_COMPILATION\nkv_copy.cu(3): error: ...\n1 error")

    attribute["value"] = 1
    monkeypatch.setattr(cuda, "_module", refuse)
    assert cuda.kernels_unavailable(cuda0) == (
        "the kernels did not load: RuntimeError: NVRTC_ERROR_COMPILATION"
    )
    monkeypatch.setattr(cuda, "_module", lambda device: object())
    assert cuda.kernels_unavailable(cuda0) is None
    assert cuda.use_kernels(cuda0, None) is True
