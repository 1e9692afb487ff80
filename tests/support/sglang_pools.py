"""SGLang's real host KV pools and storage configs, built on the CPU, for the SGLang
backend's tests (tests/integration/connector/sglang).

The pools are SGLang 0.5.23's own ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``,
constructed as its engine does from "buffer info" records (device tensors, here on
the CPU: the pool reads only their geometry), with ``pin_memory=False`` (pinning needs
CUDA) and inside ``host_memory_budget_scope`` (else a pool reserves 10 GiB of the
machine's memory for itself). The backend is made through SGLang's
``StorageBackendFactory`` with ``dynamic``, as ``--hicache-storage-backend dynamic``
makes it, and attached as SGLang's cache controller attaches it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, PoolName
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

CPU = torch.device("cpu")
LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 8, 16
LORA, ROPE = 16, 8
DEVICE_TOKENS = 256
BACKEND = {
    "backend_name": "lmtier",
    "module_path": "lmtier_connector.sglang",
    "class_name": "LMTierStorage",
    "interface_v1": 1,
}


def _pointers(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_pool(
    layout: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    layers: int = LAYERS,
    heads: int = HEADS,
    head_dim: int = HEAD_DIM,
    page: int = PAGE,
    device_tokens: int = DEVICE_TOKENS,
    ratio: float = 2.0,
) -> Any:
    """An MHA host pool of ``layout`` (``ratio`` x the fake device's tokens)."""
    k = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros_like(t) for t in k)
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k, v=v, k_data_ptrs=_pointers(k), v_data_ptrs=_pointers(v), layout=KVBufferLayout.NHD
        ),
        page_size=page,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=dtype,
        device=CPU,
    )
    return _built(MHATokenToKVPoolHost, info, layout, page, device_tokens, ratio, layers)


def mla_pool(layout: str, *, dtype: torch.dtype = torch.bfloat16, page: int = PAGE) -> Any:
    """An MLA host pool of ``layout`` (latent of LORA + ROPE)."""
    rows = tuple(torch.zeros(DEVICE_TOKENS, 1, LORA + ROPE, dtype=dtype) for _ in range(LAYERS))
    info = MLABufferInfo(
        buffers=rows,
        data_ptrs=_pointers(rows),
        layer_indices=tuple(range(LAYERS)),
        device_layer_num=LAYERS,
        page_size=page,
        kv_lora_rank=LORA,
        qk_rope_head_dim=ROPE,
        kv_cache_dim=LORA + ROPE,
        dtype=dtype,
        device=CPU,
    )
    return _built(
        MLATokenToKVPoolHost,
        info,
        layout,
        page,
        DEVICE_TOKENS,
        2.0,
        LAYERS,
        target_layer_num=LAYERS,
    )


def _built(
    cls: Any, info: Any, layout: str, page: int, tokens: int, ratio: float, layers: int, **more: Any
) -> Any:
    """SGLang's host pool ``cls`` as its engine builds it, on the CPU (see above)."""
    with host_memory_budget_scope(1 << 36):
        return cls(
            info,
            ratio,
            0,
            page,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=tokens,
            start_layer=0,
            end_layer=layers,
            **more,
        )


def storage_config(
    extra: Mapping[str, Any],
    *,
    model: str = "org/model",
    mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    layout: str = "page_first",
    metrics: bool = False,
    **more: Any,
) -> HiCacheStorageConfig:
    """A storage config as SGLang's controller makes it, with ``extra`` as the extra
    config (the dynamic backend's keys added)."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=more.pop("pp_size", 1),
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=layout == "page_first",
        model_name=model,
        extra_config={**BACKEND, **extra},
        **more,
    )


def attach(config: HiCacheStorageConfig, pool: Any) -> HiCacheStorage:
    """Make the backend through SGLang's factory and attach ``pool`` as SGLang's cache
    controller does (its failure injector wraps it when the environment asks)."""
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    backend.register_mem_host_pool_v2(pool, PoolName.KV)
    backend.on_host_pools_registered()
    return backend


@contextmanager
def attached(config: HiCacheStorageConfig, pool: Any) -> Iterator[HiCacheStorage]:
    backend = attach(config, pool)
    try:
        yield backend
    finally:
        backend.close()


def fill_pages(pool: Any, count: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Allocate ``count`` pages of ``pool``, fill them with random KV; their host
    indices and each page's flat copy (SGLang's ``get_data_page``) to compare with."""
    indices = pool.alloc(count * pool.page_size)
    assert indices is not None, "the pool is full"
    generator = torch.Generator().manual_seed(seed)
    pages = []
    for at in range(count):
        first = int(indices[at * pool.page_size])
        flat = pool.get_dummy_flat_data_page()
        values = torch.randn(flat.numel(), generator=generator).to(flat.dtype)
        pool.set_from_flat_data_page(first, values)
        pages.append(pool.get_data_page(first, flat=True).clone())
    return indices, pages


def read_pages(pool: Any, indices: torch.Tensor) -> list[torch.Tensor]:
    """The flat pages of ``pool`` at ``indices``."""
    size = pool.page_size
    return [
        pool.get_data_page(int(indices[at * size]), flat=True).clone()
        for at in range(indices.numel() // size)
    ]


def hashes(count: int, seed: str = "a") -> list[str]:
    """``count`` page hashes shaped as SGLang's (64 hex digits), distinct per seed."""
    import hashlib

    return [hashlib.sha256(f"{seed}:{at}".encode()).hexdigest() for at in range(count)]


def assert_equal_pages(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Bit for bit, page by page."""
    assert len(got) == len(want)
    for at, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"page {at} differs"


def assert_same_kv(
    pool: Any, flat_pages: list[torch.Tensor], other: Any, other_pages: list[torch.Tensor]
) -> None:
    """Flat pages of two pools, each in its own layout's order, hold the same KV."""
    from lmtier.kv_spec import layer_major
    from lmtier_connector.sglang.pages import PoolPages

    ours, theirs = PoolPages.of(pool), PoolPages.of(other)
    assert_equal_pages(
        [layer_major(ours.flat(p), ours.spec.layout).contiguous() for p in flat_pages],
        [layer_major(theirs.flat(p), theirs.spec.layout).contiguous() for p in other_pages],
    )
