"""HF transformers adapter: a causal LM whose prefill skips the cached prefix.

:class:`CachedCausalLM` wraps a transformers causal LM (Llama architecture first)
and an :class:`~lmtier.api.LMTier`. A prefill:

1. looks the prompt up in every tier, at most ``len(prompt) - 1`` tokens (the last
   prompt token is always recomputed: its logits are the point of the prefill);
2. loads the hit prefix and builds a ``DynamicCache`` from it, one (K, V) pair per
   layer, copied once out of the pool slabs (which are released at once);
3. runs the model on the suffix only, with that cache as ``past_key_values``;
   transformers derives the positions of the suffix from the cache length;
4. after the logits are ready (so storing never delays the first token), caches the
   new full blocks in the device tier and stores the new full chunks in lmtier (CPU
   tier now, lower tiers in the background).

A CachedCausalLM is used by one thread at a time, like the model it wraps.

With fp32 weights the logits equal those of a full prefill without lmtier: the
attention of the suffix reads the same K and V, whether computed or loaded.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import DynamicCache

from lmtier.api import LMTier
from lmtier.chunks.keys import ChunkHasher, Namespace
from lmtier.kv_spec import KVSpec, LayerKV
from lmtier_connector.device.prefix_cache import DeviceHit, DevicePrefixCache
from lmtier_connector.hf.compat import call_with_cache

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

    def __init__(
        self,
        model: Any,
        cache: LMTier | None,
        *,
        device_cache: DevicePrefixCache | None = None,
        namespace: Namespace | None = None,
    ) -> None:
        """``namespace`` keys the device tier when there is no ``cache`` to take it from."""
        if device_cache is not None and cache is None and namespace is None:
            raise ValueError("a device tier without an LMTier needs a namespace")
        self.model = model
        self.cache = cache
        self.device_cache = device_cache
        self._namespace = namespace
        self.device = next(model.parameters()).device

    def namespace(self, cache_salt: str) -> Namespace:
        """The namespace of this model for one tenant."""
        if self.cache is not None:
            return self.cache.namespace(cache_salt)
        assert self._namespace is not None  # checked in __init__
        return replace(self._namespace, cache_salt=cache_salt)

    def prefill(
        self, prompt: Sequence[int], *, cache_salt: str = "", store: bool = True
    ) -> PrefillResult:
        """Prefill ``prompt`` (token ids), reusing cached KV; see the module docstring."""
        result, hasher, skip, device_hit = self._prefill(prompt, cache_salt)
        if store:
            result.num_stored_chunks = self._store(
                list(prompt), result.past_key_values, hasher, skip=skip, device_hit=device_hit
            )
        return result

    def generate(
        self, prompt: Sequence[int], max_new_tokens: int, *, cache_salt: str = ""
    ) -> tuple[list[int], PrefillResult]:
        """Greedy decoding after a cached prefill; returns the new tokens and the prefill.

        The full sequence (prompt and reply) is stored afterwards, so the next turn of
        a conversation finds the reply's chunks too; only the reply's tokens are hashed
        then (the prompt's keys are the prefill's).
        """
        result, hasher, skip, _ = self._prefill(prompt, cache_salt)
        past, token = result.past_key_values, int(result.logits.argmax())
        generated = [token]
        with torch.inference_mode():
            for _ in range(max_new_tokens - 1):
                step = torch.tensor([[token]], dtype=torch.long, device=self.device)
                out = call_with_cache(self.model, step, past, use_cache=True)
                token = int(out.logits[0, -1].argmax())
                generated.append(token)
        if hasher is not None:
            hasher.extend(generated[:-1])  # the last token has no KV yet
        sequence = [*prompt, *generated[:-1]]
        hit = self._device_lookup(sequence, cache_salt)
        result.num_stored_chunks = self._store(sequence, past, hasher, skip=skip, device_hit=hit)
        return generated, result

    def store_sequence(
        self, sequence: Sequence[int], past: DynamicCache, *, cache_salt: str = ""
    ) -> int:
        """Store the full chunks of ``sequence`` (a prompt and the reply decoded after
        it) whose KV ``past`` holds, so that the next turn of a conversation finds the
        reply too; chunks already cached (the prompt's) are skipped. Tokens past
        ``past``'s length (a last sampled token never fed back) are ignored. Returns
        the chunks stored."""
        if self.cache is None:
            return 0
        ids = list(sequence)[: past.get_seq_length()]
        keys = self.cache.keys(ids, cache_salt=cache_salt)
        return self.cache.store_keys(keys, self._layer_kv(past)) if keys else 0

    def _prefill(
        self, prompt: Sequence[int], cache_salt: str
    ) -> tuple[PrefillResult, ChunkHasher | None, int | None, DeviceHit | None]:
        """The prefill, the hasher holding the prompt's keys, how many leading chunks
        the storage tiers are known to hold (None: unknown), and the device tier's hit."""
        started = time.perf_counter()
        ids = list(prompt)
        if not ids:
            raise ValueError("cannot prefill an empty prompt")
        hasher = self.cache.hasher(cache_salt=cache_salt) if self.cache is not None else None
        if hasher is not None:
            hasher.extend(ids)
        device_hit = self._device_lookup(ids, cache_salt)
        past, cached, tiers, skip = self._load_prefix(ids, hasher, device_hit)
        suffix = torch.tensor([ids[cached:]], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = call_with_cache(self.model, suffix, past, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1]
        ttft = time.perf_counter() - started
        result = PrefillResult(logits, past, len(ids), cached, ttft, tiers)
        return result, hasher, skip, device_hit

    def _device_lookup(self, ids: list[int], cache_salt: str) -> DeviceHit | None:
        if self.device_cache is None:
            return None
        return self.device_cache.lookup(ids, self.namespace(cache_salt))

    def _load_prefix(
        self, ids: list[int], hasher: ChunkHasher | None, device_hit: DeviceHit | None
    ) -> tuple[DynamicCache, int, dict[str, int], int | None]:
        on_device = device_hit.num_tokens if device_hit is not None else 0
        if self.cache is None or hasher is None:
            return (*self._build(device_hit, on_device, [], {}), None)
        # Storage is chunk-granular: it can extend the device hit from the last chunk
        # boundary the device tier covers, if it reaches further. The last prompt token
        # is always recomputed.
        size = self.cache.chunk_size
        first, limit = on_device // size, (len(ids) - 1) // size
        keys = list(hasher.keys[first:limit])
        found = self.cache.lookup_keys(keys)
        # Chunks before the device hit's boundary were not asked about: unknown.
        skip = found.num_chunks if first == 0 else None
        if (first + found.num_chunks) * size <= on_device:
            return (*self._build(device_hit, on_device, [], {}), skip)
        with self.cache.load_keys(keys, found) as hit:  # the walk just made, reused
            skip = len(hit.chunks) if first == 0 else None  # what was really there
            if first * size + hit.num_tokens <= on_device:  # lost a race with an eviction
                return (*self._build(device_hit, on_device, [], {}), skip)
            return (
                *self._build(device_hit, first * size, hit.tensors(), hit.tokens_by_tier()),
                skip,
            )

    def _build(
        self,
        device_hit: DeviceHit | None,
        on_device: int,
        views: list[torch.Tensor],
        tiers: dict[str, int],
    ) -> tuple[DynamicCache, int, dict[str, int]]:
        """A DynamicCache from ``on_device`` tokens of pages, then the chunk ``views``."""
        parts = list(views)  # zero-copy (L, 2, C, H, D) views of slabs
        if on_device and device_hit is not None and self.device_cache is not None:
            parts.insert(0, self.device_cache.load(device_hit, on_device))
            tiers = {"device": on_device, **tiers}
        if not parts:
            return DynamicCache(), 0, {}
        layers = []
        for layer in range(parts[0].shape[0]):
            # One copy per layer, laid out as HF wants: (1, H, T, D).
            keys = torch.cat([p[layer, 0] for p in parts]).permute(1, 0, 2)
            values = torch.cat([p[layer, 1] for p in parts]).permute(1, 0, 2)
            layers.append((keys.unsqueeze(0).to(self.device), values.unsqueeze(0).to(self.device)))
        cached = sum(int(p.shape[2]) for p in parts)
        return DynamicCache(layers), cached, tiers

    def _store(
        self,
        ids: list[int],
        past: DynamicCache,
        hasher: ChunkHasher | None,
        *,
        skip: int | None,
        device_hit: DeviceHit | None,
    ) -> int:
        """Cache the new full blocks in the device tier and the new full chunks in
        lmtier, keyed by the hasher's keys (no second hashing, no second lookup when the
        prefill's says what is cached)."""
        layers = self._layer_kv(past)
        if self.device_cache is not None and device_hit is not None:
            self.device_cache.save(device_hit, layers, len(ids))
        if self.cache is None or hasher is None:
            return 0
        return self.cache.store_keys(hasher.keys, layers, skip=skip)

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
