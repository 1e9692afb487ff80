"""The scheduler half of the vLLM connector for hybrid models (several KV cache groups,
:mod:`lmtier_connector.vllm.hybrid`).

One :class:`~lmtier_connector.vllm.scheduler.SchedulerHalf` per group plans that
group's loads and saves with that group's block ids and its own cache (namespace);
a sliding-window group's half narrows its loads to the blocks vLLM holds and its saves
to the window chunks (:class:`~lmtier_connector.vllm.common.SaveWindow`). What this
module adds is the lookup over every group and the step plan that bundles the groups'
plans (:class:`~lmtier_connector.vllm.hybrid.HybridMetadata`).

**The hit.** vLLM's hybrid prefix cache (its coordinator) hands the connector a local
hit that every group agrees on, and expects the tokens the connector adds beyond it
to be complete for every group: for a hit ending at token ``H``, full-attention
groups need every token before ``H``, sliding-window groups only the window before it
(vLLM allocates null blocks below; ``supports_divergent_local_hybrid_hits`` stays
False: there is no recurrent state to restore). So the lookup first asks each
full-attention group's cache how many leading chunks it holds from the local hit
on, then walks back from there, chunk boundary by chunk boundary, to the first one
where every sliding-window group holds the chunks of its window (a sliding-window
group saves only the windows before its prompt's anchors, so the walk ends at one of
those, or at the local hit: no hit). As for one group, the hit is whole chunks and
never covers the last prompt token, and a lookup that needs a remote tier runs on a
lookup thread, answered "not yet" past ``lookup_wait_ms``.

KV events carry each group's index, kind and window (``BlockStored.group_idx``,
``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``, where vLLM's events have
them): a sliding-window group announces only the window chunks it stored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import msgspec
from vllm.distributed.kv_events import BlockStored, KVCacheEvent
from vllm.v1.core.sched.output import SchedulerOutput

from lmtier import Lookup, TierSpan
from lmtier.chunks.keys import ChunkKey
from lmtier_connector.vllm.common import ConnectorSettings, SaveSpec, chunk_keys
from lmtier_connector.vllm.hit_sources import FoundHit
from lmtier_connector.vllm.hybrid import HybridMetadata, KVGroup
from lmtier_connector.vllm.lookups import keep_pending, lookup_failed, wait_briefly
from lmtier_connector.vllm.scheduler import SchedulerHalf

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.request import Request

__all__ = ["HybridScheduler"]

_GROUP_FIELDS = {"group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}
_EVENTS_NAME_GROUPS = set(BlockStored.__struct_fields__) >= _GROUP_FIELDS

LookupFn = Callable[[SchedulerHalf, Sequence[ChunkKey]], Lookup | None]
"""Asks one group's cache about keys; None: it cannot answer without I/O."""


@dataclass(frozen=True, slots=True)
class _Hit:
    """Where a hit ends (a chunk index), how long its read should take (every group's
    chunks, :mod:`~lmtier_connector.vllm.load_paths`) and the lead group's spans (where
    the hit's tokens come from, for vLLM's hit sources)."""

    end_chunk: int
    expected_s: float = 0.0
    spans: tuple[TierSpan, ...] = ()


@dataclass(frozen=True, slots=True)
class _Pending:
    """A lookup still running on the lookup thread, for chunks ``[first, stop)``."""

    first: int
    stop: int
    future: Future[_Hit]


class HybridScheduler:
    """Scheduler-side logic for several KV cache groups (module docstring); the same
    methods as :class:`SchedulerHalf`, which :class:`LMTierConnector` delegates to."""

    def __init__(
        self,
        halves: Sequence[SchedulerHalf],
        groups: Sequence[KVGroup],
        settings: ConnectorSettings,
    ) -> None:
        self.halves = list(halves)
        self.groups = list(groups)
        self.settings = settings
        self.chunk_size = self.halves[0].chunk_size
        self._pending: dict[str, _Pending] = {}
        self._lookup_thread: ThreadPoolExecutor | None = None
        # A full-attention group's half: its lookups say where a hit's tokens are.
        self._lead = next(
            (h for h, g in zip(self.halves, self.groups, strict=True) if g.window is None),
            self.halves[0],
        )

    # ---- lookup --------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond vLLM's local hit that every group can supply (module docstring)
        and whether they load asynchronously; ``(None, False)`` while a lookup of a
        remote tier is still running."""
        req_id = request.request_id
        lead = self.halves[0]
        stop = lead._num_keyable_chunks(request, request.num_tokens - 1)
        first = num_computed_tokens // self.chunk_size
        if first >= stop:
            self._pending.pop(req_id, None)
            return 0, False
        found = self._lookup(request, first, stop)
        if found is None:
            return None, False
        tokens = max(0, found.end_chunk * self.chunk_size - num_computed_tokens)
        asynchronous = tokens > 0 and self._lead.load_paths.decide(found.expected_s)
        for half in self.halves:
            half.note_answer(req_id, num_computed_tokens, asynchronous)
        self._lead.note_hit(req_id, FoundHit(num_computed_tokens, first, found.spans), tokens)
        return tokens, asynchronous

    def hit_sources(self, request: Request, num_tokens: int) -> dict[CacheHitSource, int]:
        """Where the tokens of the last hit came from (the lead group's tiers)."""
        return self._lead.hit_sources(request, num_tokens)

    def may_load_async(self, request: Request) -> bool:
        """What the lead group's walk without I/O says (:meth:`SchedulerHalf.may_load_async`)."""
        return self._lead.may_load_async(request)

    def observe_stats(self, stats: Mapping[str, float]) -> None:
        """The workers' read rates (every group's reads), for each group's load paths."""
        for half in self.halves:
            half.observe_stats(stats)

    def _lookup(self, request: Request, first: int, stop: int) -> _Hit | None:
        """The hit of chunks ``[first, stop)``, or None while it runs in the background."""
        req_id = request.request_id
        pending = self._pending.pop(req_id, None)
        if pending is not None and (pending.first, pending.stop) == (first, stop):
            if not pending.future.done():
                self._pending[req_id] = pending
                return None
            return _result(pending.future, first)
        keys = [chunk_keys(half.cache, half.refs(request, first, stop)) for half in self.halves]
        now = self._search(keys, first, stop, lambda half, k: half.cache.lookup_keys_now(k))
        if now is not None:  # every tier it asked answered from memory
            return now
        if self._lookup_thread is None:
            self._lookup_thread = ThreadPoolExecutor(1, thread_name_prefix="lmtier-lookup")

        def blocking(half: SchedulerHalf, k: Sequence[ChunkKey]) -> Lookup:
            return half.cache.lookup_keys(k)

        future = self._lookup_thread.submit(self._search_all, keys, first, stop, blocking)
        found = wait_briefly(future, self.settings.lookup_wait_ms, req_id, _Hit(first))
        if found is None:
            keep_pending(self._pending, req_id, _Pending(first, stop, future))
        return found

    def _search_all(
        self,
        keys: list[list[ChunkKey]],
        first: int,
        stop: int,
        lookup: Callable[[SchedulerHalf, Sequence[ChunkKey]], Lookup],
    ) -> _Hit:
        found = self._search(keys, first, stop, lookup)
        assert found is not None  # a blocking lookup always answers
        return found

    def _search(
        self, keys: list[list[ChunkKey]], first: int, stop: int, lookup: LookupFn
    ) -> _Hit | None:
        """The longest hit ending at most at chunk ``stop`` (``keys[g]``: group ``g``'s
        keys of chunks ``[first, stop)``); None as soon as ``lookup`` cannot answer."""
        end, seconds = stop, 0.0
        spans: tuple[TierSpan, ...] = ()
        windowed = []
        for half, group, group_keys in zip(self.halves, self.groups, keys, strict=True):
            if group.window is not None:
                windowed.append((half, group.window, group_keys))
                continue
            found = lookup(half, group_keys[: end - first])
            if found is None:
                return None
            end = first + found.num_chunks
            seconds += half.load_paths.expected_seconds(found.spans)
            spans = spans or tuple(found.spans)
        for candidate in range(end, first, -1):
            window_s = 0.0
            for half, window, group_keys in windowed:
                low = max(first, window.first_chunk(candidate))
                wanted = group_keys[low - first : candidate - first]
                found = lookup(half, wanted)
                if found is None:
                    return None
                if found.num_chunks < len(wanted):
                    break
                window_s += half.load_paths.expected_seconds(found.spans)
            else:
                return _Hit(candidate, seconds + window_s, spans)
        return _Hit(first)

    # ---- allocation, plans, finishing ----------------------------------------------

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        for half in self.halves:
            half.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> HybridMetadata:
        """Every group's plan for this step, its KV events naming the group."""
        metas = [half.build_connector_meta(scheduler_output) for half in self.halves]
        if _EVENTS_NAME_GROUPS:
            for group, meta in zip(self.groups, metas, strict=True):
                meta.saves = [_named(save, group) for save in meta.saves]
        return HybridMetadata(
            preempted_req_ids=frozenset(scheduler_output.preempted_req_ids or ()), groups=metas
        )

    def request_finished(self, request: Request, block_ids: Sequence[list[int]]) -> bool:
        """True while saves planned for the request may still read its blocks (of any
        group); ``block_ids`` holds one block table per group."""
        del block_ids
        self._pending.pop(request.request_id, None)
        delays = [half.request_finished(request, []) for half in self.halves]
        return any(delays)

    def add_worker_events(self, events: Iterable[KVCacheEvent]) -> None:
        """The workers' events, counted in one place: they name their group."""
        self.halves[0].add_worker_events(events)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.halves[0].take_events()

    def shutdown(self) -> None:
        self._pending.clear()
        if self._lookup_thread is not None:
            self._lookup_thread.shutdown(wait=False, cancel_futures=True)
            self._lookup_thread = None
        for half in self.halves:
            half.shutdown()


def _named(save: SaveSpec, group: KVGroup) -> SaveSpec:
    """``save`` with its KV event naming ``group`` (vLLM's per-group event fields)."""
    if save.stored_event is None:
        return save
    event = msgspec.structs.replace(
        save.stored_event,
        group_idx=group.index,
        kv_cache_spec_kind=group.kind,
        kv_cache_spec_sliding_window=group.sliding_window,
    )
    return replace(save, stored_event=event)


def _result(future: Future[_Hit], first: int) -> _Hit:
    """A finished background lookup's answer; a failure is a miss."""
    try:
        return future.result()
    except Exception as exc:
        lookup_failed(exc, "a background lookup")
        return _Hit(first)
