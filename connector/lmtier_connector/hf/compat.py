"""One place for what differs between transformers releases in how a causal LM takes
and returns its KV cache.

Up to 5.2x a model's forward takes ``past_key_values=`` and its output holds
``past_key_values``; later releases call both ``cache`` (the old names still work, with
a deprecation warning each call, until they are removed). lmtier supports
``transformers>=5.16``: every call that passes or reads a cache goes through here.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

__all__ = ["call_with_cache", "output_cache"]


@functools.lru_cache(maxsize=32)
def _cache_keyword(forward: Any) -> str:
    """The name a model class's ``forward`` takes the KV cache by."""
    parameters = inspect.signature(forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def call_with_cache(model: Any, input_ids: Any, cache: Any, **kwargs: Any) -> Any:
    """``model(input_ids, <cache keyword>=cache, **kwargs)``, by this release's name."""
    return model(input_ids, **{_cache_keyword(type(model).forward): cache}, **kwargs)


def output_cache(output: Any) -> Any:
    """The KV cache a forward pass returned (``output.cache`` or, before, its
    ``past_key_values``), without touching the deprecated name where a new one exists."""
    if "cache" in output:
        return output["cache"]
    return output["past_key_values"]
