"""Token ids in, one validated little-endian integer array out.

Keys must be equal across processes, machines and input types, so every token
sequence is first turned into the same canonical form: a 1-D numpy ``int64`` array
of non-negative ids. Python lists, tuples, numpy arrays and torch tensors (CPU or
CUDA) are accepted; anything that would make two equal prompts hash differently
(floats, bools, negative ids, ids beyond the vocabulary) is rejected with
:class:`~lmtier.errors.InvalidTokensError` instead of being coerced silently, and so
is anything else that is not a flat sequence of ids (nested lists, 2-D arrays,
masked arrays, meta, sparse or quantized tensors): that error is the only one bad
token ids raise.

torch is not imported here: a tensor is recognised by its type and converted
through its own ``.cpu().numpy()``, so this module stays usable in processes that
never load torch (storage backends, the CLI).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from lmtier.errors import InvalidTokensError, brief

__all__ = ["INT32_LIMIT", "MAX_TOKEN_ID", "TokenArray", "TokenInput", "as_token_array"]

TokenArray: TypeAlias = npt.NDArray[np.int64]
"""A 1-D, C-contiguous int64 array of validated token ids."""

TokenInput: TypeAlias = "Sequence[int] | npt.NDArray[Any] | Any"
"""What callers may pass: a sequence of ints, a numpy array, or a torch tensor."""

MAX_TOKEN_ID = 2**63 - 1
"""Largest id representable in the int64 wire encoding."""

INT32_LIMIT = 2**31
"""Ids below this are hashed as 4-byte integers; a chunk holding a larger one uses 8."""


def as_token_array(tokens: TokenInput, *, vocab_size: int | None = None) -> TokenArray:
    """Validate ``tokens`` and return them as a 1-D C-contiguous int64 numpy array.

    Raises InvalidTokensError for a non-1-D input, a non-integer dtype (floats and
    bools included), a negative id, an id >= ``vocab_size`` when one is given, or an
    id that does not fit in int64.
    """
    array = _to_numpy(tokens)
    if array.ndim != 1:
        raise InvalidTokensError(f"token ids must be 1-D, got shape {tuple(array.shape)}")
    if array.size == 0:
        return np.empty(0, dtype=np.int64)
    kind = array.dtype.kind
    if kind not in "iu":
        raise InvalidTokensError(
            f"token ids must be integers, got dtype {array.dtype} "
            "(floats and bools are rejected rather than truncated)"
        )
    if kind == "u" and array.dtype.itemsize == 8:
        high = int(array.max())
        if high > MAX_TOKEN_ID:
            position = int(np.argmax(array))
            raise InvalidTokensError(
                f"token id {high} at position {position} does not fit in int64"
            )
        # In this machine's byte order first (a big-endian array's bits viewed as
        # int64 here were other ids), then the same bits: no copy when they already are.
        result = np.ascontiguousarray(array, dtype=np.uint64).view(np.int64)
    else:
        result = np.ascontiguousarray(array, dtype=np.int64)
    if kind == "i":  # unsigned ids cannot be negative
        low = int(result.min())
        if low < 0:
            position = int(np.argmin(result))
            raise InvalidTokensError(f"token ids must be >= 0, got {low} at position {position}")
    if vocab_size is not None:
        high = int(result.max())
        if high >= vocab_size:
            position = int(np.argmax(result))
            raise InvalidTokensError(
                f"token id {high} at position {position} is out of range for "
                f"vocab_size {vocab_size}"
            )
    return result


def _to_numpy(tokens: Any) -> npt.NDArray[Any]:
    if isinstance(tokens, np.ndarray):
        # The masked ids would be hashed as if they were there. A plain ndarray is
        # never masked: asking ``np.ma`` first would import numpy.ma (~30 ms) on the
        # first load of a new process.
        if (
            type(tokens) is not np.ndarray
            and isinstance(tokens, np.ma.MaskedArray)
            and bool(np.any(tokens.mask))
        ):
            raise InvalidTokensError("token ids must not be a masked array with masked ids")
        return tokens
    if _is_torch_tensor(tokens):
        return _from_tensor(tokens)
    if isinstance(tokens, (str, bytes, bytearray, memoryview)):
        raise InvalidTokensError(
            f"token ids must be a sequence of ints, not {type(tokens).__name__}"
        )
    if not isinstance(tokens, Sequence):
        raise InvalidTokensError(
            f"token ids must be a list, tuple, numpy array or torch tensor, "
            f"not {type(tokens).__name__}"
        )
    if len(tokens) == 0:
        return np.empty(0, dtype=np.int64)
    fast = _from_ints(tokens)
    if fast is not None:
        return fast
    try:
        # np.array builds int64 straight from Python ints; floats, bools and mixed
        # inputs come out with another dtype and are rejected by the caller.
        array = np.array(tokens)
    except (OverflowError, ValueError, TypeError) as exc:
        raise InvalidTokensError(f"token ids are not a flat sequence of integers: {exc}") from exc
    if array.dtype == object:
        raise InvalidTokensError(
            f"token ids are not all integers that fit in int64 (first element: {brief(tokens[0])})"
        )
    if array.ndim != 1:  # nested lists: their shape is not the number of tokens
        raise InvalidTokensError(
            f"token ids must be 1-D, a flat sequence of integers, got nested sequences "
            f"of shape {tuple(array.shape)}"
        )
    if array.dtype.kind in "iu":
        _refuse_bools(tokens, array)
    return array


def _from_tensor(tensor: Any) -> npt.NDArray[Any]:
    """A 1-D integer tensor's ids on the host; InvalidTokensError for every tensor
    that holds none (meta), is not dense (sparse, nested, quantized), is not 1-D or
    not of integers, or cannot be read (checked before any copy off a device)."""
    import torch  # noqa: PLC0415 - only reached when a tensor was passed: torch is loaded

    try:
        kind = (tensor.layout, tensor.is_nested, tensor.is_quantized, tensor.device.type)
        dtype, ndim = tensor.dtype, tensor.dim()
    except (RuntimeError, TypeError, AttributeError, NotImplementedError) as exc:
        raise InvalidTokensError(f"token ids cannot be read from this tensor: {exc}") from None
    layout, nested, quantized, device = kind
    if nested or quantized or layout != torch.strided:
        what = "a nested" if nested else "a quantized" if quantized else f"a {layout}"
        raise InvalidTokensError(f"token ids must be a dense tensor, got {what} tensor")
    if device == "meta":
        raise InvalidTokensError("token ids must hold values: a meta tensor has none")
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise InvalidTokensError(f"token ids must be integers, got torch dtype {dtype}")
    if ndim != 1:
        raise InvalidTokensError(f"token ids must be 1-D, got shape {tuple(tensor.shape)}")
    try:
        # A CUDA tensor is copied to the host once; hashing needs host bytes anyway.
        return tensor.detach().cpu().numpy()  # type: ignore[no-any-return]
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        raise InvalidTokensError(f"token ids cannot be read from this tensor: {exc}") from None


def _refuse_bools(tokens: Sequence[Any], ids: npt.NDArray[Any]) -> None:
    """InvalidTokensError if a bool of ``tokens`` became an id in ``ids``.

    numpy and ``array`` turn True among ints into 1 silently. Only the 0s and 1s can
    have been bools, and prompts hold few of them: a vectorised pass finds them (~0.2 ns
    a token), and only those elements are looked at (a type check of every element
    would cost ~13 ns a token, as much as hashing it).
    """
    for index in np.flatnonzero((ids == 0) | (ids == 1)).tolist():
        if _is_bool(tokens[index]):
            raise InvalidTokensError(
                f"token ids must be integers, got the bool {tokens[index]!r} at position {index}"
            )


def _is_bool(value: object) -> bool:
    """A bool, or a one-element array or tensor of bools (which also pass as 0 or 1)."""
    if isinstance(value, (bool, np.bool_)):
        return True
    dtype = getattr(value, "dtype", None)
    return dtype is not None and (dtype == np.bool_ or str(dtype) == "torch.bool")


def _from_ints(tokens: Sequence[Any]) -> npt.NDArray[np.uint64] | None:
    """``tokens`` as uint64 through ``array('Q')``, or None to take the general path.

    Building an unsigned 64-bit ``array`` is the fastest conversion of Python ints
    measured here (~4.5 ns a token for 32k, vs ~11 for ``array('q')`` or
    ``np.fromiter`` and ~17 for ``np.array``: benchmarks/bench_storage.py), and it
    refuses what must be refused on the way: floats (TypeError), negative ids
    (OverflowError). Bools (which it takes as 0 and 1) are refused here, ids above
    int64 by :func:`as_token_array`; its other refusals fall back to the general path,
    which names the offending element.
    """
    try:
        raw = array.array("Q", tokens)
    except (TypeError, OverflowError, ValueError, DeprecationWarning):
        # DeprecationWarning: numpy's bools as indexes, raised where warnings are errors
        return None
    unsigned = np.frombuffer(raw, dtype=np.uint64)
    _refuse_bools(tokens, unsigned)
    return unsigned


def _is_torch_tensor(value: object) -> bool:
    module = type(value).__module__
    return module.startswith("torch") and hasattr(value, "is_floating_point")
