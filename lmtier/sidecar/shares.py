"""What one caller may hold at once: its share of the sidecar's sessions and slabs.

Sessions and slabs are one pool for every token. Without a bound per token, one
tenant could open every session (the others' ``OpenSession`` then fail) or hold every
slab (100 stalled ``StoreStream`` calls of one tenant held 80 of 80, and another
stored 0 of 4). So each :class:`~lmtier.sidecar.auth.Principal` (each configured
token) may hold at most ``sidecar.token_share`` of ``max_sessions`` and of the pool's
slabs; by default that is an equal share, 1 / the number of tokens, so the shares add
up to the pool and each token always gets its own, whatever the others hold. A slab
counts against a caller while a lease of its sessions holds it (a loaded chunk being
read, a slab being filled) and while one of its streaming calls holds it
(:mod:`.holds`); it stops counting when it is released or handed to the cache.

The rejected alternative, shares that stretch while others are idle: the slabs a
client holds cannot be taken back early without corrupting what it reads or writes,
so a share lent to one tenant would be missing when another comes.

Runs on the sidecar's event loop, like the sessions: no locks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lmtier.errors import CapacityError
from lmtier.sidecar.auth import Principal

__all__ = ["Shares"]

_UNBOUNDED = 1 << 62


@dataclass(slots=True)
class _Held:
    sessions: int = 0
    slabs: int = 0


class Shares:
    """What each principal holds, and the most it may (module docstring).

    ``sessions_each`` and ``slabs_each`` are the bounds of one principal. Principals
    are told apart by identity, as sessions are: two tokens with one name and scope
    are two callers."""

    __slots__ = ("_held", "reclaimed", "refusals", "sessions_each", "slabs_each")

    def __init__(self, sessions_each: int = _UNBOUNDED, slabs_each: int = _UNBOUNDED) -> None:
        self.sessions_each = sessions_each
        self.slabs_each = slabs_each
        self._held: dict[int, _Held] = {}
        self.refusals = 0
        """Requests for slabs that got none because their caller held its whole share,
        since start (a chunk a store dropped, a load or AcquireSlabs refused)."""
        self.reclaimed = 0
        """Slabs taken back from streaming calls that stalled (:mod:`.holds`)."""

    @classmethod
    def of(cls, share: float, *, max_sessions: int, num_slabs: int) -> Shares:
        """Bounds of ``share`` (0 < share <= 1) of ``max_sessions`` and ``num_slabs``,
        rounded down (at least one of each); none for a share of 1 (the pool's own
        limits answer then, with their own messages)."""

        def part(total: int) -> int:
            if share >= 1:
                return _UNBOUNDED
            return max(1, math.floor(total * share + 1e-9))  # 0.29 * 100 is 28.999...

        return cls(part(max_sessions), part(num_slabs))

    def _of(self, principal: Principal) -> _Held:
        return self._held.setdefault(id(principal), _Held())

    def _drop_if_idle(self, principal: Principal) -> None:
        held = self._held.get(id(principal))
        if held is not None and held.sessions == 0 and held.slabs == 0:
            del self._held[id(principal)]

    # ---- sessions ------------------------------------------------------------------

    def open_session(self, principal: Principal) -> None:
        """Count a session of ``principal``; CapacityError when it has its share open."""
        held = self._of(principal)
        if held.sessions >= self.sessions_each:
            raise CapacityError(
                f"{principal.name} has {held.sessions} sessions open, its share of "
                "sidecar.max_sessions (sidecar.token_share): close some"
            )
        held.sessions += 1

    def close_session(self, principal: Principal) -> None:
        """A session of ``principal`` has closed."""
        self._of(principal).sessions -= 1
        self._drop_if_idle(principal)

    # ---- slabs ---------------------------------------------------------------------

    def slabs_held(self, principal: Principal) -> int:
        """Slabs counted against ``principal`` now."""
        held = self._held.get(id(principal))
        return 0 if held is None else held.slabs

    def take(self, principal: Principal, wanted: int) -> int:
        """Count up to ``wanted`` more slabs against ``principal``, as many as its share
        leaves room for; how many (the caller gives back what it does not use). None
        at all is counted in :attr:`refusals`."""
        held = self._of(principal)
        taken = max(0, min(wanted, self.slabs_each - held.slabs))
        held.slabs += taken
        if wanted and not taken:
            self.refusals += 1
            self._drop_if_idle(principal)
        return taken

    def take_some(self, principal: Principal, wanted: int) -> int:
        """:meth:`take`, but CapacityError when not one slab is left in the share."""
        taken = self.take(principal, wanted)
        if wanted and not taken:
            raise CapacityError(
                f"{principal.name} holds {self.slabs_each} slabs, its share of the pool "
                "(sidecar.token_share): release some first"
            )
        return taken

    def give(self, principal: Principal, count: int = 1) -> None:
        """``count`` slabs of ``principal`` are no longer held."""
        if count:
            self._of(principal).slabs -= count
            self._drop_if_idle(principal)
