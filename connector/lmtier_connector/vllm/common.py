"""What the two halves of the vLLM connector share: metadata records, keys, settings.

The scheduler half decides *what* moves (chunk ranges, token ranges, block ids) and
hands it to every worker in :class:`LMTierConnectorMetadata`; the workers only move
bytes. Keys are not sent: a worker's namespace differs per tensor-parallel rank, so
each worker binds the chunk references (:class:`ChunkRefs`) to its own namespace
(:func:`chunk_keys`), then uses the facade's key-level methods.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

import msgspec
from vllm.distributed.kv_events import BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from lmtier.api import LMTier
from lmtier.chunks.keys import ChunkKey
from lmtier.chunks.vllm_hash import bind_block_hash
from lmtier.errors import ConfigError
from lmtier_connector.settings import SidecarSettings, bounded_number, sidecar_settings

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = [
    "AsyncLoads",
    "ChunkLayout",
    "ChunkRefs",
    "ConnectorSettings",
    "CopyKernels",
    "LMTierConnectorMetadata",
    "LMTierKVEvents",
    "LoadSpec",
    "PageInterior",
    "SaveSpec",
    "SaveWindow",
    "SidecarSettings",
    "chunk_keys",
    "stored_chunk_event",
]

_WHERE = "kv_connector_extra_config"


ChunkLayout = Literal["page", "LKTHD"]
"""How chunks hold KV: ``page``, in the engine's page order (whole blocks; a save and a
load are block copies), or ``LKTHD`` (tokens before heads: the layout the HF adapter
and ``lmtier demo`` store, so the two can share chunks; every copy is a transpose)."""

PageInterior = Literal["flash", "cpu_attn"]
"""How the attention backend lays K and V out inside a page block (one of
:data:`lmtier.kv_spec.PAGE_INTERIORS`): ``flash``, each slot's K then its V on the last
axis (vLLM's GPU backends), or ``cpu_attn``, per block and head a K region then a V
region (vLLM's CPU backend). Part of the namespace of ``page`` chunks."""

CopyKernels = Literal["auto", "on", "off"]
"""Whether the fused CUDA copy kernels move KV between pages and chunks
(:mod:`lmtier_connector.device.kernels`): ``auto`` where cupy and a CUDA device are
there (else torch's ops), ``on`` (refuse to start without them), ``off`` (torch's ops)."""

AsyncLoads = Literal["auto", "always", "never"]
"""When loads run in the background (vLLM keeps the request waiting meanwhile):
``auto`` when the hit's expected read (its bytes over its tiers' measured rates) is
longer than ``sync_load_max_ms`` (:mod:`~lmtier_connector.vllm.load_paths`),
``always``, or ``never`` (every load inside the scheduling step)."""


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """The connector's own options from ``kv_connector_extra_config``.

    ``config_path``: an lmtier YAML file; ``config``: overrides of it (nested or
    dotted keys, as :func:`lmtier.config.load_config` takes them).
    ``vllm_block_hashes``: key chunks by vLLM's own block hashes (lookups then agree
    with vLLM's prefix cache and KV events); False: lmtier's xxh3 chain over tokens.
    ``save_decode_tokens``: also store chunks completed by generated tokens.
    ``sidecar`` (``unix:///path.sock`` or ``host:port``): use that ``lmtier serve``
    instead of an embedded cache, with ``sidecar_token`` (or the first line of
    ``sidecar_token_file``), ``sidecar_shared_memory`` (default true) and
    ``sidecar_timeout_s`` (each call's deadline, default 10).
    ``chunk_layout`` (:data:`ChunkLayout`, default ``page``).
    ``copy_kernels`` (:data:`CopyKernels`, default ``auto``).
    ``page_interior`` (:data:`PageInterior`; None, the default: from vLLM's platform,
    :func:`lmtier_connector.vllm.pages.page_interior_of`): the page interior to key
    ``page`` chunks by, for a platform the connector cannot identify whose backend holds
    one of these interiors, and for test harnesses that write GPU pages on CPU torch.
    Workers still check it against their layers' attention backends.
    ``async_loads`` (:data:`AsyncLoads`, default ``auto``); ``sync_load_max_ms``: the
    longest expected read ``auto`` still does inside the step (default 20: about one
    step of a busy engine; a longer one would stall every request of the step).
    ``lookup_wait_ms``: how
    long a lookup that needs a remote tier may hold the scheduler (default 2 ms);
    past it vLLM is told "not yet" and asks again next step, when the answer that
    went on in the background is used.
    """

    config_path: str | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    vllm_block_hashes: bool = True
    save_decode_tokens: bool = False
    sidecar: SidecarSettings | None = None
    async_loads: AsyncLoads = "auto"
    lookup_wait_ms: float = 2.0
    sync_load_max_ms: float = 20.0
    chunk_layout: ChunkLayout = "page"
    copy_kernels: CopyKernels = "auto"
    page_interior: PageInterior | None = None

    @property
    def kernels(self) -> bool | None:
        """``copy_kernels`` as :class:`~lmtier_connector.device.transfer.TransferEngine`
        takes it: None (auto), True (required) or False."""
        return {"auto": None, "on": True, "off": False}[self.copy_kernels]

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorSettings:
        known = {"config_path", "config", "vllm_block_hashes", "save_decode_tokens"}
        known |= {"sidecar", "sidecar_token", "sidecar_token_file", "sidecar_shared_memory"}
        known |= {"sidecar_timeout_s"}
        known |= {"async_loads", "lookup_wait_ms", "sync_load_max_ms"}
        known |= {"chunk_layout", "page_interior", "copy_kernels"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config keys {unknown} for LMTierConnector; "
                f"known: {sorted(known)}"
            )
        overrides = extra.get("config", {})
        if not isinstance(overrides, Mapping):
            raise ConfigError("kv_connector_extra_config.config must be a mapping")
        path = extra.get("config_path")
        return cls(
            config_path=str(path) if path is not None else None,
            config=dict(overrides),
            vllm_block_hashes=bool(extra.get("vllm_block_hashes", True)),
            save_decode_tokens=bool(extra.get("save_decode_tokens", False)),
            sidecar=sidecar_settings(extra, where=_WHERE),
            async_loads=_choice(extra.get("async_loads", "auto"), "async_loads", AsyncLoads),
            lookup_wait_ms=bounded_number(
                extra.get("lookup_wait_ms", 2.0),
                "lookup_wait_ms",
                "ms in 0..60000",
                lambda v: 0 <= v <= 60_000,
                where=_WHERE,
            ),
            sync_load_max_ms=bounded_number(
                extra.get("sync_load_max_ms", 20.0),
                "sync_load_max_ms",
                "ms in 0..60000",
                lambda v: 0 <= v <= 60_000,
                where=_WHERE,
            ),
            chunk_layout=_choice(extra.get("chunk_layout", "page"), "chunk_layout", ChunkLayout),
            copy_kernels=_choice(extra.get("copy_kernels", "auto"), "copy_kernels", CopyKernels),
            page_interior=(
                _choice(extra["page_interior"], "page_interior", PageInterior)
                if "page_interior" in extra
                else None
            ),
        )


def _choice(value: object, name: str, choices: Any) -> Any:
    """``value`` if it is one of the ``Literal`` type ``choices``, else a ConfigError."""
    allowed = get_args(choices)
    if isinstance(value, str) and value in allowed:
        return value
    raise ConfigError(
        f"kv_connector_extra_config.{name} must be one of {list(allowed)}, got {value!r:.40}"
    )


@dataclass(frozen=True, slots=True)
class ChunkRefs:
    """Enough to key chunks ``first_chunk .. first_chunk + num_chunks - 1`` of a request.

    In the vLLM-hash mode ``boundary_hashes`` holds vLLM's hash of the last block of
    each of those chunks; otherwise ``token_ids`` holds the request's tokens from 0 to
    the end of the last chunk (lmtier's chain starts at the first token).
    """

    cache_salt: str
    first_chunk: int
    num_chunks: int
    boundary_hashes: tuple[bytes, ...] = ()
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load tokens ``[start_token, end_token)`` of a request into its blocks.

    ``end_token`` is a chunk boundary, ``start_token`` a block boundary (it may fall
    inside the first chunk: vLLM's own prefix cache already holds the tokens before
    it, and those blocks are never written). ``block_ids`` is the request's block
    table from token 0. ``asynchronous``: vLLM keeps the request waiting until the
    workers report it in ``get_finished`` (no forward pass reads these blocks now).
    """

    req_id: str
    refs: ChunkRefs
    start_token: int
    end_token: int
    block_ids: tuple[int, ...]
    asynchronous: bool = False


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store the chunks of ``refs`` from the request's blocks (table from token 0).

    ``stored_event`` describes all of those chunks (the scheduler alone knows their
    tokens); a worker announces the chunks it has stored with per-chunk slices of it
    (:func:`stored_chunk_event`), once they are in its tiers.
    """

    req_id: str
    refs: ChunkRefs
    block_ids: tuple[int, ...]
    stored_event: BlockStored | None = None


@dataclass(slots=True)
class LMTierConnectorMetadata(KVConnectorMetadata):
    """One step's work for every worker: loads (synchronous ones before the forward
    pass, asynchronous ones in the background), saves during the forward pass."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted_req_ids: frozenset[str] = frozenset()


def stored_chunk_event(event: BlockStored, num_chunks: int, index: int) -> BlockStored:
    """The part of ``event`` (covering ``num_chunks`` chunks) that covers chunk ``index``."""
    per = len(event.block_hashes) // num_chunks
    tokens = len(event.token_ids) // num_chunks
    first = index * per
    parent = event.block_hashes[first - 1] if first else event.parent_block_hash
    # A copy with every other field kept (medium, LoRA, a hybrid model's group).
    return msgspec.structs.replace(
        event,
        block_hashes=list(event.block_hashes[first : first + per]),
        parent_block_hash=parent,
        token_ids=list(event.token_ids[index * tokens : (index + 1) * tokens]),
    )


@dataclass(frozen=True, slots=True)
class SaveWindow:
    """Which chunks a sliding-window KV cache group keeps and loads
    (:mod:`lmtier_connector.vllm.hybrid`).

    A forward pass from position ``H`` on reads the ``reach`` tokens before ``H`` in
    such a layer (``sliding_window - 1``, plus vLLM's ``extra_retained_tokens``); vLLM
    holds null blocks below them. So a hit ending at chunk boundary ``c`` needs the
    group's chunks from :meth:`first_chunk` ``(c)`` to ``c - 1``, and a load writes
    only the blocks from :meth:`load_start` on. A request saves the chunks of the
    windows before its two anchors (:meth:`save_range`): the last chunk boundary of its
    prompt (a longer prompt continuing it hits there) and the last boundary before its
    last prompt token (the same prompt again hits there); they differ only when the
    prompt is a whole number of chunks.
    """

    reach: int
    block_size: int
    chunk_size: int

    def load_start(self, start: int, end: int) -> int:
        """The first token to load of ``[start, end)``: the first block vLLM holds for
        a hit ending at ``end`` (block-aligned), never before ``start``."""
        held = max(0, end - self.reach) // self.block_size * self.block_size
        return min(end, max(start, held))

    def first_chunk(self, end_chunk: int) -> int:
        """The first chunk a hit ending at chunk boundary ``end_chunk`` needs."""
        return self.load_start(0, end_chunk * self.chunk_size) // self.chunk_size

    def save_range(self, request: Request, first: int, stop: int) -> tuple[int, int]:
        """The part of chunks ``[first, stop)`` of ``request`` to save: inside the
        windows before its anchors (class docstring)."""
        prompt = request.num_prompt_tokens
        low, high = (prompt - 1) // self.chunk_size, prompt // self.chunk_size
        return max(first, self.first_chunk(low)), min(stop, high)


class LMTierKVEvents(KVConnectorKVEvents):
    """The KV events of one step's worker outputs (vLLM merges those of every worker
    into the first one's). Counting across workers and steps is the scheduler's job:
    ``aggregate`` keeps everything."""

    def __init__(self, events: list[KVCacheEvent] | None = None, num_workers: int = 1) -> None:
        self._events: list[KVCacheEvent] = list(events or [])
        self._num_workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> LMTierKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._num_workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def clear_events(self) -> None:
        self._events.clear()

    def __repr__(self) -> str:
        return f"LMTierKVEvents({len(self._events)} events, {self._num_workers} workers)"


def chunk_keys(cache: LMTier, refs: ChunkRefs) -> list[ChunkKey]:
    """The storage keys of ``refs`` in ``cache``'s namespace (its TP rank included)."""
    namespace = cache.namespace(refs.cache_salt)
    if refs.boundary_hashes:
        return [bind_block_hash(namespace, h) for h in refs.boundary_hashes]
    if not refs.token_ids:
        return []
    keys = cache.keys(list(refs.token_ids), cache_salt=refs.cache_salt)
    return keys[refs.first_chunk : refs.first_chunk + refs.num_chunks]
