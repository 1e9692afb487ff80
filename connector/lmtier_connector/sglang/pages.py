"""SGLang's host-pool pages as lmtier chunks: one HiCache page is one chunk.

SGLang's host KV pool (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) keeps every
layer's KV in one tensor, ``kv_buffer``, whose shape depends on its layout
(``--hicache-mem-layout``); a page is ``page_size`` consecutive token slots starting
at a multiple of ``page_size``. lmtier stores each page in the chunk layout whose
order is the pool's own, so that a page is copied in runs as long as the pool keeps
them (``page_first``'s page is one run of each of K and V, not one per token and
layer):

=====================  =============================  ==================  ==========
pool                   ``kv_buffer``                  a page's view        chunk
=====================  =============================  ==================  ==========
MHA layer_first        (2, L, slots, H, D)            [:, :, s:s+P]        KLTHD
MHA page_first         (2, slots, L, H, D)            [:, s:s+P]           KTLHD
MHA page_first_direct  (2, pages, L, P, H, D)         [:, s // P]          KLTHD
MLA layer_first        (L, slots, 1, C)               [:, s:s+P, 0]        LTD
MLA page_first         (slots, L, 1, C)               [s:s+P, :, 0]        TLD
MLA page_first_direct  (pages, L, P, 1, C)            [s // P, :, :, 0]    LTD
=====================  =============================  ==================  ==========

The chunk layout is part of the namespace: ``layer_first`` and ``page_first_direct``
servers share pages, ``page_first`` servers share theirs, and no layout's bytes are
ever read as another's. Every view is a strided view into the pool (no copy): a
store copies each page once, from the pool into its slab, and a load once, from the
slab into the pool. SGLang's
*flat* pages (``get_data_page``/``get_dummy_flat_data_page``, its older API) hold the
same page in the pool's own flat order; :meth:`PoolPages.flat` views them in the
chunk layout too. Other layouts (``page_head``, ``page_unified``,
``page_first_kv_split``), K and V of different head sizes, and pools without data are
refused with an error that names what is supported.

No SGLang import here: the pool is read through the attributes every host pool has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lmtier.errors import ConfigError
from lmtier.kv_spec import KVSpec

__all__ = ["LAYOUTS", "PoolPages"]

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
"""The host-pool layouts whose pages lmtier stores."""


@dataclass(frozen=True, slots=True)
class PoolPages:
    """How the pages of one SGLang host pool map to lmtier chunks (module docstring)."""

    layout: str
    page_size: int
    mla: bool
    spec: KVSpec
    buffer: torch.Tensor

    @classmethod
    def of(cls, pool: Any) -> PoolPages:
        """The page map of SGLang host pool ``pool``; ConfigError for a pool lmtier
        cannot store (naming what it can)."""
        name = type(pool).__name__
        layout = getattr(pool, "layout", None)
        if layout not in LAYOUTS:
            raise ConfigError(
                f"lmtier stores pages of the host-pool layouts {list(LAYOUTS)}; this "
                f"{name} has {layout!r}: start SGLang with --hicache-mem-layout page_first "
                "(or layer_first, page_first_direct)"
            )
        buffer = getattr(pool, "kv_buffer", None)
        if not isinstance(buffer, torch.Tensor):
            raise ConfigError(
                f"this {name} holds no KV tensor (kv_buffer is {type(buffer).__name__}): "
                "lmtier needs a host pool with its pages in host memory"
            )
        if buffer.device.type != "cpu":
            raise ConfigError(f"this {name}'s kv_buffer is on {buffer.device}, not in host memory")
        page_size, layers = int(pool.page_size), int(pool.layer_num)
        dtype = str(buffer.dtype).removeprefix("torch.")
        mla = hasattr(pool, "kv_cache_dim") and not hasattr(pool, "head_num")
        token_major = layout == "page_first"
        if mla:
            chunk_layout = "TLD" if token_major else "LTD"
            spec = KVSpec(layers, 1, int(pool.kv_cache_dim), dtype, layout=chunk_layout)
        else:
            head_dim, v_head_dim = (
                int(pool.head_dim),
                int(getattr(pool, "v_head_dim", pool.head_dim)),
            )
            if head_dim != v_head_dim:
                raise ConfigError(
                    f"this {name} has K heads of {head_dim} and V heads of {v_head_dim}: "
                    "lmtier stores pages whose K and V have one head size"
                )
            chunk_layout = "KTLHD" if token_major else "KLTHD"
            spec = KVSpec(layers, int(pool.head_num), head_dim, dtype, layout=chunk_layout)
        pages = cls(layout, page_size, mla, spec, buffer)
        if tuple(buffer.shape) != pages._shape():
            raise ConfigError(
                f"this {name}'s kv_buffer has shape {tuple(buffer.shape)}, not SGLang's "
                f"{layout} {'MLA' if mla else 'MHA'} layout of {spec} in pages of {page_size}"
            )
        return pages

    def _shape(self) -> tuple[int, ...]:
        """The shape ``kv_buffer`` has in this layout (its slot or page count read off
        the buffer itself): a pool this module would misread is refused, not served."""
        spec, size, dims = self.spec, self.page_size, self.buffer.shape
        layers, inner = spec.num_layers, (spec.num_kv_heads, spec.head_dim)
        if self.mla:
            inner = (1, spec.head_dim)
            shapes = {
                "layer_first": (layers, dims[1] if len(dims) > 1 else -1, *inner),
                "page_first": (dims[0], layers, *inner),
                "page_first_direct": (dims[0], layers, size, *inner),
            }
        else:
            shapes = {
                "layer_first": (2, layers, dims[2] if len(dims) > 2 else -1, *inner),
                "page_first": (2, dims[1] if len(dims) > 1 else -1, layers, *inner),
                "page_first_direct": (2, dims[1] if len(dims) > 1 else -1, layers, size, *inner),
            }
        return tuple(int(d) for d in shapes[self.layout])

    @property
    def page_bytes(self) -> int:
        """Bytes of KV in one page."""
        return self.spec.bytes_per_token * self.page_size

    def page(self, start: int) -> torch.Tensor:
        """A view of the page whose first token slot is ``start``, in the chunk layout."""
        buf, size = self.buffer, self.page_size
        if self.mla:
            if self.layout == "layer_first":
                return buf[:, start : start + size, 0]
            if self.layout == "page_first":
                return buf[start : start + size, :, 0]
            return buf[start // size, :, :, 0]
        if self.layout == "layer_first":
            return buf[:, :, start : start + size]
        if self.layout == "page_first":
            return buf[:, start : start + size]
        return buf[:, start // size]

    def new_flat(self) -> torch.Tensor:
        """A new flat page of this pool (what SGLang's ``get_dummy_flat_data_page``
        gives), for a load whose caller gave none."""
        return torch.empty(self.page_bytes // self.buffer.element_size(), dtype=self.buffer.dtype)

    def flat(self, flat: torch.Tensor) -> torch.Tensor:
        """A view of ``flat``, one page in SGLang's flat order for this pool
        (``get_data_page(flat=True)``), in the chunk layout; ValueError if it is not
        one."""
        spec, size = self.spec, self.page_size
        numel = self.page_bytes // self.buffer.element_size()
        if flat.dtype != self.buffer.dtype or flat.numel() != numel:
            raise ValueError(
                f"a flat page of this pool holds {numel} {self.buffer.dtype} "
                f"elements; got {flat.numel()} {flat.dtype}"
            )
        if not flat.is_contiguous():  # a load into a reshaped copy would be lost
            raise ValueError("a flat page must be one contiguous tensor")
        return flat.view(spec.shape(size))  # a flat page is in the pool's own order

    def starts(self, host_indices: torch.Tensor, count: int) -> list[int]:
        """The first token slot of each of ``count`` pages in ``host_indices`` (SGLang's
        ``len(keys) * page_size`` slot ids); ValueError unless they are whole,
        page-aligned pages of this pool."""
        size = self.page_size
        indices = host_indices.reshape(-1).to("cpu", torch.int64)
        if indices.numel() != count * size:
            raise ValueError(
                f"{count} pages of {size} slots need {count * size} host indices, "
                f"got {indices.numel()}"
            )
        if count == 0:
            return []
        slots = indices.view(count, size)
        firsts = slots[:, 0]
        limit = self._slots()
        if (
            bool((firsts % size != 0).any())
            or bool((firsts < 0).any())
            or bool((firsts + size > limit).any())
            or not torch.equal(slots - firsts[:, None], torch.arange(size).expand(count, size))
        ):
            raise ValueError(
                f"host indices are not whole pages of {size} slots within the pool's {limit}"
            )
        return [int(s) for s in firsts.tolist()]

    def _slots(self) -> int:
        """Token slots in the pool."""
        dims = self.buffer.shape
        if self.layout == "page_first_direct":
            return int(dims[0 if self.mla else 1]) * self.page_size
        if self.mla:
            return int(dims[1] if self.layout == "layer_first" else dims[0])
        return int(dims[2] if self.layout == "layer_first" else dims[1])
