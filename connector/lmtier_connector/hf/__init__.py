"""HF transformers: :class:`~lmtier_connector.hf.adapter.CachedCausalLM` (a prefill that
loads the cached prefix), and ``lmtier demo`` with its small random model.

Imported lazily: ``lmtier --help`` registers the demo through :mod:`.cli` without
loading torch or transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmtier_connector.hf.adapter import CachedCausalLM, PrefillResult, kv_spec_of

__all__ = ["CachedCausalLM", "PrefillResult", "kv_spec_of"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from lmtier_connector.hf import adapter  # noqa: PLC0415

        return getattr(adapter, name)
    raise AttributeError(f"module 'lmtier_connector.hf' has no attribute {name!r}")
