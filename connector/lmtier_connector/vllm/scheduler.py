"""The scheduler half of the vLLM connector: lookups, load and save plans, KV events.

Lookups are side-effect free: keys are bound from vLLM's own block hashes
(``request.block_hashes``, no rehashing) or from lmtier's chain over the tokens, and the
tiers answer how many leading chunks they hold. The hit counts from vLLM's block-aligned
local hit (``num_computed_tokens``): the walk starts at the chunk holding it, the result
is whole chunks, and it never covers the last prompt token (its logits are the point of
the prefill). A lookup that the tiers answer without I/O (host memory, the disk index)
runs in the scheduler's thread; one that needs a remote tier (Redis, S3, a peer, a
sidecar) runs on a lookup thread, and when it takes longer than ``lookup_wait_ms`` vLLM
is told "not yet" (``None``): the request stays waiting and the answer is picked up at
vLLM's next call, so a slow Redis or S3 never stalls the other requests' steps.

Loads are synchronous (inside the step that schedules the request) when the hit's
expected read is short, from its tiers' measured rates, and asynchronous otherwise
(``async_loads``, ``sync_load_max_ms``; :mod:`~lmtier_connector.vllm.load_paths`): vLLM
allocates the blocks, keeps the request in ``WAITING_FOR_REMOTE_KVS``, and the plan goes
to the workers in the same step's metadata; they read and scatter in the background and
report the request through ``get_finished``.

Saves are planned per step: when a step completes a chunk of the prompt (chunked prefill
included), the chunk's blocks go to the workers in that step's metadata, so the worker
gathers them during the same forward pass that writes them. A request that ever had a
save returns True from :meth:`request_finished`; the workers report it through
``get_finished`` once its saves are in the tiers, and only then does vLLM free its
blocks.

Where hits came from: each hit reported to vLLM keeps its lookup's spans until vLLM
asks (``get_external_cache_hit_sources``, after the allocation), which splits the loaded
tokens by tier (:mod:`~lmtier_connector.vllm.hit_sources`). Which requests may load
asynchronously (``may_load_async``, vLLM 0.34's ``--max-num-inflight-kv-loads``) is told
by the same walk without I/O that answers a lookup in the scheduler's thread.

KV events are announced when chunks are *stored*, not when they are planned: each save
carries the ``BlockStored`` of its chunks, the workers return per-chunk slices of it
once the chunks are in their tiers (``get_kv_connector_kv_cache_events``), vLLM hands
them here (:meth:`SchedulerHalf.add_worker_events`), and an event is published once
every saving rank has reported it (``tp_size`` ranks; one for MLA). A chunk announced
with medium CPU that a worker's CPU tier evicts comes back the same way as a
``BlockRemoved(medium="CPU")``; that one is published at the *first* rank's report (a
chunk missing one rank's shard cannot be loaded), the other ranks' copies of it are
absorbed. Over a sidecar no removal ever comes (the workers cannot see its evictions),
and the medium is the connector config's (``cpu.enabled``): set it as the sidecar's is.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.sched.output import SchedulerOutput

from lmtier import Lookup
from lmtier.api import LMTier
from lmtier.chunks.keys import ChunkKey
from lmtier_connector.vllm.common import (
    ChunkRefs,
    ConnectorSettings,
    LMTierConnectorMetadata,
    LoadSpec,
    SaveSpec,
    SaveWindow,
    chunk_keys,
)
from lmtier_connector.vllm.hit_sources import FoundHit
from lmtier_connector.vllm.load_paths import LoadPaths
from lmtier_connector.vllm.lookups import keep_pending, lookup_failed, wait_briefly

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.request import Request

__all__ = ["SchedulerHalf"]

logger = logging.getLogger(__name__)

MAX_PENDING_EVENTS = 65536
"""Chunk events reported by some saving ranks but not all yet; beyond it the oldest
are dropped (a rank that could not store a chunk never reports it)."""


@dataclass(slots=True)
class _RequestState:
    """What the scheduler half tracks per live request."""

    request: Request
    block_ids: list[int] = field(default_factory=list)
    num_load_tokens: int = 0  # tokens to load in the next step that schedules it
    next_save_chunk: int = 0  # chunks before it are stored or planned


@dataclass(frozen=True, slots=True)
class _Answer:
    """The last hit reported for a request: vLLM's local hit it counted from, and
    whether the load is asynchronous."""

    num_computed: int
    asynchronous: bool


@dataclass(frozen=True, slots=True)
class _PendingLookup:
    """A lookup still running on the lookup thread, for these keys."""

    keys: tuple[ChunkKey, ...]
    future: Future[Lookup]


class SchedulerHalf:
    """Scheduler-side state and logic; :class:`LMTierConnector` delegates to it."""

    def __init__(
        self,
        cache: LMTier,
        settings: ConnectorSettings,
        block_size: int,
        *,
        saves: bool = True,
        num_savers: int = 1,
        group: int = 0,
        window: SaveWindow | None = None,
    ) -> None:
        self.cache = cache
        self.group = group  # vLLM's KV cache group whose block ids this half plans with
        self.window = window  # a sliding-window group's (lmtier_connector.vllm.hybrid)
        self.settings = settings
        self.block_size = block_size
        self.chunk_size = cache.chunk_size
        self.blocks_per_chunk = cache.chunk_size // block_size
        self.saves = saves
        self._states: dict[str, _RequestState] = {}
        self._saving: set[str] = set()
        self._events: list[KVCacheEvent] = []
        self._num_savers = num_savers  # workers that store each chunk: tp_size, 1 for MLA
        self._reported: Counter[KVCacheEvent] = Counter()
        self._removed: Counter[KVCacheEvent] = Counter()  # published, ranks left to absorb
        self._medium = MEDIUM_CPU if cache.config.cpu.enabled else MEDIUM_STORAGE
        self._answers: dict[str, _Answer] = {}
        self._hits: dict[str, FoundHit] = {}  # until vLLM asks where they came from
        # A sidecar over TCP may be another machine: its tiers are no source of ours.
        sidecar = settings.sidecar
        self._on_this_host = sidecar is None or sidecar.target.startswith("unix:")
        self._lookups: dict[str, _PendingLookup] = {}
        self._lookup_thread: ThreadPoolExecutor | None = None
        self._async_loads: list[LoadSpec] = []  # planned at allocation, sent next meta
        self.load_paths = LoadPaths(
            settings.async_loads,
            settings.sync_load_max_ms / 1000,
            cache.kv_spec.bytes_per_token * cache.chunk_size,
        )

    # ---- keys ----------------------------------------------------------------------

    def _num_keyable_chunks(self, request: Request, num_tokens: int) -> int:
        """Full chunks among the first ``num_tokens`` tokens that can be keyed now."""
        chunks = max(0, num_tokens) // self.chunk_size
        if self.settings.vllm_block_hashes:
            chunks = min(chunks, len(request.block_hashes) // self.blocks_per_chunk)
        return chunks

    def refs(self, request: Request, first: int, stop: int) -> ChunkRefs:
        """References of chunks ``[first, stop)`` of ``request`` for the workers."""
        salt = request.cache_salt or ""
        if self.settings.vllm_block_hashes:
            per = self.blocks_per_chunk
            hashes = tuple(
                bytes(request.block_hashes[(j + 1) * per - 1]) for j in range(first, stop)
            )
            return ChunkRefs(salt, first, stop - first, boundary_hashes=hashes)
        tokens = tuple(request.all_token_ids[: stop * self.chunk_size])
        return ChunkRefs(salt, first, stop - first, token_ids=tokens)

    # ---- lookup --------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that the tiers can supply (whole chunks,
        never the last token) and whether they load asynchronously; ``(None, False)``
        while a lookup of a remote tier is still running (module docstring)."""
        req_id = request.request_id
        stop = self._num_keyable_chunks(request, request.num_tokens - 1)
        first = num_computed_tokens // self.chunk_size
        if first >= stop:
            self._lookups.pop(req_id, None)
            return 0, False
        keys = chunk_keys(self.cache, self.refs(request, first, stop))
        found = self._lookup(req_id, keys)
        if found is None:
            return None, False
        hit_end = (first + found.num_chunks) * self.chunk_size
        tokens = max(0, hit_end - num_computed_tokens)
        asynchronous = tokens > 0 and self.load_paths.asynchronous(found.spans)
        self._answers[req_id] = _Answer(num_computed_tokens, asynchronous)
        self.note_hit(req_id, FoundHit(num_computed_tokens, first, found.spans), tokens)
        return tokens, asynchronous

    def note_hit(self, req_id: str, found: FoundHit, tokens: int) -> None:
        """Keep what a lookup found until vLLM asks where the hit came from."""
        if tokens > 0:
            self._hits[req_id] = found
        else:
            self._hits.pop(req_id, None)

    def hit_sources(self, request: Request, num_tokens: int) -> dict[CacheHitSource, int]:
        """The ``num_tokens`` external tokens vLLM took from the last hit reported for
        ``request``, by the tier that holds them (:mod:`~lmtier_connector.vllm.hit_sources`)."""
        found = self._hits.pop(request.request_id, None)
        if num_tokens <= 0:
            return {}
        if found is None:  # never: vLLM asks only after a hit
            return FoundHit(0, 0, ()).sources(num_tokens, self.chunk_size)
        return found.sources(num_tokens, self.chunk_size, on_this_host=self._on_this_host)

    def observe_stats(self, stats: Mapping[str, float]) -> None:
        """The workers' counters of one step: their read rates, for the load paths."""
        self.load_paths.observe(stats)

    def may_load_async(self, request: Request) -> bool:
        """Whether a hit of ``request`` would load asynchronously, told without I/O:
        never with ``async_loads: never`` or a prompt shorter than a chunk; else what
        the host-memory and disk-index walk finds (any hit with ``always``, one whose
        expected read is long with ``auto``: :mod:`~lmtier_connector.vllm.load_paths`);
        where that walk cannot tell (a remote tier or a sidecar would be asked), True:
        their hits load in the background."""
        if self.settings.async_loads == "never":
            return False
        stop = self._num_keyable_chunks(request, request.num_tokens - 1)
        if stop <= 0:
            return False
        try:
            found = self.cache.lookup_keys_now(chunk_keys(self.cache, self.refs(request, 0, stop)))
        except Exception as exc:
            lookup_failed(exc, f"the load prediction for {request.request_id}")
            return False
        if found is None:
            return True
        return found.num_chunks > 0 and self.load_paths.asynchronous(found.spans)

    def _lookup(self, req_id: str, keys: list[ChunkKey]) -> Lookup | None:
        """The waterfall lookup of ``keys``, or None while it runs in the background."""
        wanted = tuple(keys)
        pending = self._lookups.pop(req_id, None)
        if pending is not None and pending.keys == wanted:
            if not pending.future.done():
                self._lookups[req_id] = pending
                return None
            return _result(pending.future)
        found = self.cache.lookup_keys_now(keys)
        if found is not None:  # the tiers it needed answered from memory
            return found
        if self._lookup_thread is None:
            self._lookup_thread = ThreadPoolExecutor(1, thread_name_prefix="lmtier-lookup")
        future = self._lookup_thread.submit(self.cache.lookup_keys, keys)
        found = wait_briefly(future, self.settings.lookup_wait_ms, req_id, Lookup(0, ()))
        if found is None:
            keep_pending(self._lookups, req_id, _PendingLookup(wanted, future))
        return found

    def note_answer(self, req_id: str, num_computed: int, asynchronous: bool) -> None:
        """Take a hit found elsewhere (the hybrid scheduler's lookup over every group)
        as this half's answer, for :meth:`update_state_after_alloc`."""
        self._answers[req_id] = _Answer(num_computed, asynchronous)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Note the tokens to load; an asynchronous load is planned now, with the
        request's blocks (vLLM does not schedule the request until it has landed)."""
        req_id = request.request_id
        state = self._states.get(req_id)
        if state is None:
            state = self._states[req_id] = _RequestState(request)
        answer = self._answers.pop(req_id, None)
        state.num_load_tokens = num_external_tokens
        if num_external_tokens <= 0 or answer is None or not answer.asynchronous:
            return
        start = answer.num_computed
        end = start + num_external_tokens
        state.block_ids = list(blocks.get_block_ids()[self.group])
        if self.window is not None:
            start = self.window.load_start(start, end)
        first, stop = start // self.chunk_size, end // self.chunk_size
        self._async_loads.append(
            LoadSpec(
                req_id,
                self.refs(request, first, stop),
                start,
                end,
                tuple(state.block_ids[: end // self.block_size]),
                asynchronous=True,
            )
        )
        state.next_save_chunk = max(state.next_save_chunk, stop)
        state.num_load_tokens = 0

    # ---- per-step plan -------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LMTierConnectorMetadata:
        meta = LMTierConnectorMetadata(
            loads=self._async_loads,
            preempted_req_ids=frozenset(scheduler_output.preempted_req_ids or ()),
        )
        self._async_loads = []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._states.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[self.group])
                # Chunks inside vLLM's own prefix-cache hit were saved when this engine
                # computed them: no save plan (it would hold the request's blocks one
                # step longer for a save the worker skips).
                local_hit = new.num_computed_tokens - state.num_load_tokens
                state.next_save_chunk = max(state.next_save_chunk, local_hit // self.chunk_size)
                self._plan(state, new.num_computed_tokens, scheduler_output, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            state = self._states.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[index]
            # vLLM <= 0.33 resumes a preempted request here; 0.34 sends it as a new one.
            if req_id in getattr(cached, "resumed_req_ids", ()):
                state.block_ids = list(new_ids[self.group]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[self.group])
            self._plan(state, cached.num_computed_tokens[index], scheduler_output, meta)
        for req_id in scheduler_output.finished_req_ids:
            self._states.pop(req_id, None)
        return meta

    def _plan(
        self,
        state: _RequestState,
        num_computed: int,
        scheduler_output: SchedulerOutput,
        meta: LMTierConnectorMetadata,
    ) -> None:
        request, req_id = state.request, state.request.request_id
        if state.num_load_tokens > 0:
            end = num_computed
            start = end - state.num_load_tokens
            if self.window is not None:
                start = self.window.load_start(start, end)
            first, stop = start // self.chunk_size, end // self.chunk_size
            meta.loads.append(
                LoadSpec(
                    req_id,
                    self.refs(request, first, stop),
                    start,
                    end,
                    tuple(state.block_ids[: end // self.block_size]),
                )
            )
            state.next_save_chunk = max(state.next_save_chunk, stop)
            state.num_load_tokens = 0
        if not self.saves:
            return
        done = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        if not self.settings.save_decode_tokens:
            done = min(done, request.num_prompt_tokens)
        stop = self._num_keyable_chunks(request, done)
        first = state.next_save_chunk
        if self.window is not None:
            first, stop = self.window.save_range(request, first, stop)
        if stop <= first:
            return
        refs = self.refs(request, first, stop)
        block_ids = tuple(state.block_ids[: stop * self.blocks_per_chunk])
        event = self._stored_event(request, refs)
        meta.saves.append(SaveSpec(req_id, refs, block_ids, event))
        state.next_save_chunk = stop
        self._saving.add(req_id)

    def _stored_event(self, request: Request, refs: ChunkRefs) -> BlockStored:
        """The KV event of chunks to store into our tiers, for the workers to announce:
        vLLM's block hashes in the vLLM-hash mode, else one entry per chunk (our key,
        block size = chunk size)."""
        first, stop = refs.first_chunk, refs.first_chunk + refs.num_chunks
        tokens = request.all_token_ids[first * self.chunk_size : stop * self.chunk_size]
        if self.settings.vllm_block_hashes:
            per = self.blocks_per_chunk
            hashes: list[Any] = list(request.block_hashes[first * per : stop * per])
            parent = request.block_hashes[first * per - 1] if first else None
            size = self.block_size
        else:
            keys = chunk_keys(self.cache, refs)
            hashes = [bytes(key) for key in keys]
            parent = None
            size = self.chunk_size
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=list(tokens),
            block_size=size,
            lora_id=None,
            medium=self._medium,
            lora_name=None,
        )

    # ---- finishing -----------------------------------------------------------------

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """True while saves planned for the request may still read its blocks."""
        self._states.pop(request.request_id, None)
        self._answers.pop(request.request_id, None)
        self._hits.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        if request.request_id in self._saving:
            self._saving.discard(request.request_id)
            return True
        return False

    def add_worker_events(self, events: Iterable[KVCacheEvent]) -> None:
        """Count the per-chunk events workers report: publish a ``BlockStored`` once all
        savers sent it, a ``BlockRemoved`` when the first one does."""
        reported, removed = self._reported, self._removed
        for event in events:
            if isinstance(event, BlockRemoved):
                removed[event] += 1
                if removed[event] == 1:
                    self._events.append(event)
                if removed[event] >= self._num_savers:
                    del removed[event]
                continue
            reported[event] += 1
            if reported[event] >= self._num_savers:
                del reported[event]
                self._events.append(event)
        for counter in (reported, removed):
            while len(counter) > MAX_PENDING_EVENTS:
                del counter[next(iter(counter))]

    def take_events(self) -> Iterable[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def shutdown(self) -> None:
        """Stop the lookup thread (a lookup in flight is abandoned, not awaited)."""
        self._lookups.clear()
        if self._lookup_thread is not None:
            self._lookup_thread.shutdown(wait=False, cancel_futures=True)
            self._lookup_thread = None


def _result(future: Future[Lookup]) -> Lookup:
    """A finished background lookup's answer; a failure is a miss."""
    try:
        return future.result()
    except Exception as exc:
        lookup_failed(exc, "a background lookup")
        return Lookup(0, ())
