"""``lmtier warm --model``: compute prompts' KV with a local transformers model, store it.

A prompt some of whose chunks are cached already goes through the HF adapter
(:class:`~lmtier_connector.hf.adapter.CachedCausalLM`): its cached prefix is loaded,
only the rest is computed, and the new chunks are stored. Prompts with nothing
cached are prefilled together, ``batch_size`` at a time, right-padded to the longest
one: with causal attention a token never sees the padding after it, so each prompt's
KV for its own positions is what it would be alone (up to the last bits of float
rounding, since a batched matrix product may sum in another order; an engine batching
prefills does the same). Only full chunks are stored; the last, partial chunk of a
prompt is never cached (the engine recomputes it, and its last token, anyway).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmtier.api import LMTier
from lmtier.kv_spec import LayerKV
from lmtier_apps.warm.run import WarmItem
from lmtier_connector.hf.adapter import CachedCausalLM
from lmtier_connector.hf.compat import output_cache

__all__ = ["ModelWarmer", "WarmItem"]


class ModelWarmer:
    """Computes and stores the KV of prompts with ``model`` into ``cache`` (module
    docstring): a :class:`~lmtier_apps.warm.run.Warmer`. One thread at a time,
    like the model."""

    def __init__(self, model: object, cache: LMTier, *, batch_size: int = 1) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.cache = cache
        self.batch_size = batch_size
        self.adapter = CachedCausalLM(model, cache)
        self.device = self.adapter.device

    def warm(self, items: Sequence[WarmItem], cache_salt: str = "") -> None:
        """Compute and store every item (``stored_chunks``, ``computed_tokens`` set)."""
        fresh = [item for item in items if item.cached_chunks == 0]
        for item in items:
            if item.cached_chunks or self.batch_size == 1:
                result = self.adapter.prefill(item.tokens, cache_salt=cache_salt)
                item.stored_chunks = result.num_stored_chunks
                item.computed_tokens = result.num_prompt_tokens - result.num_cached_tokens
        if self.batch_size > 1:
            for start in range(0, len(fresh), self.batch_size):
                self._warm_batch(fresh[start : start + self.batch_size])

    def _warm_batch(self, batch: Sequence[WarmItem]) -> None:
        chunk_size = self.cache.chunk_size
        # Only the full chunks matter: the tail after the last one is not computed.
        lengths = [len(item.keys) * chunk_size for item in batch]
        longest = max(lengths)
        if longest == 0:
            return
        ids = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, (item, length) in enumerate(zip(batch, lengths, strict=True)):
            ids[row, :length] = torch.tensor(item.tokens[:length], dtype=torch.long)
            mask[row, :length] = 1
        with torch.inference_mode():
            out = self.adapter.model(
                ids.to(self.device),
                attention_mask=mask.to(self.device),
                use_cache=True,
                logits_to_keep=1,
            )
        layers = _layers(output_cache(out))
        for row, (item, length) in enumerate(zip(batch, lengths, strict=True)):
            if not length:
                continue
            kv: list[LayerKV] = [
                (k[row, :, :length].transpose(0, 1), v[row, :, :length].transpose(0, 1))
                for k, v in layers
            ]
            item.stored_chunks = self.cache.store_keys(item.keys, kv, skip=0)
            item.computed_tokens = length


def _layers(past: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) of each layer of a transformers cache, each (batch, heads, tokens, dim)."""
    pairs = []
    for layer in getattr(past, "layers", ()):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise TypeError(f"unexpected transformers cache layer {type(layer).__name__}")
        pairs.append((keys, values))
    if not pairs:
        raise TypeError(f"unexpected transformers cache {type(past).__name__}: no layers")
    return pairs
