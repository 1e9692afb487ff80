"""lmtier's tier events in vLLM's KV-event wire format (vLLM 0.34's
``vllm/distributed/kv_events.py``), encoded with msgpack, no vLLM import.

vLLM sends a ``KVEventBatch``, a msgspec struct encoded as an array
``[ts, events, data_parallel_rank]``, whose events are tagged structs encoded as
maps with a ``type`` key: ``BlockStored`` (``block_hashes``, ``parent_block_hash``,
``token_ids``, ``block_size``, ``lora_id``, ``medium``, ``lora_name``),
``BlockRemoved`` (``block_hashes``, ``medium``) and ``AllBlocksCleared``. vLLM's own
decoder (``msgspec.msgpack.Decoder(KVEventBatch)``) reads what :func:`encode_batch`
writes; tests/unit/test_event_wire.py checks it against the installed vLLM.

How lmtier fills them:

* ``block_hashes``: the chunk keys (32 bytes each: the namespace digest, then the
  chunk's hash; with ``hash_algorithm: vllm`` the chunk's hash is bound to vLLM's block
  hash at the chunk's end, :mod:`lmtier.chunks.vllm_hash`), a valid
  ``ExternalBlockHash`` (bytes); ``block_size``: the chunk size in tokens;
* ``medium``: the tier's name in capitals (``CPU``, ``DISK``, ``REDIS``, ``S3``,
  ``PEER``; vLLM's own are ``GPU`` and ``CPU``);
* ``token_ids`` empty and ``parent_block_hash`` null: a tier holds bytes under a key,
  not the tokens that made it (the vLLM connector's own events carry both);
* a tier's purge of a namespace it cannot list, or events lost to a full queue:
  ``AllBlocksCleared``, then ``BlockStored`` for what the node's CPU tier holds
  (:class:`~lmtier.events.publisher.EventPublisher`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgpack

from lmtier.chunks.keys import ChunkKey
from lmtier.storage.events import TierEvent

__all__ = ["all_cleared", "encode_batch", "medium_of", "removed", "stored", "vllm_events"]


def medium_of(tier: str) -> str:
    """The ``medium`` lmtier's tier ``tier`` is published as."""
    return tier.upper()


def stored(keys: Sequence[ChunkKey], tier: str, block_size: int) -> dict[str, Any]:
    """A ``BlockStored`` of ``keys`` in ``tier``."""
    return {
        "type": "BlockStored",
        "block_hashes": [bytes(key) for key in keys],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": block_size,
        "lora_id": None,
        "medium": medium_of(tier),
        "lora_name": None,
    }


def removed(keys: Sequence[ChunkKey], tier: str) -> dict[str, Any]:
    """A ``BlockRemoved`` of ``keys`` from ``tier``."""
    return {
        "type": "BlockRemoved",
        "block_hashes": [bytes(key) for key in keys],
        "medium": medium_of(tier),
    }


def all_cleared() -> dict[str, Any]:
    """An ``AllBlocksCleared``."""
    return {"type": "AllBlocksCleared"}


def vllm_events(events: Iterable[TierEvent], block_size: int) -> tuple[list[dict[str, Any]], bool]:
    """``events`` as vLLM's events, and whether one of them was a ``cleared`` (the
    caller follows with a snapshot: vLLM's events cannot clear one namespace)."""
    out: list[dict[str, Any]] = []
    cleared = False
    for event in events:
        if event.kind == "stored":
            out.append(stored(event.keys, event.tier, block_size))
        elif event.kind == "removed":
            out.append(removed(event.keys, event.tier))
        else:
            cleared = True
    return out, cleared


def encode_batch(ts: float, events: Sequence[dict[str, Any]], data_parallel_rank: int) -> bytes:
    """A ``KVEventBatch`` of ``events`` (made by :func:`stored`, :func:`removed`,
    :func:`all_cleared`), as bytes."""
    packed: bytes = msgpack.packb([ts, list(events), data_parallel_rank], use_bin_type=True)
    return packed
