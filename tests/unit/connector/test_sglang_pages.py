"""lmtier_connector.sglang.pages without SGLang: pools shaped as SGLang 0.5.23's
(``kv_buffer`` per layout, as its pool_host/mha.py and mla.py allocate it), their
pages viewed in the chunk layout of the pool's own order (KLTHD for MHA, LTD for MLA;
KTLHD and TLD for page_first), checked element by element against the pool's own
indexing and against SGLang's flat page order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lmtier.errors import ConfigError
from lmtier.kv_spec import layer_major
from lmtier_connector.sglang.pages import LAYOUTS, PoolPages


@dataclass
class FakeMHA:
    layout: str
    page_size: int = 16
    layer_num: int = 2
    head_num: int = 2
    head_dim: int = 4
    v_head_dim: int = 4
    pages: int = 3
    dtype: torch.dtype = torch.bfloat16
    kv_buffer: Any = field(init=False)

    def __post_init__(self) -> None:
        slots, L, H, D, P = (
            self.pages * self.page_size,
            self.layer_num,
            self.head_num,
            self.head_dim,
            self.page_size,
        )
        shape = {
            "layer_first": (2, L, slots, H, D),
            "page_first": (2, slots, L, H, D),
            "page_first_direct": (2, self.pages, L, P, H, D),
            "page_head": (2, self.pages, H, P, L, D),
        }[self.layout]
        self.kv_buffer = torch.arange(int(torch.Size(shape).numel())).to(self.dtype).view(shape)

    def element(self, kv: int, layer: int, slot: int, head: int, dim: int) -> Any:
        """SGLang's own indexing of one element (pool_host/mha.py's layouts)."""
        buf, P = self.kv_buffer, self.page_size
        if self.layout == "layer_first":
            return buf[kv, layer, slot, head, dim]
        if self.layout == "page_first":
            return buf[kv, slot, layer, head, dim]
        return buf[kv, slot // P, layer, slot % P, head, dim]

    def flat_page(self, start: int) -> torch.Tensor:
        """SGLang's flat page: [K,V][layer][token] for layer_first and page_first_direct,
        [K,V][token][layer] for page_first."""
        buf, P = self.kv_buffer, self.page_size
        if self.layout == "layer_first":
            return buf[:, :, start : start + P].flatten()
        if self.layout == "page_first":
            return buf[:, start : start + P].flatten()
        return buf[:, start // P].flatten()


@dataclass
class FakeMLA:
    layout: str
    page_size: int = 16
    layer_num: int = 3
    kv_cache_dim: int = 6
    pages: int = 3
    dtype: torch.dtype = torch.float32
    kv_buffer: Any = field(init=False)

    def __post_init__(self) -> None:
        slots, L, C, P = (
            self.pages * self.page_size,
            self.layer_num,
            self.kv_cache_dim,
            self.page_size,
        )
        shape = {
            "layer_first": (L, slots, 1, C),
            "page_first": (slots, L, 1, C),
            "page_first_direct": (self.pages, L, P, 1, C),
        }[self.layout]
        self.kv_buffer = torch.arange(int(torch.Size(shape).numel())).to(self.dtype).view(shape)

    def element(self, layer: int, slot: int, dim: int) -> Any:
        buf, P = self.kv_buffer, self.page_size
        if self.layout == "layer_first":
            return buf[layer, slot, 0, dim]
        if self.layout == "page_first":
            return buf[slot, layer, 0, dim]
        return buf[slot // P, layer, slot % P, 0, dim]

    def flat_page(self, start: int) -> torch.Tensor:
        buf, P = self.kv_buffer, self.page_size
        if self.layout == "layer_first":
            return buf[:, start : start + P].flatten()
        if self.layout == "page_first":
            return buf[start : start + P].flatten()
        return buf[start // P].flatten()


CHUNK_LAYOUTS = {"layer_first": "KLTHD", "page_first": "KTLHD", "page_first_direct": "KLTHD"}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_mha_page_view_holds_the_pools_own_elements_in_its_order(layout: str) -> None:
    pool = FakeMHA(layout)
    pages = PoolPages.of(pool)
    assert pages.spec.layout == CHUNK_LAYOUTS[layout] and not pages.mla
    for start in (0, 16, 32):
        view = pages.page(start)
        assert tuple(view.shape) == pages.spec.shape(pool.page_size)
        # a page is one run of K and one of V wherever the pool keeps a page together
        assert (view[0].is_contiguous() and view[1].is_contiguous()) == (layout != "layer_first")
        canonical = layer_major(view, pages.spec.layout)  # (L, K, T, H, D)
        for kv, layer, token, head, dim in [(0, 0, 0, 0, 0), (1, 1, 15, 1, 3), (1, 0, 7, 1, 2)]:
            got = canonical[layer, kv, token, head, dim]
            assert got == pool.element(kv, layer, start + token, head, dim)
        assert torch.equal(pages.flat(pool.flat_page(start)), view)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_mla_page_view_holds_the_pools_own_elements_in_its_order(layout: str) -> None:
    pool = FakeMLA(layout)
    pages = PoolPages.of(pool)
    assert pages.spec.layout == ("TLD" if layout == "page_first" else "LTD") and pages.mla
    for start in (0, 32):
        view = pages.page(start)
        assert tuple(view.shape) == pages.spec.shape(pool.page_size)
        assert view.is_contiguous() == (layout != "layer_first")
        canonical = layer_major(view, pages.spec.layout)  # (L, 1, T, 1, C)
        for layer, token, dim in [(0, 0, 0), (2, 15, 5), (1, 3, 4)]:
            assert canonical[layer, 0, token, 0, dim] == pool.element(layer, start + token, dim)
        assert torch.equal(pages.flat(pool.flat_page(start)), view)


@given(
    layout=st.sampled_from(LAYOUTS),
    order=st.permutations(range(4)),
    count=st.integers(0, 4),
)
def test_starts_take_whole_aligned_pages_in_any_order(
    layout: str, order: list[int], count: int
) -> None:
    pool = FakeMHA(layout, pages=4)
    pages = PoolPages.of(pool)
    chosen = order[:count]
    indices = torch.cat(
        [torch.arange(p * 16, p * 16 + 16) for p in chosen] or [torch.empty(0, dtype=torch.int64)]
    )
    assert pages.starts(indices, count) == [p * 16 for p in chosen]


@pytest.mark.parametrize(
    "indices",
    [
        torch.arange(1, 17),  # not aligned
        torch.arange(16).flip(0),  # slots out of order inside the page
        torch.arange(64, 80),  # beyond the pool's 64 slots
        torch.arange(8),  # half a page
    ],
)
def test_starts_refuse_what_is_not_whole_pages_of_the_pool(indices: torch.Tensor) -> None:
    pages = PoolPages.of(FakeMHA("page_first", pages=4))
    with pytest.raises(ValueError, match="host indices"):
        pages.starts(indices, 1)


def test_pools_lmtier_cannot_store_are_refused_naming_what_it_can() -> None:
    with pytest.raises(ConfigError, match=r"\['layer_first', 'page_first', 'page_first_direct'\]"):
        PoolPages.of(FakeMHA("page_head"))
    asymmetric = FakeMHA("page_first")
    asymmetric.v_head_dim = 8
    with pytest.raises(ConfigError, match="K heads of 4 and V heads of 8"):
        PoolPages.of(asymmetric)
    empty = FakeMHA("page_first")
    empty.kv_buffer = None
    with pytest.raises(ConfigError, match="holds no KV tensor"):
        PoolPages.of(empty)
    wrong = FakeMHA("page_first")
    wrong.head_num = 3  # the buffer says 2
    with pytest.raises(ConfigError, match="not SGLang's page_first MHA layout"):
        PoolPages.of(wrong)


def test_a_flat_page_of_the_wrong_size_dtype_or_strides_is_refused() -> None:
    pages = PoolPages.of(FakeMHA("layer_first"))
    with pytest.raises(ValueError, match="flat page"):
        pages.flat(torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="flat page"):
        pages.flat(torch.zeros(2 * 2 * 16 * 2 * 4, dtype=torch.float32))
    numel = 2 * 2 * 16 * 2 * 4
    with pytest.raises(ValueError, match="contiguous"):  # a load would land in a copy
        pages.flat(torch.zeros(2 * numel, dtype=torch.bfloat16)[::2])
    two_rows = torch.zeros(numel, dtype=torch.bfloat16).view(2, -1)  # any contiguous shape
    assert pages.flat(two_rows).shape == (2, 2, 16, 2, 4)
    assert pages.new_flat().numel() == numel
