"""HF transformers adapter: a causal LM whose prefill skips the cached prefix.

:class:`CachedCausalLM` wraps a transformers causal LM (Llama architecture first)
and an :class:`~lmtier.api.LMTier`. A prefill:

1. looks the prompt up in every tier, at most ``len(prompt) - 1`` tokens (the last
   prompt token is always recomputed: its logits are the point of the prefill);
2. loads the hit prefix and builds a ``DynamicCache`` from it, one (K, V) pair per
   layer, copied once out of the pool slabs (which are released at once);
3. runs the model on the suffix only, with that cache as ``past_key_values``;
   transformers derives the positions of the suffix from the cache length;
4. stores the new full chunks (CPU tier now, lower tiers in the background), after
   the logits are ready, so storing never delays the first token.

With fp32 weights the logits equal those of a full prefill without lmtier: the
attention of the suffix reads the same K and V, whether computed or loaded.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from lmtier.api import LMTier
from lmtier.kv_spec import KVSpec, LayerKV

__all__ = ["CachedCausalLM", "PrefillResult", "kv_spec_of"]


def kv_spec_of(model: Any) -> KVSpec:
    """The KV geometry of a transformers causal LM (fp32/fp16/bf16 from its weights)."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return KVSpec.from_hf_config(model.config, dtype=dtype)


@dataclass(slots=True)
class PrefillResult:
    """What one prefill produced and how much the cache saved.

    ``logits``: the last prompt token's logits (vocab,). ``past_key_values``: the
    whole prompt's KV, to continue decoding. ``ttft_s``: from the call to the logits.
    """

    logits: torch.Tensor
    past_key_values: DynamicCache
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float
    tokens_by_tier: dict[str, int] = field(default_factory=dict)
    num_stored_chunks: int = 0


class CachedCausalLM:
    """A causal LM with lmtier in front of its prefill. See the module docstring."""

    def __init__(self, model: Any, cache: LMTier | None) -> None:
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device

    def prefill(
        self, prompt: Sequence[int], *, cache_salt: str = "", store: bool = True
    ) -> PrefillResult:
        """Prefill ``prompt`` (token ids), reusing cached KV; see the module docstring."""
        started = time.perf_counter()
        ids = list(prompt)
        if not ids:
            raise ValueError("cannot prefill an empty prompt")
        past, cached, tiers = self._load_prefix(ids, cache_salt)
        suffix = torch.tensor([ids[cached:]], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.model(suffix, past_key_values=past, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1]
        ttft = time.perf_counter() - started
        stored = 0
        if store and self.cache is not None:
            stored = self.cache.store(ids, self._layer_kv(past), cache_salt=cache_salt)
        return PrefillResult(logits, past, len(ids), cached, ttft, tiers, stored)

    def generate(
        self, prompt: Sequence[int], max_new_tokens: int, *, cache_salt: str = ""
    ) -> tuple[list[int], PrefillResult]:
        """Greedy decoding after a cached prefill; returns the new tokens and the prefill.

        The full sequence (prompt and reply) is stored afterwards, so the next turn of
        a conversation finds the reply's chunks too.
        """
        result = self.prefill(prompt, cache_salt=cache_salt, store=False)
        past, token = result.past_key_values, int(result.logits.argmax())
        generated = [token]
        with torch.inference_mode():
            for _ in range(max_new_tokens - 1):
                step = torch.tensor([[token]], dtype=torch.long, device=self.device)
                out = self.model(step, past_key_values=past, use_cache=True)
                token = int(out.logits[0, -1].argmax())
                generated.append(token)
        if self.cache is not None:
            sequence = [*prompt, *generated[:-1]]  # the last token has no KV yet
            result.num_stored_chunks = self.cache.store(
                sequence, self._layer_kv(past), cache_salt=cache_salt
            )
        return generated, result

    def _load_prefix(
        self, ids: list[int], cache_salt: str
    ) -> tuple[DynamicCache, int, dict[str, int]]:
        if self.cache is None:
            return DynamicCache(), 0, {}
        with self.cache.load(ids, max_tokens=len(ids) - 1, cache_salt=cache_salt) as hit:
            if hit.num_tokens == 0:
                return DynamicCache(), 0, {}
            views = hit.tensors()  # zero-copy (L, 2, C, H, D) views of the slabs
            layers = []
            for layer in range(views[0].shape[0]):
                # One copy per layer out of the slabs, laid out as HF wants: (1, H, T, D).
                keys = torch.cat([v[layer, 0] for v in views]).permute(1, 0, 2)
                values = torch.cat([v[layer, 1] for v in views]).permute(1, 0, 2)
                layers.append(
                    (keys.unsqueeze(0).to(self.device), values.unsqueeze(0).to(self.device))
                )
            return DynamicCache(layers), hit.num_tokens, hit.tokens_by_tier()

    @staticmethod
    def _layer_kv(past: DynamicCache) -> list[LayerKV]:
        # (1, H, T, D) per layer -> (T, H, D) views: store() copies them into slabs.
        pairs: list[LayerKV] = []
        for index, layer in enumerate(past.layers):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
                raise TypeError(
                    f"cache layer {index} ({type(layer).__name__}) holds no K/V tensors: "
                    "only attention layers with a full KV cache can be stored"
                )
            pairs.append((keys[0].transpose(0, 1), values[0].transpose(0, 1)))
        return pairs
