"""Hybrid models (vLLM's hybrid KV cache allocator, ``SupportsHMA``): KV cache groups.

vLLM gives a model whose layers attend differently (full attention beside sliding
window: Gemma-2/3, Mistral-style and Qwen2 configs with ``sliding_window``) one KV cache
group per kind of layer, each with its own block table; a sliding-window group holds
null blocks below the window of the request's next token. The connector caches such
a model per group (one :class:`KVGroup` each):

* **Keys and bytes.** Each group's chunks hold that group's layers only, so each group
  has its own :class:`~lmtier.kv_spec.KVSpec` (its layers, its heads and head size)
  and its own namespace: the model revision gains a suffix naming the group (its
  index among the groups, its kind, its window, a digest of its layer names,
  :func:`group_revision`), so two groups of equal geometry never share a key, and
  the same model always gets the same keys. Each group has its own
  :class:`~lmtier.api.LMTier` (its host pool holds slabs of its own size); the CPU
  tier's ``capacity_bytes`` and ``staging_bytes`` are split among the groups in
  proportion to their bytes per token (:func:`group_configs`), so the host memory taken
  stays what the config says; every other tier is shared (the disk tier keeps processes
  sharing its path within its capacity together; Redis and S3 keys differ by
  namespace). Models of one KV cache group (full attention, MLA) are cached as they
  always were: same spec, same namespace, same keys.
* **Saves.** Full-attention groups save every chunk, as a single-group model does. A
  sliding-window group saves only the chunks inside the windows before the request's
  prompt anchors (:class:`~lmtier_connector.vllm.common.SaveWindow`): at most
  ``ceil((window - 1) / chunk_size) + 1`` chunks per prompt, whatever its length.
* **Hits** (:mod:`~lmtier_connector.vllm.hybrid_scheduler`): the most leading chunks
  for which every group has what vLLM will read: full-attention groups every chunk
  from vLLM's local hit to the hit's end, sliding-window groups the chunks covering
  the window before the hit's end. Loads write a sliding-window group's blocks from
  the first one vLLM holds for that hit (never its null blocks).
* **Mamba/SSM state groups** are refused (:func:`~lmtier_connector.vllm.geometry.
  check_kv_cache_groups`): their state is one snapshot per request, not per-token KV.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from lmtier.config import LMTierConfig
from lmtier.errors import ConfigError
from lmtier.kv_spec import KVSpec
from lmtier_connector.vllm.common import LMTierConnectorMetadata, SaveWindow

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "HybridMetadata",
    "KVGroup",
    "group_configs",
    "group_revision",
    "is_hybrid",
    "kv_groups_of",
]


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One of vLLM's KV cache groups as the connector caches it."""

    index: int
    layer_names: tuple[str, ...]
    spec: KVSpec  # this group's layers only
    kind: str  # "full_attention" or "sliding_window" (vLLM's KVCacheSpecKind values)
    sliding_window: int | None = None
    window: SaveWindow | None = None  # sliding-window groups: which chunks they keep


@dataclass(slots=True)
class HybridMetadata(LMTierConnectorMetadata):
    """One step's plan for a hybrid model: one plan per KV cache group (its loads and
    saves, with that group's block ids); the inherited lists stay empty."""

    groups: list[LMTierConnectorMetadata] = field(default_factory=list)


def is_hybrid(kv_cache_config: KVCacheConfig | None) -> bool:
    """Whether the connector caches this model per KV cache group: anything but one
    group of full attention or MLA (checked by ``check_kv_cache_groups`` first)."""
    if kv_cache_config is None:
        return False
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec  # noqa: PLC0415

    groups = kv_cache_config.kv_cache_groups
    single = (FullAttentionSpec, MLAAttentionSpec)
    return not (len(groups) == 1 and type(groups[0].kv_cache_spec) in single)


def kv_groups_of(base: KVSpec, kv_cache_config: KVCacheConfig, chunk_size: int) -> list[KVGroup]:
    """The groups of a hybrid model: ``base`` (what ``kv_spec_of`` says of the whole
    model: layout, dtype, page block size and interior) narrowed to each group's layers,
    heads and head size."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec  # noqa: PLC0415

    if base.layout == "LTD":
        raise ConfigError("LMTierConnector caches MLA models of one KV cache group only")
    groups = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        head_size = int(spec.head_size)  # type: ignore[attr-defined]
        if int(getattr(spec, "head_size_v", head_size)) != head_size:
            raise ConfigError(
                f"KV cache group {index} has K heads of {head_size} and V heads of "
                f"{spec.head_size_v}: LMTierConnector caches K and V of one size"  # type: ignore[attr-defined]
            )
        narrowed = replace(
            base,
            num_layers=len(group.layer_names),
            num_kv_heads=int(spec.num_kv_heads),  # type: ignore[attr-defined]
            head_dim=head_size,
        )
        if isinstance(spec, SlidingWindowSpec):
            reach = spec.sliding_window - 1 + int(getattr(spec, "extra_retained_tokens", 0))
            window = SaveWindow(max(reach, 0), spec.block_size, chunk_size)
            groups.append(
                KVGroup(
                    index,
                    tuple(group.layer_names),
                    narrowed,
                    "sliding_window",
                    spec.sliding_window,
                    window,
                )
            )
        else:
            groups.append(KVGroup(index, tuple(group.layer_names), narrowed, "full_attention"))
    return groups


def group_revision(revision: str, group: KVGroup, num_groups: int) -> str:
    """The model revision that names ``group``'s namespace: ``revision`` plus the
    group's place, kind, window and a digest of its layer names (all of which change
    what its chunks hold)."""
    names = hashlib.blake2b("\n".join(group.layer_names).encode(), digest_size=8).hexdigest()
    window = f":window={group.sliding_window}" if group.sliding_window is not None else ""
    return f"{revision}#kv-group={group.index}/{num_groups}:{group.kind}{window}:layers={names}"


def group_configs(config: LMTierConfig, groups: Sequence[KVGroup]) -> list[LMTierConfig]:
    """``config`` for each group's cache: the CPU tier's capacity and staging memory
    split in proportion to the groups' bytes per token (staging at least one chunk of
    the group), every other setting as it is."""
    total = sum(group.spec.bytes_per_token for group in groups)
    cpu = config.cpu
    configs = []
    for group in groups:
        share = group.spec.bytes_per_token / total
        one_chunk = group.spec.encoded_chunk_bytes(config.chunk_size)
        section = cpu.replace(
            capacity_bytes=int(cpu.capacity_bytes * share),
            staging_bytes=max(int(cpu.staging_bytes * share), one_chunk),
        )
        configs.append(config.replace(cpu=section))
    return configs
