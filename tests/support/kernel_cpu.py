"""Run ``kv_copy.cu`` itself on the CPU: the CUDA source compiled as C++ by g++.

The kernels include nothing, so defining CUDA's keywords, its vector types and the
built-in ``blockIdx``/``blockDim``/``threadIdx``/``gridDim`` makes the file plain C++.
:class:`CpuKernels` builds a shared library whose ``lmtier_emulate`` runs one kernel
over a whole grid, thread after thread, on CPU tensors; a small grid makes the kernels'
grid-stride loop run several rounds.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch

from lmtier_connector.device.kernels.cuda import KERNEL_NAMES, kernel_source
from lmtier_connector.device.kernels.plan import CopyPlan

HARNESS = r"""
#include <cstdint>
struct lmtier_dim3 { unsigned x, y, z; };
static lmtier_dim3 blockIdx, blockDim, threadIdx, gridDim;
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
#define __global__
#define __device__
#define __forceinline__ inline

// The memory a launch may touch: [start, end) ranges; a unit outside them is counted
// and not copied.
static const long long* ranges = nullptr;
static int num_ranges = 0;
static long long strays = 0;
static bool inside(const void* at, unsigned long size) {
    const long long begin = (long long)at, end = begin + (long long)size;
    for (int i = 0; i < num_ranges; ++i)
        if (ranges[2 * i] <= begin && end <= ranges[2 * i + 1]) return true;
    return false;
}
#define LMTIER_COPY(V, dst, src)                                         \
    do {                                                                  \
        if (inside(dst, sizeof(V)) && inside(src, sizeof(V)))             \
            *(V*)(dst) = *(const V*)(src);                                \
        else                                                              \
            ++strays;                                                     \
    } while (0)
#include "kv_copy.cu"

typedef void (*lmtier_kernel)(const i64*, const i64*, const i64*, int, int, int, int, int,
                              int, i64, i64, i64, i64, i64, i64, i64);
static const lmtier_kernel kernels[] = {
    lmtier_kv_save_16, lmtier_kv_save_8, lmtier_kv_save_4, lmtier_kv_save_2, lmtier_kv_save_1,
    lmtier_kv_load_16, lmtier_kv_load_8, lmtier_kv_load_4, lmtier_kv_load_2, lmtier_kv_load_1};

extern "C" long long lmtier_emulate(
    const long long* allowed, int num_allowed, int which, unsigned grid_x, unsigned grid_y,
    unsigned block_x, const i64* layers, const i64* table, const i64* ids, int layer0,
    int num_layers, int pairs, int slots, int rows, int units, i64 pp, i64 pb, i64 ps, i64 pr,
    i64 cb, i64 cs, i64 cr) {
    ranges = allowed;
    num_ranges = num_allowed;
    strays = 0;
    gridDim = {grid_x, grid_y, 1};
    blockDim = {block_x, 1, 1};
    for (unsigned y = 0; y < grid_y; ++y)
        for (unsigned x = 0; x < grid_x; ++x)
            for (unsigned t = 0; t < block_x; ++t) {
                blockIdx = {x, y, 0};
                threadIdx = {t, 0, 0};
                kernels[which](layers, table, ids, layer0, num_layers, pairs, slots, rows,
                               units, pp, pb, ps, pr, cb, cs, cr);
            }
    return strays;
}
"""


class CpuKernels:
    """``kv_copy.cu`` compiled by g++ in a work folder, launched like cupy launches it.

    :meth:`run` takes what a cupy kernel call takes (grid, block, the argument tuple);
    :meth:`launch` builds those from a plan as the engine's launches do. Both raise an
    AssertionError when a unit lies outside the storages of ``tensors`` (such units are
    not copied).
    """

    def __init__(self, workdir: Path) -> None:
        compiler = shutil.which("g++")
        if compiler is None:
            raise RuntimeError("g++ is needed to run kv_copy.cu on the CPU")
        (workdir / "kv_copy.cu").write_text(kernel_source())
        (workdir / "harness.cpp").write_text(HARNESS)
        library = workdir / "kv_copy_cpu.so"
        flags = ["-O1", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Werror"]
        command = [compiler, *flags, "-o", str(library), str(workdir / "harness.cpp")]
        subprocess.run(command, check=True, capture_output=True, text=True)
        self._emulate = ctypes.CDLL(str(library)).lmtier_emulate
        i64, i32, u32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_uint32, ctypes.c_void_p
        self._emulate.argtypes = [
            ptr,
            i32,
            i32,
            u32,
            u32,
            u32,
            ptr,
            ptr,
            ptr,
            *([i32] * 6),
            *([i64] * 7),
        ]
        self._emulate.restype = i64

    def run(
        self,
        name: str,
        grid: tuple[int, int],
        block: tuple[int],
        args: Sequence[object],
        tensors: Sequence[torch.Tensor],
    ) -> None:
        """One launch of kernel ``name``: ``grid`` (x, y), ``block`` (x,), ``args``."""
        storages = [tensor.untyped_storage() for tensor in tensors]
        spans = [(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in storages]
        allowed = torch.tensor([edge for span in spans for edge in span], dtype=torch.int64)
        numbers = [int(arg) for arg in args]  # type: ignore[call-overload]
        strays = self._emulate(
            allowed.data_ptr(), len(spans), KERNEL_NAMES.index(name), *grid, *block, *numbers
        )
        assert strays == 0, f"{strays} units outside the tensors the launch may touch"

    def launch(
        self,
        plan: CopyPlan,
        tensors: Sequence[torch.Tensor],
        *,
        save: bool,
        layer0: int = 0,
        num_layers: int | None = None,
        grid: tuple[int, int] = (3, 32),
    ) -> None:
        """Layers ``layer0 ..`` (all by default) of ``plan``, on ``grid`` = (blocks per
        chunk, threads per block)."""
        count = plan.num_layers - layer0 if num_layers is None else num_layers
        words = torch.tensor(plan.words(), dtype=torch.int64)
        table, ids = plan.offsets()
        base = words.data_ptr()
        pointers = (base, base + 8 * table, base + 8 * ids)
        name = f"lmtier_kv_{'save' if save else 'load'}_{plan.width}"
        args = (*pointers, layer0, count, *plan.scalars())
        self.run(name, (grid[0], plan.num_chunks), (grid[1],), args, tensors)
