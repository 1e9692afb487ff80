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

* ``block_hashes``: with ``hash_algorithm: vllm``, vLLM's own block hashes of each
  chunk (``block_size`` 16, ``parent_block_hash`` the block before), as the cache
  learned them when it hashed the prompt (:meth:`lmtier.LMTier.keys`; the last
  :data:`~lmtier.storage.events.NAMES` chunks): the events line up with the engine's;
  otherwise, and for chunks it was not told about (a sidecar's, whose clients send
  keys only), the chunk keys (32 bytes: the namespace digest, then the chunk's hash),
  ``block_size`` the chunk size. Bytes, or vLLM's 64-bit integers with
  ``int_block_hashes``;
* ``medium``: the tier's name in capitals (``CPU``, ``DISK``, ``REDIS``, ``S3``,
  ``PEER``; vLLM's own are ``GPU`` and ``CPU``);
* ``token_ids`` empty: a tier holds bytes under a key, not the tokens that made it
  (the vLLM connector's own events, through vLLM's publisher, carry them);
* a tier's purge of a namespace it cannot list, or events lost to a full queue:
  ``AllBlocksCleared``, then ``BlockStored`` for what the node's CPU tier holds
  (:class:`~lmtier.events.publisher.EventPublisher`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgpack

from lmtier.chunks.keys import ChunkKey
from lmtier.storage.events import TierEvent

if TYPE_CHECKING:
    from lmtier.storage.events import ChunkName

__all__ = [
    "NameOf",
    "all_cleared",
    "encode_batch",
    "external",
    "medium_of",
    "removed",
    "stored",
    "vllm_events",
]


NameOf = Callable[[ChunkKey], "ChunkName | None"]
"""What the engine calls a chunk, if it said (:meth:`TierEvents.name_of`)."""


def medium_of(tier: str) -> str:
    """The ``medium`` lmtier's tier ``tier`` is published as."""
    return tier.upper()


def external(block_hash: bytes, int_hashes: bool) -> bytes | int:
    """A block hash as vLLM publishes it: the bytes, or (vLLM's
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) their low 64 bits as an integer."""
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF if int_hashes else block_hash


def stored(
    hashes: Sequence[bytes | int], tier: str, block_size: int, parent: bytes | int | None = None
) -> dict[str, Any]:
    """A ``BlockStored`` of ``hashes`` (blocks of ``block_size`` tokens) in ``tier``."""
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": [],
        "block_size": block_size,
        "lora_id": None,
        "medium": medium_of(tier),
        "lora_name": None,
    }


def removed(hashes: Sequence[bytes | int], tier: str) -> dict[str, Any]:
    """A ``BlockRemoved`` of ``hashes`` from ``tier``."""
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium_of(tier)}


def all_cleared() -> dict[str, Any]:
    """An ``AllBlocksCleared``."""
    return {"type": "AllBlocksCleared"}


def vllm_events(
    events: Iterable[TierEvent],
    chunk_size: int,
    name_of: NameOf | None = None,
    *,
    int_hashes: bool = False,
) -> tuple[list[dict[str, Any]], bool]:
    """``events`` as vLLM's events, and whether one of them was a ``cleared`` (the
    caller follows with a snapshot: vLLM's events cannot clear one namespace).

    Chunks the engine named (``name_of``) are published as its blocks, with the parent
    of a run's first; the others as one block of ``chunk_size`` tokens under their key."""
    out: list[dict[str, Any]] = []
    cleared = False
    for event in events:
        if event.kind == "cleared":
            cleared = True
            continue
        for parent, hashes, size in _runs(event.keys, chunk_size, name_of, int_hashes):
            if event.kind == "stored":
                out.append(stored(hashes, event.tier, size, parent))
            else:
                out.append(removed(hashes, event.tier))
    return out, cleared


def _runs(
    keys: Sequence[ChunkKey], chunk_size: int, name_of: NameOf | None, int_hashes: bool
) -> list[tuple[bytes | int | None, list[bytes | int], int]]:
    """``keys`` cut into runs of named and unnamed chunks: (parent, hashes, block size)."""
    runs: list[tuple[bytes | int | None, list[bytes | int], int]] = []
    for key in keys:
        name = name_of(key) if name_of is not None else None
        if name is None or not name[1]:
            if runs and runs[-1][2] == chunk_size:
                runs[-1][1].append(external(key, int_hashes))
            else:
                runs.append((None, [external(key, int_hashes)], chunk_size))
            continue
        parent, hashes = name
        size = chunk_size // len(hashes)
        blocks = [external(h, int_hashes) for h in hashes]
        if (
            runs
            and runs[-1][2] == size
            and runs[-1][1]
            and parent is not None
            and _last(runs) == external(parent, int_hashes)
        ):
            runs[-1][1].extend(blocks)
        else:
            runs.append((None if parent is None else external(parent, int_hashes), blocks, size))
    return runs


def _last(runs: list[tuple[bytes | int | None, list[bytes | int], int]]) -> bytes | int:
    return runs[-1][1][-1]


def encode_batch(ts: float, events: Sequence[dict[str, Any]], data_parallel_rank: int) -> bytes:
    """A ``KVEventBatch`` of ``events`` (made by :func:`stored`, :func:`removed`,
    :func:`all_cleared`), as bytes."""
    packed: bytes = msgpack.packb([ts, list(events), data_parallel_rank], use_bin_type=True)
    return packed
