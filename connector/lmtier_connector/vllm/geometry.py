"""What a vLLM config says about the KV lmtier stores for it: the geometry of a worker's
chunks (:func:`kv_spec_of`), whether its KV cache groups can be cached
(:func:`check_kv_cache_groups`), the lmtier config (:func:`lmtier_config_of`) and the
worker's tensor-parallel rank (:func:`tp_rank_of`). Both halves of the connector call
these on the same config, so the scheduler's lookups and the workers' chunks agree.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vllm.config import VllmConfig
from vllm.utils.torch_utils import get_kv_cache_torch_dtype

from lmtier.config import LMTierConfig, load_config
from lmtier.errors import ConfigError
from lmtier.kv_spec import KVSpec
from lmtier_connector.vllm.common import ChunkLayout, ConnectorSettings
from lmtier_connector.vllm.pages import page_interior_of

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["check_kv_cache_groups", "kv_spec_of", "lmtier_config_of", "tp_rank_of"]


def kv_spec_of(
    vllm_config: VllmConfig,
    chunk_layout: ChunkLayout = "LKTHD",
    kv_cache_config: KVCacheConfig | None = None,
    page_interior: str | None = None,
) -> KVSpec:
    """The KV geometry of one worker: its layers, its share of the KV heads, its dtype,
    and how its chunks hold KV (``chunk_layout``; MLA is always ``LTD``, which already
    is its pages' token-major order).

    ``page_interior`` (default :func:`page_interior_of`) names the attention backend's
    arrangement of K and V inside a block: part of a ``page`` spec (and so of its
    namespace). The transcoded layouts (``LKTHD``, ``LTD``) read pages as ``flash``
    ones: on ``cpu_attn`` they are a ConfigError that names ``chunk_layout: page``.

    ``page`` follows the physical order vLLM resolved for its pages
    (``KVCacheConfig.kv_cache_layout``, else ``CacheConfig.kv_cache_layout``, else
    ``$VLLM_KV_CACHE_LAYOUT``): heads before slots (HND: ``LBHNC``, ``BLHNC``,
    ``LHBNC``, ``BHLNC``) gives ``LBHSC`` chunks, slots before heads (NHD) ``LBSHC``.
    Both halves read the same config, so they agree; where it is unknown, ``LBHSC`` (a
    different physical order is still copied right, with strided copies).
    """
    interior = page_interior_of(vllm_config) if page_interior is None else page_interior
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    if interior != "flash" and (model.use_mla or chunk_layout != "page"):
        what = "MLA models (always transcoded to LTD)" if model.use_mla else "LKTHD"
        raise ConfigError(
            f"LMTierConnector cannot transcode vLLM's {interior!r} pages (the CPU attention "
            f"backend) for {what}: set kv_connector_extra_config.chunk_layout to 'page'"
            + (" (and a model without MLA)" if model.use_mla else "")
        )
    dtype = get_kv_cache_torch_dtype(vllm_config.cache_config.cache_dtype, model.dtype)
    name = str(dtype).removeprefix("torch.")
    layers = model.get_num_layers(parallel)
    if model.use_mla:
        return KVSpec(layers, 1, model.get_head_size(), name, layout="LTD")
    heads = model.get_num_kv_heads(parallel)
    if chunk_layout != "page":
        return KVSpec(layers, heads, model.get_head_size(), name)
    order = (kv_cache_config.kv_cache_layout if kv_cache_config is not None else None) or (
        vllm_config.cache_config.kv_cache_layout or os.environ.get("VLLM_KV_CACHE_LAYOUT")
    )
    slots_first = order is not None and order.find("N") < order.find("H")
    layout = "LBSHC" if slots_first else "LBHSC"
    block_size = vllm_config.cache_config.block_size
    return KVSpec(
        layers,
        heads,
        model.get_head_size(),
        name,
        layout=layout,
        block_size=block_size,
        page_interior=interior,
    )


def check_kv_cache_groups(kv_cache_config: KVCacheConfig | None) -> None:
    """Refuse KV cache groups the connector cannot cache.

    One group of full attention (or MLA) layers is cached as one chunk per token range
    (every layer); several groups of full-attention and sliding-window layers (vLLM's
    hybrid allocator) are cached per group (:mod:`lmtier_connector.vllm.hybrid`).
    Anything else (Mamba/SSM state, chunked local attention, MLA beside other groups,
    groups of other block sizes) is a ConfigError naming the groups vLLM made.
    """
    if kv_cache_config is None:
        return
    from vllm.v1.kv_cache_interface import (  # noqa: PLC0415
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    groups = kv_cache_config.kv_cache_groups
    if len(groups) == 1 and type(groups[0].kv_cache_spec) in (FullAttentionSpec, MLAAttentionSpec):
        return
    hybrid = (FullAttentionSpec, SlidingWindowSpec)
    sizes = {group.kv_cache_spec.block_size for group in groups}
    if groups and len(sizes) == 1 and all(type(g.kv_cache_spec) in hybrid for g in groups):
        return
    described = "; ".join(
        f"group {index}: {type(group.kv_cache_spec).__name__} over "
        f"{len(group.layer_names)} layers ({', '.join(group.layer_names[:2])}"
        f"{', ...' if len(group.layer_names) > 2 else ''})"
        for index, group in enumerate(groups)
    )
    mamba = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)]
    why = (
        f"Mamba/SSM state groups ({', '.join(map(str, mamba))}) hold a recurrent state, "
        "not per-token KV, and are not cached"
        if mamba
        else "chunked local attention, MLA beside other groups and groups of different "
        "block sizes are not supported"
    )
    raise ConfigError(
        "LMTierConnector caches one group of full-attention (or MLA) layers, or groups of "
        f"full-attention and sliding-window layers of one block size; this model's KV "
        f"cache has {len(groups)} group(s): {described or 'none'}. {why}"
    )


def lmtier_config_of(settings: ConnectorSettings) -> LMTierConfig:
    """The lmtier config: file (or ``$LMTIER_CONFIG``) < ``LMTIER_*`` < extra config."""
    return load_config(settings.config_path, overrides=settings.config or None)


def tp_rank_of(vllm_config: VllmConfig) -> int:
    """This process's tensor-parallel rank (0 where no TP group exists: the scheduler,
    single-process setups and tests)."""
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # noqa: PLC0415

    try:
        return get_tensor_model_parallel_rank()
    except AssertionError:  # the scheduler process has no TP group
        return 0
