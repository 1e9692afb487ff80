"""Token ids in any form a caller may hand over: either the ids they mean, as one flat
int64 array, or InvalidTokensError, never another exception and never other ids.

A property test: inputs are drawn from lists of many kinds of elements, numpy arrays
of many dtypes, byte orders and shapes, and torch tensors of many dtypes, shapes,
devices and layouts; what each should give is computed here in plain Python."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmtier.chunks.tokens import MAX_TOKEN_ID, as_token_array
from lmtier.errors import InvalidTokensError

REFUSED = None
"""What the oracle expects for an input that must be refused."""

ids = st.integers(min_value=0, max_value=MAX_TOKEN_ID)
wild_ints = st.one_of(ids, st.integers(min_value=-(2**70), max_value=2**70))

INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
NUMPY_DTYPES = [
    *INT_DTYPES,
    *(f">{d[0]}{np.dtype(d).itemsize}" for d in INT_DTYPES if d != "int8" and d != "uint8"),
    *("float32", "float64", "bool", "complex64", "object", "U3", "datetime64[s]"),
]
TORCH_INT = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
TORCH_OTHER = [torch.float16, torch.float32, torch.bool, torch.complex64]


def _in_range(value: int) -> bool:
    return 0 <= value <= MAX_TOKEN_ID


# --- list elements: (the element, the id it stands for or REFUSED) ------------------------


@st.composite
def elements(draw: st.DrawFn) -> tuple[Any, int | None]:
    value = draw(wild_ints)
    kind = draw(st.sampled_from(["int", "np", "np0d", "tensor0d", "tensor1", "bad"]))
    if kind == "int":
        return value, value if _in_range(value) else REFUSED
    if kind in ("np", "np0d") and -(2**63) <= value < 2**63:
        scalar = np.int64(value)
        return (scalar if kind == "np" else np.array(scalar)), value if value >= 0 else REFUSED
    if kind.startswith("tensor") and -(2**63) <= value < 2**63:
        tensor = torch.tensor(value if kind == "tensor0d" else [value], dtype=torch.int64)
        return tensor, value if value >= 0 else REFUSED
    bad = draw(
        st.sampled_from(
            [
                *(True, False, np.True_, 1.0, 2.5, float("nan"), None, "7", b"7", [1, 2], [0]),
                *(np.array([3]), torch.tensor(True), torch.tensor([False]), torch.tensor(1.0)),
            ]
        )
    )
    return bad, REFUSED


@st.composite
def token_lists(draw: st.DrawFn) -> tuple[Any, list[int] | None]:
    pairs = draw(st.lists(elements(), max_size=12))
    tokens = [element for element, _ in pairs]
    meant = [value for _, value in pairs]
    if draw(st.booleans()):
        tokens_out: Any = tuple(tokens)
    else:
        tokens_out = tokens
    if any(value is REFUSED for value in meant):
        return tokens_out, REFUSED
    return tokens_out, [int(v) for v in meant if v is not None]


@st.composite
def nested_lists(draw: st.DrawFn) -> tuple[Any, None]:
    rows = draw(st.integers(1, 3))
    width = draw(st.integers(0, 3))
    return [[draw(ids) for _ in range(width)] for _ in range(rows)], REFUSED


# --- numpy arrays ---------------------------------------------------------------------


@st.composite
def numpy_arrays(draw: st.DrawFn) -> tuple[Any, list[int] | None]:
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    shape = draw(st.sampled_from([(), (0,), (1,), (5,), (2, 3), (1, 4), (0, 2)]))
    count = int(np.prod(shape))
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        values = draw(
            st.lists(st.integers(int(info.min), int(info.max)), min_size=count, max_size=count)
        )
        array = np.array(values, dtype=dtype).reshape(shape)
    elif dtype.kind == "U":
        array = np.array(["1"] * count, dtype=dtype).reshape(shape)
    elif dtype.kind == "M":
        array = np.zeros(shape, dtype=dtype)
    else:
        array = np.ones(shape, dtype=dtype)
    if draw(st.booleans()) and array.ndim == 1 and len(array) > 1:
        array = array[::2]  # not contiguous
    if dtype.kind not in "iu" or array.ndim != 1:
        return array, REFUSED if array.size or array.ndim != 1 else []
    ids_meant = [int(v) for v in array.tolist()]
    return array, ids_meant if all(_in_range(v) for v in ids_meant) else REFUSED


# --- torch tensors --------------------------------------------------------------------


@st.composite
def tensors(draw: st.DrawFn) -> tuple[Any, list[int] | None]:
    dtype = draw(st.sampled_from(TORCH_INT + TORCH_OTHER))
    shape = draw(st.sampled_from([(), (0,), (1,), (6,), (2, 3)]))
    count = int(np.prod(shape))
    if dtype in TORCH_INT:
        info = torch.iinfo(dtype)
        values = draw(st.lists(st.integers(info.min, info.max), min_size=count, max_size=count))
        tensor = torch.tensor(values, dtype=dtype).reshape(shape)
    else:
        tensor = torch.ones(shape, dtype=dtype)
    form = draw(st.sampled_from(["plain", "meta", "sparse", "grad"]))
    if form == "meta":
        return tensor.to("meta"), REFUSED
    if form == "sparse" and tensor.dim() >= 1:
        return tensor.to_sparse(), REFUSED
    if form == "grad" and dtype.is_floating_point:
        tensor = tensor.requires_grad_()
    if dtype not in TORCH_INT or tensor.dim() != 1:
        return tensor, REFUSED
    meant = [int(v) for v in tensor.tolist()]
    return tensor, meant if all(_in_range(v) for v in meant) else REFUSED


ANY_INPUT = st.one_of(token_lists(), nested_lists(), numpy_arrays(), tensors())


@settings(max_examples=400, deadline=None)
@given(case=ANY_INPUT)
def test_token_ids_are_what_the_caller_meant_or_a_clear_error(
    case: tuple[Any, list[int] | None],
) -> None:
    tokens, meant = case
    if meant is REFUSED:
        with pytest.raises(InvalidTokensError) as info:
            as_token_array(tokens)
        assert "\n" not in str(info.value)
        return
    result = as_token_array(tokens)
    assert result.dtype == np.int64 and result.ndim == 1 and result.flags.c_contiguous
    assert result.tolist() == meant


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([[0, 0], [0, 0]], "flat sequence"),  # was an IndexError
        (torch.zeros(4, dtype=torch.long, device="meta"), "meta tensor"),  # NotImplementedError
        (torch.zeros(3, dtype=torch.long).to_sparse(), "dense tensor"),  # TypeError
        (np.ma.array([1, 2], mask=[False, True]), "masked"),
        ([torch.tensor(True), 1], "bool"),  # was taken as id 1
    ],
)
def test_odd_inputs_that_raised_other_errors(tokens: Any, message: str) -> None:
    with pytest.raises(InvalidTokensError, match=message):
        as_token_array(tokens)


def test_a_big_endian_array_gives_the_ids_it_holds() -> None:
    # Its bytes viewed as this machine's int64 were other ids: 5 hashed as 5 << 56.
    for dtype in (">u8", ">i8", ">u4"):
        assert as_token_array(np.array([5, 2**31], dtype=dtype)).tolist() == [5, 2**31]


def test_a_plain_array_is_taken_without_asking_numpy_ma(monkeypatch: pytest.MonkeyPatch) -> None:
    """``np.ma`` is imported lazily (~30 ms): the first load of a new process paid it."""

    class Untouchable:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"np.ma.{name} was asked about a plain ndarray")

    monkeypatch.setattr(np, "ma", Untouchable())
    assert as_token_array(np.arange(3)).tolist() == [0, 1, 2]
