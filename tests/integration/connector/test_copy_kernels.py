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
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lmtier.kv_spec import KVSpec
from lmtier_connector.device.kernels import cuda
from lmtier_connector.device.kernels.plan import CopyPlan
from lmtier_connector.device.paged_kv import PagedKVCache
from lmtier_connector.device.transfer import TransferEngine, gather
from support.copy_cases import FEW, bits, check_against_torch, make_case, randomize
from support.kernel_cpu import CpuKernels


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> CpuKernels:
    return CpuKernels(tmp_path_factory.mktemp("kv_copy"))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "compute_90"])
def test_the_cuda_source_compiles_with_nvrtc(arch: str) -> None:
    code = cuda.compile_source(arch)
    if arch.startswith("sm_"):
        assert code[:4] == b"\x7fELF"  # a cubin: compiled down to the architecture's SASS
    else:
        assert b".target sm_90" in code
    assert all(name.encode() in code for name in cuda.KERNEL_NAMES)  # extern "C": unmangled


def test_a_source_nvrtc_refuses_is_a_runtime_error_with_its_log(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cuda, "kernel_source", lambda: 'extern "C" __global__ void k() { x; }')
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


class Stream:
    """Stands in for a torch CUDA stream: records what waits on what."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: Stream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")

    def wait_event(self, event: Event) -> None:
        self.log.append(f"{self.name} waits for {event.name}")


class Event:
    def __init__(self, log: list[str]) -> None:
        self.log, self.name = log, f"event{sum('records' in entry for entry in log)}"

    def record(self, stream: Stream) -> None:
        self.log.append(f"{stream.name} records {self.name}")

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.log.append(f"host waits for {self.name}")


def test_the_engine_launches_per_layer_on_load_and_once_per_save_all(
    kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[str] = []
    current = [Stream("compute", log)]

    @contextlib.contextmanager
    def use(stream: Stream) -> Iterator[None]:
        current.append(stream)
        yield
        current.pop()

    class Launches:  # the C++-compiled kernels in place of cupy's launches
        def __init__(self, plan: CopyPlan, device: torch.device) -> None:
            self.plan = plan

        def launch(self, *, save: bool, layer0: int, num_layers: int, stream: Stream) -> None:
            assert stream is current[-1]  # launched on the stream it was made for
            log.append(f"{stream.name} {'saves' if save else 'loads'} {layer0}+{num_layers}")
            touched = [*(pages.layer(i) for i in range(3)), *chunks, *outs]
            kernels.launch(self.plan, touched, save=save, layer0=layer0, num_layers=num_layers)

    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: Event(log))
    monkeypatch.setattr(cuda, "Launches", Launches)

    spec = KVSpec(3, 2, 8, "bfloat16")
    source = PagedKVCache(spec, 16, 4)
    for layer in range(3):
        randomize(source.layer(layer), layer)
    chunks = [
        torch.empty(spec.shape(8), dtype=torch.bfloat16),
        torch.empty(spec.shape(5), dtype=torch.bfloat16),
    ]
    gather(source, [1, 2], chunks[0])
    gather(source, [3, 4], chunks[1])
    pages = PagedKVCache(spec, 16, 4)
    outs: list[torch.Tensor] = []
    engine = TransferEngine(pages)
    engine._kernels = True  # what a CUDA device with cupy gives
    engine._load_stream = Stream("load", log)  # type: ignore[assignment]
    engine._save_stream = Stream("save", log)  # type: ignore[assignment]

    load = engine.start_load(chunks, [[7, 8], [9, 10]])
    load.wait_layer(1)
    expected = ["load waits for compute"]
    for layer in range(3):
        expected += [f"load loads {layer}+1", f"load records event{layer}"]
    assert log == [*expected, "compute waits for event1"]
    for ids, chunk in zip([[7, 8], [9, 10]], chunks, strict=True):
        back = torch.empty_like(chunk)
        gather(pages, ids, back)
        assert torch.equal(bits(back), bits(chunk))

    log.clear()
    outs[:] = [torch.zeros_like(chunk) for chunk in chunks]
    whole = engine.begin_save([[7, 8], [9, 10]], outs)
    whole.save_all()
    whole.wait()
    assert log == [
        "save waits for compute",
        "save saves 0+3",
        "save records event0",
        "host waits for event0",
    ]
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(outs, chunks, strict=True))

    log.clear()
    outs[:] = [torch.zeros_like(chunk) for chunk in chunks]
    layered = engine.begin_save([[7, 8], [9, 10]], outs)
    layered.save_layer(2)
    layered.save_all()  # the layers left, one launch each
    assert [entry for entry in log if "saves" in entry] == [
        "save saves 2+1",
        "save saves 0+1",
        "save saves 1+1",
    ]
    assert not [entry for entry in log if entry.startswith("compute")]  # never waits on saves
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(outs, chunks, strict=True))


@FEW
@given(data=st.data(), layer_by_layer=st.booleans())
def test_the_launches_pass_what_the_kernels_take(
    kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch, data: st.DataObject, layer_by_layer: bool
) -> None:
    """The engine's own :class:`Launches` (its argument tuple, grid and kernel choice),
    with cupy's launch replaced by the C++ build of the kernels: layer by layer and whole,
    both ways, as the torch path moves them."""
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
    stream = type("Stream", (), {"cuda_stream": 0})()

    def run(plan: CopyPlan, tensors: list[torch.Tensor], **how: int) -> None:
        touched[:] = tensors
        launches = cuda.Launches(plan, torch.device("cpu"))
        touched.append(launches._words)
        launches.launch(stream=stream, **how)  # type: ignore[arg-type]

    check_against_torch(make_case(data), run, layer_by_layer)
