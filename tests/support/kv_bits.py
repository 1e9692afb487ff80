"""Bit-level helpers for KV tests: integer views of any dtype (float8 and bfloat16
included), bit-exact comparison, and random bit patterns (NaNs included), so that only
copies that move every bit pass."""

from __future__ import annotations

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the same width."""
    return t.view(_BITS[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def randomize(t: torch.Tensor, seed: int) -> torch.Tensor:
    """Fill ``t`` with random bit patterns (NaNs included); returns it."""
    gen = torch.Generator().manual_seed(seed)
    raw = bits(t)
    info = torch.iinfo(raw.dtype)
    raw.copy_(torch.randint(info.min, info.max, raw.shape, generator=gen, dtype=raw.dtype))
    return t
