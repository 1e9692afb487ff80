"""The fused CUDA copy kernels' source, checked on a machine without a GPU.

* ``kv_copy.cu`` compiles through NVRTC (cupy's binding: no device, no driver) for
  sm_80 and sm_90, down to machine code, and to PTX;
* the same source, compiled as C++ by g++ (:mod:`support.kernel_cpu`: CUDA's keywords
  and built-ins defined, the grid run thread after thread, small grids so that the
  grid-stride loop goes round), saves and loads what the torch path does, bit for bit,
  on the random transfers of the plans' property test;
* the transfer engine, made to take its kernel branches on CPU tensors (stand-in
  streams and events, the C++-compiled kernels as its launches), launches once per
  layer on a load and records each layer's event after it, launches once for a whole
  save_all and once per save_layer, and moves the right bytes.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lmtier.kv_spec import KVSpec
from lmtier_connector.device.kernels import cuda
from lmtier_connector.device.kernels.plan import CopyPlan
from lmtier_connector.device.paged_kv import PagedKVCache
from lmtier_connector.device.transfer import TransferEngine, gather, scatter
from support.copy_cases import FEW, check_against_torch, make_case, page_bits, restore
from support.fake_streams import FakeStream, fake_cuda
from support.kernel_cpu import CpuKernels
from support.kv_bits import bits, randomize


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> CpuKernels:
    return CpuKernels(tmp_path_factory.mktemp("kv_copy"))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "compute_90"])
@pytest.mark.parametrize("source", cuda.cuda_sources())
def test_every_cuda_source_compiles_with_nvrtc(source: str, arch: str) -> None:
    code = cuda.compile_source(arch, source)
    if arch.startswith("sm_"):
        assert code[:4] == b"\x7fELF"  # a cubin: compiled down to the architecture's SASS
    else:
        assert b".target sm_90" in code
    if source == "kv_copy.cu":  # extern "C": the names cupy asks for, unmangled
        assert all(name.encode() in code for name in cuda.KERNEL_NAMES)


def test_the_package_ships_its_cuda_sources() -> None:
    assert cuda.cuda_sources() == ["kv_copy.cu"]


def test_a_source_nvrtc_refuses_is_a_runtime_error_with_its_log(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cuda, "kernel_source", lambda name: 'extern "C" __global__ void k() { x; }')
    with pytest.raises(RuntimeError, match=r"does not compile for sm_90(.|\n)*undefined"):
        cuda.compile_source("sm_90")


@FEW
@given(data=st.data(), layer_by_layer=st.booleans(), grid=st.sampled_from([(1, 32), (3, 64)]))
def test_the_cuda_source_run_on_the_cpu_moves_what_the_torch_path_moves(
    kernels: CpuKernels, data: st.DataObject, layer_by_layer: bool, grid: tuple[int, int]
) -> None:
    def run(plan: CopyPlan, tensors: list[torch.Tensor], **how: int) -> None:
        kernels.launch(plan, tensors, grid=grid, **how)

    check_against_torch(make_case(data), run, layer_by_layer)


# ---- the engine's kernel branches -------------------------------------------------------


def test_the_engine_launches_per_layer_on_load_and_once_per_save_all(
    kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's kernel branches on CPU tensors (stand-in streams and events; the
    C++-compiled kernels as its launches): the load stream waits for compute once, then
    launches and records an event per layer; compute waits on the event of the layer it
    asks for; a whole save is one launch after the save stream waited for compute; a
    save layer by layer one launch per layer; compute never waits on a save."""
    log: list[tuple[str, ...]] = []
    current = fake_cuda(monkeypatch, log)

    class Launches:  # the C++-compiled kernels in place of cupy's launches
        def __init__(self, plan: CopyPlan, device: torch.device, staged: object) -> None:
            assert staged is None  # the engine stages loads only when told to
            self.plan = plan

        def launch(self, *, save: bool, layer0: int, num_layers: int, stream: FakeStream) -> None:
            assert stream is current[-1]  # launched on the stream it was made for
            what = "saves" if save else "loads"
            log.append((stream.name, what, f"{layer0}+{num_layers}"))
            touched = [*(pages.layer(i) for i in range(3)), *chunks, *outs]
            kernels.launch(self.plan, touched, save=save, layer0=layer0, num_layers=num_layers)

    monkeypatch.setattr(cuda, "Launches", Launches)

    spec = KVSpec(3, 2, 8, "bfloat16")
    source = PagedKVCache(spec, 16, 4)
    for layer in range(3):
        randomize(source.layer(layer), layer)
    chunks = [torch.empty(spec.shape(n), dtype=torch.bfloat16) for n in (8, 5)]
    gather(source, [1, 2], chunks[0])
    gather(source, [3, 4], chunks[1])
    pages = PagedKVCache(spec, 16, 4)
    outs: list[torch.Tensor] = []
    engine = TransferEngine(pages)
    engine._kernels = True  # what a CUDA device with cupy gives
    engine._load_stream = FakeStream("load", log)  # type: ignore[assignment]
    engine._save_stream = FakeStream("save", log)  # type: ignore[assignment]
    runs = [[7, 8], [9, 10]]

    load = engine.start_load(chunks, runs)
    load.wait_layer(1)
    expected = [("load", "waits for", "compute")]
    for layer in range(3):
        expected += [("load", "loads", f"{layer}+1"), ("load", "records", f"event{layer}")]
    assert log == [*expected, ("compute", "waits for", "event1")]
    for ids, chunk in zip(runs, chunks, strict=True):
        back = torch.empty_like(chunk)
        gather(pages, ids, back)
        assert torch.equal(bits(back), bits(chunk))

    log.clear()
    outs[:] = [torch.zeros_like(chunk) for chunk in chunks]
    whole = engine.begin_save(runs, outs)
    whole.save_all()
    whole.wait()
    assert log == [
        ("save", "waits for", "compute"),
        ("save", "saves", "0+3"),
        ("save", "records", "event0"),
        ("host", "waits for", "event0"),
    ]
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(outs, chunks, strict=True))

    log.clear()
    outs[:] = [torch.zeros_like(chunk) for chunk in chunks]
    layered = engine.begin_save(runs, outs)
    layered.save_layer(2)
    layered.save_all()  # the layers left, one launch each
    launched = [entry[2] for entry in log if entry[1] == "saves"]
    assert launched == ["2+1", "0+1", "1+1"]
    assert not [entry for entry in log if entry[0] == "compute"]  # never waits on saves
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(outs, chunks, strict=True))


STREAM = type("Stream", (), {"cuda_stream": 0})()
"""What a launch is given as its torch stream (cupy's stream is replaced too)."""


def cupy_runs_the_cpu_build(
    kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> list[torch.Tensor]:
    """Replace cupy's part of :class:`Launches` (the kernel, the device, the stream) by
    the C++ build of the kernels; returns the list of tensors launches may touch."""
    touched: list[torch.Tensor] = []

    def function(device: int, name: str) -> object:
        def call(grid: tuple[int, int], block: tuple[int], args: tuple[object, ...]) -> None:
            assert block == (cuda.THREADS,) and 1 <= grid[0] <= 2 * cuda.BLOCKS_PER_SM
            kernels.run(name, grid, block, args, touched)

        return call

    fake_cupy = type("cupy", (), {"cuda": type("cuda", (), {"Device": contextlib.nullcontext})})
    monkeypatch.setattr(cuda, "_function", function)
    monkeypatch.setattr(cuda, "_cupy", lambda: fake_cupy)
    monkeypatch.setattr(cuda, "_stream", lambda handle, device: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "_multiprocessors", lambda device: 2)
    return touched


@FEW
@given(data=st.data(), layer_by_layer=st.booleans())
def test_the_launches_pass_what_the_kernels_take(
    kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch, data: st.DataObject, layer_by_layer: bool
) -> None:
    """The engine's own :class:`Launches` (its argument tuple, grid and kernel choice),
    with cupy's launch replaced by the C++ build of the kernels: layer by layer and whole,
    both ways, as the torch path moves them."""
    touched = cupy_runs_the_cpu_build(kernels, monkeypatch)

    def run(plan: CopyPlan, tensors: list[torch.Tensor], **how: int) -> None:
        touched[:] = tensors
        launches = cuda.Launches(plan, torch.device("cpu"))
        touched.append(launches._words)
        launches.launch(stream=STREAM, **how)  # type: ignore[arg-type]

    check_against_torch(make_case(data), run, layer_by_layer)


@FEW
@given(data=st.data(), layer_by_layer=st.booleans())
def test_staged_loads_move_what_the_torch_path_moves(
    kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch, data: st.DataObject, layer_by_layer: bool
) -> None:
    """``launches_for(staged=True)``: each layer of the chunks is copied into one stage
    buffer, and the kernels scatter from there; the pages end as torch's scatter leaves
    them. A staged plan refuses to save."""
    touched = cupy_runs_the_cpu_build(kernels, monkeypatch)
    pages, runs, counts, chunks = make_case(data)
    sources = [randomize(torch.empty_like(c), 7 + j) for j, c in enumerate(chunks)]
    before = page_bits(pages)
    for ids, chunk in zip(runs, sources, strict=True):
        scatter(chunk, pages, ids)
    by_torch = page_bits(pages)
    restore(pages, before)
    views = [pages.chunk_view(source) for source in sources]
    launches = cuda.launches_for(pages, runs, counts, views, staged=True)
    assert launches is not None and launches.plan.chunk_layer == (0,) * len(chunks)
    stage = launches._staged[1][0]  # type: ignore[index]
    touched[:] = [*(pages.layer(i) for i in range(pages.num_layers)), stage, launches._words]
    spans = [(layer, 1) for layer in range(pages.num_layers)] if layer_by_layer else [(0, 3)]
    for layer0, count in spans:
        launches.launch(save=False, layer0=layer0, num_layers=count, stream=STREAM)
    assert all(torch.equal(a, b) for a, b in zip(page_bits(pages), by_torch, strict=True))
    with pytest.raises(ValueError, match="staged plan loads"):
        launches.launch(save=True, layer0=0, num_layers=1, stream=STREAM)
