"""Loading and launching the fused copy kernels with cupy, on the transfer engine's streams.

:func:`kernels_unavailable` says why the kernels cannot run for a device (None when
they can): cupy missing, no CUDA device, a device that cannot use host pointers of
registered memory in kernels (the shared-memory pools of sidecar clients are
registered, not allocated, pinned memory), or a source NVRTC refused. The transfer
engine (:mod:`lmtier_connector.device.transfer`) asks once, at construction, and uses
the torch path otherwise.

:class:`Launches` holds one plan's int64 words on the device (copied on the stream
that will use them, from pinned memory, ``non_blocking``) and launches the kernel of
the plan's vector width for any layer range, on any torch CUDA stream.

:func:`compile_source` compiles ``kv_copy.cu`` through NVRTC for an architecture with
no device and no driver: the CI check that the source builds for sm_80 and sm_90.
"""

from __future__ import annotations

import functools
import importlib.resources
import logging
from typing import Any

import numpy as np
import torch

from lmtier_connector.device.kernels.plan import MAX_WORK, CopyPlan, plan_copy
from lmtier_connector.device.paged_kv import PagedKVCache

__all__ = [
    "KERNEL_NAMES",
    "Launches",
    "compile_source",
    "cuda_sources",
    "kernel_source",
    "kernels_unavailable",
    "launches_for",
    "use_kernels",
]

logger = logging.getLogger(__name__)

THREADS = 256
"""Threads per block: eight warps, each thread one vector of one row at a time."""
BLOCKS_PER_SM = 4
"""Blocks of one launch, all chunks together, per multiprocessor; past it the kernels
loop (grid-stride). Enough threads to keep the bus busy (a 16-byte read each: 132 SMs
make ~2 MB in flight), few enough to leave the SMs to a layer's compute while a
layer-wise load runs beside it."""
KERNEL_NAMES = tuple(
    f"lmtier_kv_{way}_{width}" for way in ("save", "load") for width in (16, 8, 4, 2, 1)
)
OPTIONS = ("--std=c++17",)


def cuda_sources() -> list[str]:
    """The names of the CUDA C files shipped with this package (every one is compiled
    by CI's NVRTC check)."""
    folder = importlib.resources.files(__package__)
    return sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(".cu"))


def kernel_source(name: str = "kv_copy.cu") -> str:
    """The CUDA C source ``name`` (``kv_copy.cu``: the copy kernels)."""
    return (importlib.resources.files(__package__) / name).read_text()


def compile_source(arch: str, name: str = "kv_copy.cu") -> bytes:
    """Compile the source ``name`` with NVRTC for ``arch`` (``"sm_90"``: a cubin;
    ``"compute_90"``: PTX), needing neither a device nor a driver. ``RuntimeError`` with
    NVRTC's log when it does not compile."""
    # The NVRTC binding alone: no driver needed. Optional (the `cuda` extra).
    from cupy_backends.cuda.libs import nvrtc  # noqa: PLC0415

    program = nvrtc.createProgram(kernel_source(name), name, [], [])
    try:
        try:
            nvrtc.compileProgram(program, [*OPTIONS, f"--gpu-architecture={arch}"])
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(program)
            raise RuntimeError(f"{name} does not compile for {arch}: {exc}\n{log}") from exc
        return bytes(nvrtc.getCUBIN(program) if arch.startswith("sm_") else nvrtc.getPTX(program))
    finally:
        nvrtc.destroyProgram(program)


def _cupy() -> Any:
    import cupy  # noqa: PLC0415 - optional: the `cuda` extra

    return cupy


@functools.cache
def _module(device: int) -> Any:
    """The compiled module for one device (NVRTC through cupy, cached on disk by cupy)."""
    cupy = _cupy()
    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=kernel_source(), options=OPTIONS)
        module.compile()
        return module


@functools.cache
def _multiprocessors(device: int) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def kernels_unavailable(device: torch.device) -> str | None:
    """Why the fused kernels cannot run on ``device``, or None when they can."""
    if device.type != "cuda":
        return f"the pages are on {device.type}, not CUDA"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        cupy = _cupy()
    except ImportError as exc:
        return f"cupy is not installed (pip install -e '.[cuda]'): {exc}"
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    try:
        can_use = cupy.cuda.runtime.cudaDevAttrCanUseHostPointerForRegisteredMem
        if not cupy.cuda.runtime.deviceGetAttribute(can_use, index):
            return "the device cannot use host pointers of registered memory in kernels"
        _module(index)
    except Exception as exc:  # a driver, NVRTC or compile failure: the torch path copies
        first = (str(exc).strip().splitlines() or [""])[0]  # one line: NVRTC logs run on
        return f"the kernels did not load: {type(exc).__name__}: {first}"
    return None


def use_kernels(device: torch.device, wanted: bool | None) -> bool:
    """Whether a transfer engine on ``device`` copies with the kernels: ``wanted`` None
    where they run (saying why not, once, on CUDA), True where they run or a
    ``RuntimeError`` saying why not, False never."""
    if wanted is False:
        return False
    why = kernels_unavailable(device)
    if why is not None and wanted:
        raise RuntimeError(f"the fused copy kernels were asked for, but {why}")
    if why is not None and device.type == "cuda":
        logger.info("lmtier: the torch copy path moves KV (%s)", why)
    return why is None


def launches_for(
    pages: PagedKVCache,
    runs: list[list[int]],
    counts: list[int],
    chunks: list[torch.Tensor],
    *,
    staged: bool = False,
) -> Launches | None:
    """The launches that copy these checked runs to or from ``chunks`` (chunk views),
    their words copied on the current stream; None when the kernels cannot address
    them (:func:`plan_copy` says why, logged at debug level).

    ``staged`` (loads only): each layer of the chunks is first copied into one device
    buffer (a DMA copy per chunk, layer-major chunks), and the kernels scatter from
    there, instead of reading the host chunks in place over the bus. Which is faster
    is the GPU benchmark's question (``benchmarks/bench_copy_kernels.py``)."""
    stages: list[torch.Tensor] = []
    planned = chunks
    if staged:
        sizes = [chunk[0].numel() for chunk in chunks]
        buffer = torch.empty(sum(sizes), dtype=chunks[0].dtype, device=pages.device)
        for chunk, start, size in zip(chunks, np.cumsum([0, *sizes[:-1]]), sizes, strict=True):
            stages.append(buffer[int(start) : int(start) + size].view(chunk.shape[1:]))
        # Every layer of a chunk reads its stage: a layer stride of 0.
        planned = [stage.expand(chunk.shape) for stage, chunk in zip(stages, chunks, strict=True)]
    plan = plan_copy(pages, runs, counts, planned)
    if isinstance(plan, str):
        logger.debug("lmtier: the torch copy path moves this transfer (%s)", plan)
        return None
    return Launches(plan, pages.device, (chunks, stages) if staged else None)


class Launches:
    """One plan's words on the device, and its launches.

    Make it under ``torch.cuda.stream(s)`` of the stream that launches: the words are
    copied there, so every launch on ``s`` sees them. Keep it (and the chunks) alive
    until the launches finished. ``staged``: the host chunks and their device stages
    (:func:`launches_for`).
    """

    __slots__ = ("_index", "_plan", "_pointers", "_scalars", "_staged", "_words")

    def __init__(
        self,
        plan: CopyPlan,
        device: torch.device,
        staged: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
    ) -> None:
        self._plan = plan
        self._staged = staged
        words = torch.tensor(plan.words(), dtype=torch.int64)
        self._index = 0  # the device's (a CPU device: the tests' C++ build of the kernels)
        if device.type == "cuda":
            index = device.index
            self._index = torch.cuda.current_device() if index is None else index
            # Pinned and non_blocking: ordered on the stream, the host does not wait.
            words = words.pin_memory().to(device, non_blocking=True)
        self._words = words
        table, ids = plan.offsets()
        base = self._words.data_ptr()
        # The arguments every launch shares, made once: (layers, table, ids) before
        # layer0 and num_layers, the plan's sizes and strides after them.
        self._pointers = tuple(np.uint64(p) for p in (base, base + 8 * table, base + 8 * ids))
        scalars = plan.scalars()
        sizes, strides = scalars[:4], scalars[4:]
        self._scalars = (*(np.int32(v) for v in sizes), *(np.int64(v) for v in strides))

    @property
    def plan(self) -> CopyPlan:
        return self._plan

    def launch(self, *, save: bool, layer0: int, num_layers: int, stream: Any) -> None:
        """Copy layers ``layer0 .. layer0 + num_layers - 1`` of every chunk on ``stream``
        (a torch CUDA stream): pages to chunks when ``save``, else chunks to pages."""
        plan = self._plan
        if not 0 <= layer0 < layer0 + num_layers <= plan.num_layers:
            raise ValueError(f"layers {layer0}+{num_layers} of a {plan.num_layers}-layer plan")
        if self._staged is None:
            self._kernel(save, layer0, num_layers, stream)
            return
        if save:
            raise ValueError("a staged plan loads; saves write the chunks in place")
        for layer in range(layer0, layer0 + num_layers):  # the stage holds one layer
            for chunk, stage in zip(*self._staged, strict=True):
                stage.copy_(chunk[layer], non_blocking=True)
            self._kernel(False, layer, 1, stream)

    def _kernel(self, save: bool, layer0: int, num_layers: int, stream: Any) -> None:
        plan, index = self._plan, self._index
        work = plan.work(num_layers)
        if work > MAX_WORK:
            raise ValueError(f"{work} copy units in one launch (at most {MAX_WORK})")
        kernel = _function(index, f"lmtier_kv_{'save' if save else 'load'}_{plan.width}")
        budget = max(1, _multiprocessors(index) * BLOCKS_PER_SM // plan.num_chunks)
        blocks = max(1, min(budget, -(-work // THREADS)))
        args = (*self._pointers, np.int32(layer0), np.int32(num_layers), *self._scalars)
        if self._words.is_cuda:  # the allocator keeps the words until the stream is past
            self._words.record_stream(stream)
        with _cupy().cuda.Device(index), _stream(int(stream.cuda_stream), index):
            kernel((blocks, plan.num_chunks), (THREADS,), args)


@functools.cache
def _function(device: int, name: str) -> Any:
    return _module(device).get_function(name)


class _StreamHandle:
    """A raw ``cudaStream_t`` behind the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


@functools.lru_cache(maxsize=64)
def _stream(handle: int, device: int) -> Any:
    """A cupy stream over a torch stream's handle: kernels launched in it run on that
    stream. (torch reuses a small pool of streams, so the handles are few.)"""
    cupy = _cupy()
    with cupy.cuda.Device(device):
        from_external = getattr(cupy.cuda.Stream, "from_external", None)
        if from_external is not None:  # cupy >= 14
            return from_external(_StreamHandle(handle))
        return cupy.cuda.ExternalStream(handle, device)
