"""A client process of a sidecar for the integration tests: run as a script, it does
one thing through ``lmtier.connect`` and prints one JSON line per step (``--model M``:
as model M instead of ``MODEL``).

    python sidecar_client.py TARGET store PROMPT_SEED N_TOKENS [--stream] [--salt S]
    python sidecar_client.py TARGET load PROMPT_SEED N_TOKENS [--stream] [--salt S]
    python sidecar_client.py TARGET hold PROMPT_SEED N_TOKENS   (load, acquire, then wait)
    python sidecar_client.py TARGET mix FIRST_SEED N_TOKENS --seconds S [--stream]
        (lookups, loads and stores of 8 shared prompts for S seconds; every load checked)

Prompts and KV are functions of the seed, so the test process knows what a load must
return (:func:`prompt`, :func:`kv_of`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from typing import Any

import torch

import lmtier
from lmtier import KVSpec, LMTier, load_config

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64)
"""2 KiB per token: 512 KiB chunks of 256 tokens."""
MODEL = "sidecar-test-model"


def prompt(seed: int, n: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32_000, (n,), generator=generator).tolist()


def kv_of(seed: int, n: int) -> torch.Tensor:
    return torch.randn(SPEC.shape(n), generator=torch.Generator().manual_seed(seed + 1))


def digest(tensor: torch.Tensor | None) -> str:
    if tensor is None:
        return ""
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


def connect(
    target: str, *, stream: bool, timeout_s: float = 10.0, model_id: str = MODEL, **options: Any
) -> LMTier:
    """A client of the sidecar at ``target``, of model ``model_id`` (a test that shares
    its sidecar with others gives its own: its chunks are then its own)."""
    config = load_config(env={})
    return lmtier.connect(
        target,
        config,
        kv=SPEC,
        model_id=model_id,
        shared_memory=not stream,
        timeout_s=timeout_s,
        client_name="test-client",
        **options,
    )


def gauges(cache: LMTier) -> dict[str, float]:
    """The sidecar's own gauges, as a client sees them (sessions, leases, slabs_total,
    leases_expired, ...)."""
    found = cache.stats().get("sidecar", {})
    return {k: float(v) for k, v in found.items()}  # type: ignore[arg-type]


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def mix(cache: LMTier, first_seed: int, n: int, seconds: float) -> dict[str, int]:
    """Random lookups, loads and stores of 8 prompts that every mixing process shares,
    for ``seconds``; a load whose KV differs from what was stored is an error."""
    seeds = range(first_seed, first_seed + 8)
    prompts = {seed: prompt(seed, n) for seed in seeds}
    kvs = {seed: kv_of(seed, n) for seed in seeds}
    rng = random.Random()
    counts = {"lookups": 0, "loads": 0, "stores": 0, "loaded_tokens": 0, "errors": 0}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seed = rng.choice(seeds)
        op = rng.random()
        if op < 0.4:
            cache.lookup(prompts[seed])
            counts["lookups"] += 1
        elif op < 0.8:
            with cache.load(prompts[seed]) as hit:
                got = hit.kv()
                if got is not None and not torch.equal(got, kvs[seed][:, :, : hit.num_tokens]):
                    counts["errors"] += 1
                counts["loaded_tokens"] += hit.num_tokens
            counts["loads"] += 1
        else:
            cache.store(prompts[seed], kvs[seed])
            counts["stores"] += 1
    return counts


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("mode", choices=["store", "load", "hold", "mix"])
    parser.add_argument("seed", type=int)
    parser.add_argument("tokens", type=int)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--salt", default="")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    ids = prompt(args.seed, args.tokens)
    cache = connect(args.target, stream=args.stream, model_id=args.model)
    if args.mode == "store":
        stored = cache.store(ids, kv_of(args.seed, args.tokens), cache_salt=args.salt)
        cache.flush()
        say(stored=stored)
    elif args.mode == "load":
        with cache.load(ids, cache_salt=args.salt) as hit:
            say(tokens=hit.num_tokens, tiers=hit.tokens_by_tier(), sha=digest(hit.kv()))
    elif args.mode == "mix":
        say(**mix(cache, args.seed, args.tokens, args.seconds))
    else:
        hit = cache.load(ids, cache_salt=args.salt)
        slabs = cache.acquire_slabs(2)
        say(tokens=hit.num_tokens, acquired=len(slabs))
        while True:  # until killed
            time.sleep(3600)
    cache.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
