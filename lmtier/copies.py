"""Copies between host tensors on the calling thread alone, never through torch's
intra-op thread pool.

torch splits a large ``copy_`` over its intra-op threads (one per core by default).
Beside an inference engine the cores are busy, and those threads then wait for each
other at the end of every copy: one thread preempted stalls the whole copy.
Measured on 2 cores with one other busy process, a 2-thread ``copy_`` of a chunk's
strided KV ran 3x slower than a 1-thread one (0.27 against 0.83 GB/s), and
``LMTier.store`` into host memory spent most of its time there. The thread count is
the engine's (a process-wide setting), so lmtier does not change it: it copies host
to host with numpy, which runs the copy on the calling thread (a strided source in
runs as long as its contiguous dimensions allow) and releases the GIL meanwhile.
Any other copy (a device on either end, dtypes that differ) stays ``copy_``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["copy_into"]

_SAME_WIDTH_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""What a dtype numpy lacks (bfloat16, float8) is viewed as for a bytewise copy."""


def copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)``, on this thread alone when both are ordinary host tensors
    of one dtype and shape (module docstring); otherwise torch's own copy."""
    if (
        target.device.type == "cpu"
        and source.device.type == "cpu"
        and target.dtype == source.dtype
        and target.shape == source.shape
        and target.layout == source.layout == torch.strided
        and target.numel() > 0
        and not (target.is_conj() or source.is_conj() or target.is_neg() or source.is_neg())
    ):
        np.copyto(_as_numpy(target), _as_numpy(source), casting="no")
        return
    target.copy_(source)


def _as_numpy(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    """A numpy view of ``tensor``'s memory (a same-width integer view where numpy has no
    such dtype): no copy, same strides."""
    tensor = tensor.detach()
    try:
        return tensor.numpy()
    except TypeError:
        return tensor.view(_SAME_WIDTH_INTS[tensor.element_size()]).numpy()
