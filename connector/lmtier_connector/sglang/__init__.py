"""SGLang: :class:`~lmtier_connector.sglang.backend.LMTierStorage`, lmtier as a HiCache
storage backend (``--hicache-storage-backend dynamic``; docs/sglang.md).

Imported lazily: :mod:`.pages` and :mod:`.settings` need no SGLang; the backend
subclasses SGLang's ``HiCacheStorage`` and imports SGLang when it is first named.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmtier_connector.sglang.backend import LMTierStorage, bind_page_hash

__all__ = ["LMTierStorage", "bind_page_hash"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from lmtier_connector.sglang import backend  # noqa: PLC0415

        return getattr(backend, name)
    raise AttributeError(f"module 'lmtier_connector.sglang' has no attribute {name!r}")
