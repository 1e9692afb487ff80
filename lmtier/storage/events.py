"""What happens to chunks in each tier, told to whoever subscribes: the feed of KV
events (:mod:`lmtier.events`) and of the fleet index.

The StorageManager and its tiers :meth:`TierEvents.emit` an event when a tier gains
chunks (a store adopted by the CPU tier, a promotion, a write that landed in a byte
tier), loses them (an eviction, a delete of a corrupt chunk, a purge of the CPU
tier) or loses a whole namespace it cannot list (a byte tier's purge). Emitting runs
where the change happens (under the manager's lock, in any thread), so it only
appends to each subscriber's bounded queue: with no subscriber it costs one attribute
test. A subscriber that falls behind by more than its queue's bound loses the oldest
events and counts them (:attr:`Subscription.lost`); it should then rebuild its view
from the tiers rather than trust a stream with a hole.

Events are facts about this process's tiers, in the order they happened per tier. A
shared tier (Redis, S3) is told about what this node wrote or deleted there, not what
other nodes did, nor expiries it never saw.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from lmtier.chunks.keys import ChunkKey

__all__ = [
    "NAMES",
    "ChunkName",
    "EventKind",
    "NodeFeed",
    "Subscription",
    "TierEvent",
    "TierEvents",
]

EventKind = Literal["stored", "removed", "cleared"]
"""``stored``: the tier holds ``keys`` now; ``removed``: it no longer holds ``keys``;
``cleared``: it no longer holds any chunk of ``namespace`` (a purge of a tier that
cannot list what it deleted)."""


@dataclass(frozen=True, slots=True)
class TierEvent:
    """One change to one tier (module docstring)."""

    kind: EventKind
    tier: str
    keys: tuple[ChunkKey, ...] = ()
    namespace: bytes = b""
    at: float = field(default_factory=time.time)


ChunkName = tuple[bytes | None, tuple[bytes, ...]]
"""What an engine calls a chunk: the hash of the block before it (None for a
prompt's first), and the hashes of its blocks (vLLM's, with ``hash_algorithm: vllm``)."""
NAMES = 65_536
"""Chunks whose engine names are kept (about 600 bytes each), the last named first."""


class Subscription:
    """A bounded queue of events for one consumer (:meth:`TierEvents.subscribe`)."""

    def __init__(self, hub: TierEvents, max_events: int) -> None:
        self._hub = hub
        self._queue: deque[TierEvent] = deque()
        self._max = max_events
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self.lost = 0
        """Events dropped because this subscriber fell ``max_events`` behind."""

    def _put(self, event: TierEvent) -> None:
        with self._lock:
            if len(self._queue) >= self._max:
                self._queue.popleft()
                self.lost += 1
            self._queue.append(event)
            self._ready.set()

    def take(self, timeout_s: float | None = None) -> list[TierEvent]:
        """Every event queued so far, oldest first; waits up to ``timeout_s`` for one
        when none is (None: no wait)."""
        if timeout_s and not self._queue:
            self._ready.wait(timeout_s)
        with self._lock:
            events = list(self._queue)
            self._queue.clear()
            self._ready.clear()
        return events

    def close(self) -> None:
        """Stop receiving events."""
        self._hub.unsubscribe(self)


class TierEvents:
    """The event feed of one StorageManager's tiers (module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._subscribers: tuple[Subscription, ...] = ()
        self._lock = threading.Lock()
        self._names: OrderedDict[bytes, ChunkName] = OrderedDict()

    def name(self, names: Mapping[ChunkKey, ChunkName]) -> None:
        """Remember what the engine calls these chunks (the last :data:`NAMES`), so
        that their events carry the engine's block hashes (:mod:`lmtier.events.wire`).
        Nothing is kept while nobody listens."""
        if not self._subscribers or not names:
            return
        with self._lock:
            table = self._names
            for key, name in names.items():
                table[bytes(key)] = name
                table.move_to_end(bytes(key))
            while len(table) > NAMES:
                table.popitem(last=False)

    def name_of(self, key: ChunkKey) -> ChunkName | None:
        """What the engine calls chunk ``key``, if it said so lately."""
        return self._names.get(bytes(key))

    @property
    def active(self) -> bool:
        """Whether anyone listens (emitters may skip building an event otherwise)."""
        return bool(self._subscribers)

    def subscribe(self, max_events: int = 100_000) -> Subscription:
        """A new subscription, told of every event from now on."""
        if max_events < 1:
            raise ValueError(f"max_events must be at least 1, got {max_events}")
        subscription = Subscription(self, max_events)
        with self._lock:
            self._subscribers = (*self._subscribers, subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            self._subscribers = tuple(s for s in self._subscribers if s is not subscription)

    def emit(
        self,
        kind: EventKind,
        tier: str,
        keys: Sequence[ChunkKey] = (),
        *,
        namespace: bytes = b"",
    ) -> None:
        """Tell every subscriber (nothing when none, or when ``keys`` is empty for a
        ``stored``/``removed``)."""
        subscribers = self._subscribers
        if not subscribers or (kind != "cleared" and not keys):
            return
        event = TierEvent(kind, tier, tuple(keys), namespace)
        for subscription in subscribers:
            subscription._put(event)


@dataclass(frozen=True, slots=True)
class NodeFeed:
    """What a service that follows this node's tiers is given (the fleet index's
    writer, :func:`lmtier.storage.plugins.open_services`): the events from now on;
    ``held()``, each tier's keys now where the tier can list them without I/O (the
    CPU tier, the disk's index), to start from and to rebuild after lost events; and
    ``tiers``, the tiers that hold chunks of their own, each with whether other nodes
    read it too (Redis, S3) or only this one (CPU, disk; a peer tier holds none)."""

    events: TierEvents
    held: Callable[[], dict[str, list[ChunkKey]]]
    tiers: dict[str, bool]
