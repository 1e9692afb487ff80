"""Slabs the sidecar holds for a streaming call (``LoadStream``, ``StoreStream``):
counted against the caller's share, and reclaimed when the call stops moving bytes.

A shared-memory client's slabs are leases of its session: ended with the session and
reclaimed past ``lease_ttl_s``. A streaming call's slabs are held by the call itself,
in the sidecar, while the stream moves their bytes; a peer that stops reading (or
sending) mid-stream would hold them for as long as it keeps the stream open. So a
:class:`StreamHold` counts them against the caller's share (:mod:`.shares`: a tenant's
stalled streams never hold another's slabs) and reclaims them once the call has
moved nothing for ``sidecar.stream_stall_s`` (10 s), or ``lease_ttl_s`` after it took
a slab, whichever is first: a load stream then ends at the next chunk (the rest is a
miss to the client), a store stream drops the chunk it was receiving. Reclaiming runs
on the event loop, like the handlers: never in the middle of a copy.
"""

from __future__ import annotations

import asyncio

from lmtier.chunks.keys import ChunkKey
from lmtier.errors import InvalidRequestError
from lmtier.sidecar.auth import Principal
from lmtier.sidecar.shares import Shares
from lmtier.storage.host_pool import SlabHandle
from lmtier.wire.pieces import Piece

__all__ = ["Incoming", "StreamHold"]


class StreamHold:
    """The slabs one streaming call holds for ``principal`` (module docstring).

    A slab is first counted (:meth:`reserve`, before the await that produces it),
    then held (:meth:`hold`); it leaves by :meth:`let_go` (released) or
    :meth:`hand_over` (the caller passes it on, e.g. to the cache), or is reclaimed
    by the timer. :meth:`close` ends the call's hold on everything."""

    __slots__ = (
        "_held",
        "_loop",
        "_moved",
        "_principal",
        "_reserved",
        "_shares",
        "_stall_s",
        "_timer",
        "_ttl_s",
    )

    def __init__(
        self, shares: Shares, principal: Principal, *, stall_s: float, ttl_s: float
    ) -> None:
        self._shares, self._principal = shares, principal
        self._stall_s, self._ttl_s = stall_s, ttl_s
        self._loop = asyncio.get_running_loop()
        self._moved = self._loop.time()
        self._held: dict[SlabHandle, float] = {}  # each slab's deadline: taken + ttl_s
        self._reserved = 0
        self._timer: asyncio.TimerHandle | None = None

    def reserve(self, wanted: int, *, required: bool = False) -> int:
        """Count up to ``wanted`` slabs against the caller's share; how many. With
        ``required``, CapacityError when the share has no room for one."""
        take = self._shares.take_some if required else self._shares.take
        taken = take(self._principal, wanted)
        self._reserved += taken
        return taken

    def unreserve(self) -> None:
        """Give back what was reserved and not held."""
        self._shares.give(self._principal, self._reserved)
        self._reserved = 0

    def hold(self, handle: SlabHandle) -> None:
        """Hold ``handle`` (reserved before) until it is let go or reclaimed."""
        if self._reserved <= 0:
            raise RuntimeError("StreamHold.hold: no slab was reserved (a bug in the caller)")
        self._reserved -= 1
        self._held[handle] = self._loop.time() + self._ttl_s
        self._arm()

    def holds(self, handle: SlabHandle) -> bool:
        """Whether ``handle`` is still held (not reclaimed, let go or handed over)."""
        return handle in self._held

    def moved(self) -> None:
        """The call moved bytes: its stall clock starts again. (Cheap: one per piece;
        the timer finds out when it fires.)"""
        self._moved = self._loop.time()

    def let_go(self, handle: SlabHandle) -> None:
        """Release ``handle`` unless it was already reclaimed or passed on."""
        if self._held.pop(handle, None) is not None:
            self._shares.give(self._principal)
            if not handle.released:
                handle.release()

    def hand_over(self, handle: SlabHandle) -> bool:
        """Stop holding ``handle`` without releasing it (its new owner will); False if
        it was reclaimed meanwhile (then it is no longer the caller's)."""
        if self._held.pop(handle, None) is None:
            return False
        self._shares.give(self._principal)
        return True

    def close(self) -> None:
        """Release every slab held and give back every count. Idempotent."""
        for handle in list(self._held):
            self.let_go(handle)
        self.unreserve()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self) -> None:
        """A timer for the next moment something may have to be reclaimed."""
        if self._timer is not None or not self._held:
            return
        when = min(self._moved + self._stall_s, *self._held.values())
        self._timer = self._loop.call_at(when, self._expire)

    def _expire(self) -> None:
        self._timer = None
        now = self._loop.time()
        stalled = now >= self._moved + self._stall_s
        for handle, deadline in list(self._held.items()):
            if stalled or deadline <= now:
                self.let_go(handle)
                self._shares.reclaimed += 1
        self._arm()


class Incoming:
    """The chunk a ``StoreStream`` is receiving, filled piece by piece in order into
    ``handle``, held by the call's ``hold`` (None: no slab for it, and the chunk is
    dropped; also once ``hold`` reclaims it)."""

    __slots__ = ("filled", "handle", "hold", "key", "length")

    def __init__(
        self, key: ChunkKey, length: int, handle: SlabHandle | None, hold: StreamHold
    ) -> None:
        self.key, self.length, self.filled, self.handle, self.hold = key, length, 0, handle, hold

    def add(self, piece: Piece) -> bool:
        """Write the next piece; whether the chunk is complete."""
        end = self.filled + len(piece.data)
        if piece.offset != self.filled or end > self.length:
            raise InvalidRequestError("chunk pieces must come in order, within its length")
        if self.handle is not None and not self.hold.holds(self.handle):
            self.handle = None  # reclaimed: the chunk is dropped
        if self.handle is not None:
            self.handle.view[self.filled : end] = piece.data
        self.filled = end
        return end == self.length

    def take(self) -> SlabHandle | None:
        """The complete chunk's slab, the caller's from now on (None: dropped)."""
        handle, self.handle = self.handle, None
        if handle is None or not self.hold.hand_over(handle):
            return None
        return handle

    def close(self) -> None:
        """Give the slab back (the stream failed or ended inside the chunk)."""
        if self.handle is not None:
            self.hold.let_go(self.handle)
            self.handle = None
