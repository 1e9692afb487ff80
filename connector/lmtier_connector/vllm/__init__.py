"""The vLLM KV connector: ``kv_connector_module_path=lmtier_connector.vllm`` with
``kv_connector=LMTierConnector``.

A thin role-dispatching :mod:`~lmtier_connector.vllm.connector` beside the
:mod:`~lmtier_connector.vllm.scheduler` and :mod:`~lmtier_connector.vllm.worker`
halves and what they share (:mod:`~lmtier_connector.vllm.common`), as vLLM's own
offloading connector is laid out. Imported lazily: importing this package loads
neither vLLM nor torch until ``LMTierConnector`` is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmtier_connector.vllm.connector import LMTierConnector

__all__ = ["LMTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "LMTierConnector":
        from lmtier_connector.vllm.connector import LMTierConnector  # noqa: PLC0415

        return LMTierConnector
    raise AttributeError(f"module 'lmtier_connector.vllm' has no attribute {name!r}")
