"""Which peers the tier may ask for a chunk: the owners the directory named, as far
as this node trusts them.

The directory lives in a shared Redis, and whoever can write it can name any owner
at any address. So an owner is asked only when

* its address is a plain ``host:port`` that ``peer.allowed_peers`` allows (never a
  ``unix:`` path, a ``dns:`` target or a host the operator did not list), and
* it has not just failed: an owner whose call failed (dead, hung, refused this node's
  proof, could not prove its own) is left alone for a while, one second at first,
  doubling while it keeps failing, up to :data:`MAX_BACKOFF_S`; a success forgets it.
  So a lookup stops counting chunks that a load would not get, from the first failure
  on, and a dead owner costs one timeout per backoff, not one per request.

It also remembers the owners that lookups found (:data:`OWNER_CACHE` keys), so the
read after a lookup needs no second directory call.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from lmtier.chunks.keys import ChunkKey
from lmtier.config.peer import AddressPolicy
from lmtier_backends.peer.directory import Owner

__all__ = ["MAX_BACKOFF_S", "OWNER_CACHE", "Owners"]

logger = logging.getLogger(__name__)

OWNER_CACHE = 65536
"""Owners remembered from lookups (a stale one costs a miss: the peer no longer has
the chunk)."""
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


@dataclass(slots=True)
class _Failing:
    until: float
    backoff_s: float


class Owners:
    """The owners this node may ask (module docstring); loop-bound, no I/O."""

    def __init__(
        self, policy: AddressPolicy, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.policy = policy
        self._clock = clock
        self._known: OrderedDict[ChunkKey, Owner] = OrderedDict()
        self._failing: dict[str, _Failing] = {}
        self._refused: set[str] = set()

    def dialable(self, owner: Owner | None) -> bool:
        """Whether ``owner`` may be asked now: allowed, and not failing."""
        if owner is None:
            return False
        address = owner[1]
        if not self.policy.allows(address):
            if address not in self._refused and len(self._refused) < 1024:
                self._refused.add(address)
                logger.warning(
                    "the peer directory names node %r at %r, which peer.allowed_peers "
                    "does not allow: not dialled (add its network or name if it is a "
                    "node of this cluster)",
                    owner[0][:64],
                    address[:80],
                )
            return False
        failing = self._failing.get(address)
        return failing is None or self._clock() >= failing.until

    def failed(self, address: str) -> None:
        """A call to ``address`` failed: leave it alone for its backoff."""
        failing = self._failing.get(address)
        backoff = FIRST_BACKOFF_S if failing is None else min(failing.backoff_s * 2, MAX_BACKOFF_S)
        self._failing[address] = _Failing(self._clock() + backoff, backoff)
        for key in [k for k, owner in self._known.items() if owner[1] == address]:
            del self._known[key]

    def succeeded(self, address: str) -> None:
        """A call to ``address`` answered: it is healthy again."""
        self._failing.pop(address, None)

    def remember(self, key: ChunkKey, owner: Owner) -> None:
        """``owner`` holds ``key`` (a lookup found it)."""
        self._known[key] = owner
        self._known.move_to_end(key)
        if len(self._known) > OWNER_CACHE:
            self._known.popitem(last=False)

    def get(self, key: ChunkKey) -> Owner | None:
        """The owner a lookup found for ``key``, if remembered."""
        return self._known.get(key)

    def forget(self, key: ChunkKey) -> None:
        """Forget ``key``'s owner (its entry was withdrawn)."""
        self._known.pop(key, None)
