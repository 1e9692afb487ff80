"""What vLLM's KV pages hold inside a block, by platform and attention backend.

The connector's ``page`` chunks are block copies of vLLM's pages, so their bytes are
whatever the attention backend put there: vLLM's GPU backends (FlashAttention, Triton,
FlexAttention, FlashInfer) hold each slot's K then V on the last axis of a block, its
CPU backend (``CPU_ATTN``) a K region then a V region per block and head, in the same
shape. The interior (:data:`lmtier.kv_spec.PAGE_INTERIORS`) is part of a page chunk's
namespace, so engines of both kinds sharing a tier never load each other's pages:
:func:`page_interior_of` says which one this platform's engine holds, and
:func:`check_page_interior` checks a worker's layers against it.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm.config import VllmConfig

from lmtier.errors import ConfigError

__all__ = ["BACKEND_INTERIORS", "check_page_interior", "page_interior_of"]

BACKEND_INTERIORS = {
    "FLASH_ATTN": "flash",
    "TRITON_ATTN": "flash",
    "FLEX_ATTENTION": "flash",
    "FLASHINFER": "flash",
    "CPU_ATTN": "cpu_attn",
}
"""The page interior (:data:`lmtier.kv_spec.PAGE_INTERIORS`) of each vLLM attention
backend (``get_name()``) whose K/V pages the connector knows."""


def page_interior_of(vllm_config: VllmConfig) -> str:
    """How the attention backend vLLM runs on this platform lays K and V out inside a
    page block: ``"cpu_attn"`` on vLLM's CPU platform (whose only K/V backend is
    ``CPU_ATTN``, whatever backend was asked for), ``"flash"`` on CUDA. Any other
    platform is a ConfigError: its backends' pages (ROCm's packed ones, for one) are
    not known to the connector, and guessing would mislabel chunks in a shared tier.
    Both halves call it (unless ``kv_connector_extra_config.page_interior`` declares the
    interior), so the scheduler's lookups and the workers' chunks agree; the workers
    check it against their layers' backends (:func:`check_page_interior`)."""
    del vllm_config  # the platform decides; the config's backend choice is a request
    from vllm.platforms import current_platform  # noqa: PLC0415

    if current_platform.is_cpu():
        return "cpu_attn"
    if current_platform.is_cuda():
        return "flash"
    raise ConfigError(
        f"LMTierConnector knows the KV pages of vLLM's CUDA and CPU attention backends; "
        f"this platform is {type(current_platform).__name__} (if its attention backend "
        f"holds one of those page interiors, set kv_connector_extra_config.page_interior)"
    )


def check_page_interior(interior: str, backend_names: Iterable[str]) -> None:
    """ConfigError unless every attention backend in ``backend_names`` (vLLM's
    ``get_name()`` of this worker's layers) holds pages with ``interior``."""
    for name in sorted(set(backend_names)):
        found = BACKEND_INTERIORS.get(name)
        if found != interior:
            known = ", ".join(f"{k} ({v})" for k, v in BACKEND_INTERIORS.items())
            raise ConfigError(
                f"vLLM's attention backend {name} does not hold the {interior!r} page "
                f"interior the connector keys chunks by (from vLLM's platform, or "
                f"kv_connector_extra_config.page_interior); the connector knows {known}"
            )
