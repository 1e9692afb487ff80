"""The worker half of the vLLM connector for hybrid models (several KV cache groups,
:mod:`lmtier_connector.vllm.hybrid`).

One :class:`~lmtier_connector.vllm.worker.WorkerHalf` per group, each with its own
cache (namespace) and the pages of its own layers (vLLM's layers of different groups
may share memory: their block ids never collide), runs that group's part of the step
plan (:class:`~lmtier_connector.vllm.hybrid.HybridMetadata`). A layer's
``wait_for_layer_load`` and ``save_kv_layer`` go to the group that owns it. What vLLM
is told about a request waits for every group: a finished request's saves are
through once no group still saves it, an asynchronous load has landed once every
group's part of it has (each group gets a part of every load, empty where its window
needs nothing). Load errors are the union of the groups' (block ids are unique across
groups), as are KV events and counters.

Sliding-window blocks are freed while the request runs, as the window moves; a
save gathers them in the forward pass that writes them. On CUDA that gather runs on
the save stream, so before the next step's forward pass the compute stream waits for
the saves enqueued so far (:meth:`HybridWorker.bind`): a freed block is never
rewritten before its copy (on the CPU the copies are synchronous).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from lmtier_connector.vllm.common import LMTierConnectorMetadata, LMTierKVEvents
from lmtier_connector.vllm.hybrid import HybridMetadata, KVGroup
from lmtier_connector.vllm.stats import LMTierConnectorStats
from lmtier_connector.vllm.worker import WorkerHalf

__all__ = ["HybridWorker"]


class HybridWorker:
    """Worker-side logic for several KV cache groups (module docstring); the same
    methods as :class:`WorkerHalf`, which :class:`LMTierConnector` delegates to."""

    def __init__(self, halves: Sequence[WorkerHalf], groups: Sequence[KVGroup]) -> None:
        self.halves = list(halves)
        self.groups = list(groups)
        self._loads_landed: Counter[str] = Counter()  # groups whose part of a load landed
        self._sent: set[str] = set()  # finished requests some group reported as saved
        self._fence = False  # saves were enqueued on a CUDA save stream last step

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Each group registers its own layers' pages."""
        for half, group in zip(self.halves, self.groups, strict=True):
            half.register_kv_caches({name: kv_caches[name] for name in group.layer_names})

    def _parts(self, meta: LMTierConnectorMetadata) -> list[LMTierConnectorMetadata]:
        if isinstance(meta, HybridMetadata) and len(meta.groups) == len(self.halves):
            return meta.groups
        empty = LMTierConnectorMetadata(preempted_req_ids=meta.preempted_req_ids)
        return [empty] * len(self.halves)

    def handle_preemptions(self, meta: LMTierConnectorMetadata) -> None:
        for half, part in zip(self.halves, self._parts(meta), strict=True):
            half.handle_preemptions(part)

    def bind(self, meta: LMTierConnectorMetadata) -> None:
        if self._fence:
            self._fence = False
            for half in self.halves:
                if half.engine is not None:
                    half.engine.fence_saves()
        for half, part in zip(self.halves, self._parts(meta), strict=True):
            half.bind(part)

    def start_load(self, meta: LMTierConnectorMetadata) -> None:
        for half, part in zip(self.halves, self._parts(meta), strict=True):
            half.start_load(part)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for half in self.halves:
            half.wait_for_layer_load(layer_name)  # a no-op in groups without the layer

    def save_layer(self, layer_name: str) -> None:
        for half in self.halves:
            half.save_layer(layer_name)

    def wait_for_save(self) -> None:
        for half in self.halves:
            if half._save is not None and half.pages is not None:
                self._fence |= half.pages.device.type == "cuda"
            half.wait_for_save()

    def finished_saves(self, finished_req_ids: set[str]) -> set[str]:
        """Finished requests whose saves are through in every group."""
        for half in self.halves:
            self._sent |= half.finished_saves(finished_req_ids)
        done = {r for r in self._sent if not any(r in h._saving_reqs for h in self.halves)}
        self._sent -= done
        return done

    def finished_loads(self) -> set[str]:
        """Requests whose asynchronous load landed in every group."""
        for half in self.halves:
            self._loads_landed.update(half.finished_loads())
        done = {r for r, n in self._loads_landed.items() if n >= len(self.halves)}
        for req_id in done:
            del self._loads_landed[req_id]
        return done

    def failed_block_ids(self) -> set[int]:
        failed: set[int] = set()
        for half in self.halves:
            failed |= half.failed_block_ids()
        return failed

    def take_events(self) -> LMTierKVEvents | None:
        events = []
        for half in self.halves:
            got = half.take_events()
            if got is not None:
                events.extend(got.get_all_events())
        return LMTierKVEvents(events) if events else None

    def take_stats(self) -> LMTierConnectorStats | None:
        total: LMTierConnectorStats | None = None
        for half in self.halves:
            got = half.take_stats()
            if got is not None:
                total = got if total is None else total.aggregate(got)
        return total

    def shutdown(self) -> None:
        for half in self.halves:
            half.shutdown()
