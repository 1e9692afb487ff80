"""What a waterfall lookup and a load return: which tier serves which chunks, and the
loaded chunks themselves (leases on pool slabs).

Kept apart from :mod:`lmtier.storage.manager`, which produces them, so that the
types engines hold (``Lookup``, ``LoadedChunk``) come without the manager's machinery.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lmtier.chunks.format import DecodedChunk
from lmtier.chunks.keys import ChunkKey
from lmtier.storage.cpu_tier import CPUTier
from lmtier.storage.host_pool import SlabHandle

__all__ = ["LoadedChunk", "Lookup", "TierSpan", "Walk"]


@dataclass(frozen=True, slots=True)
class TierSpan:
    """Chunks ``[start, stop)`` of a lookup are served by the tier ``tier``."""

    tier: str
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Lookup:
    """Result of a waterfall lookup: how many leading chunks hit, and who serves them."""

    num_chunks: int
    spans: tuple[TierSpan, ...]


@dataclass(slots=True)
class LoadedChunk:
    """A loaded chunk: a lease on the pool slab holding it, decoded in place.

    Release it (or use it as a context manager) once its payload has been copied
    where it is needed; until then its slab is never reused or evicted.
    """

    key: ChunkKey
    tier: str
    chunk: DecodedChunk
    handle: SlabHandle = field(repr=False)

    def release(self) -> None:
        """Give the slab back. Releasing twice raises HandleError."""
        self.handle.release()

    def __enter__(self) -> LoadedChunk:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self.handle.released:
            self.release()


class Walk:
    """One waterfall walk: the CPU tier's leading hits, then each tier's on the rest."""

    __slots__ = ("found", "keys", "spans")

    def __init__(self, keys: Sequence[ChunkKey], cpu_tier: CPUTier) -> None:
        self.keys = keys
        self.found = cpu_tier.count_prefix(keys)
        self.spans = [TierSpan(cpu_tier.name, 0, self.found)] if self.found else []

    @property
    def done(self) -> bool:
        return self.found == len(self.keys)

    @property
    def rest(self) -> Sequence[ChunkKey]:
        """The keys no tier asked so far holds: the next tier is asked about these only."""
        return self.keys[self.found :]

    def add(self, tier: str, count: int) -> None:
        if count:
            self.spans.append(TierSpan(tier, self.found, self.found + count))
            self.found += count

    def result(self) -> Lookup:
        return Lookup(self.found, tuple(self.spans))
