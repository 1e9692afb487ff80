"""The peer directory: which node's CPU tier holds which chunk, kept in the shared Redis.

Two kinds of keys, all under one hash tag so that a Redis Cluster keeps them in one
slot and one script can read them together::

    <prefix>{peer}:node:<node id>     -> the node's peer address (host:port), PX ttl
    <prefix>{peer}:chunk:<key hex>    -> the id of the node that holds the chunk, PX ttl

A node's entry is its heartbeat: refreshed every third of ``ttl_s``, gone ``ttl_s``
after the node stops. A chunk entry names one owner; a lookup returns an owner only
while that owner's node entry lives, so a dead node's chunks stop being found when its
heartbeat expires, whatever their own TTLs (which only bound the garbage).

Every operation is one Lua script per batch (one round trip, atomic):

* **lookup**: for each key, its owner and the owner's address, stopping at the first
  key without a live owner (``contains`` needs the leading run only), or for every
  key (a read). The answer is compact, as a reply of many small strings costs more
  to parse than to make: the distinct live owners once each (id, address), after
  one string of two bytes per key, big-endian, the key's owner's place in that list
  (from 1; 0: none);
* **publish**: a node claims chunks it holds; an entry owned by another live node is
  left alone (the first holder keeps serving it; a node that loaded a chunk from a
  peer does not take it over), one owned by a dead node is taken;
* **withdraw**: compare-and-delete: only the named owner's entries go, so a node that
  evicted a chunk never removes another node's claim.

Failures, connections and scripts are :class:`~lmtier_backends.redis.scripted.ScriptedRedis`'s:
a directory whose Redis is down at start costs misses, not a failed open.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from lmtier.chunks.keys import ChunkKey
from lmtier.config.secrets import SecretURL
from lmtier_backends.redis.scripted import ScriptedRedis

__all__ = ["BATCH_KEYS", "Owner", "PeerDirectory"]


BATCH_KEYS = 1024
"""Keys per script call: large enough to amortise the round trip, small enough not to
hold Redis (single-threaded) for more than about a millisecond."""
CHUNK_TTL_FACTOR = 3
"""Chunk entries live this many ``ttl_s`` (refreshed every ``ttl_s``): two refreshes may
be lost before an entry of a live node expires."""

Owner = tuple[str, str]
"""A chunk's holder: (node id, peer address)."""

_LOOKUP = """
local found = redis.call('MGET', unpack(KEYS))
local every = ARGV[2] == '1'
local out = {''}
local slots = {}
local index = {}
local count = 0
for i = 1, #KEYS do
  local owner = found[i]
  local slot = 0
  if owner then
    slot = slots[owner]
    if slot == nil then
      slot = 0
      local address = redis.call('GET', ARGV[1] .. owner)
      if address then
        count = count + 1
        slot = count
        out[#out + 1] = owner
        out[#out + 1] = address
      end
      slots[owner] = slot
    end
  end
  if slot == 0 and not every then
    break
  end
  index[i] = string.char(math.floor(slot / 256), slot % 256)
end
out[1] = table.concat(index)
return out
"""

_PUBLISH = """
local claimed = 0
for i, key in ipairs(KEYS) do
  local owner = redis.call('GET', key)
  if (not owner) or owner == ARGV[1] or redis.call('EXISTS', ARGV[3] .. owner) == 0 then
    redis.call('SET', key, ARGV[1], 'PX', ARGV[2])
    claimed = claimed + 1
  end
end
return claimed
"""

_WITHDRAW = """
local removed = 0
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    redis.call('DEL', key)
    removed = removed + 1
  end
end
return removed
"""

_LEAVE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class PeerDirectory:
    """The directory in Redis (module docstring). Loop-bound; ``close`` when done."""

    def __init__(
        self,
        url: str | SecretURL,
        *,
        key_prefix: str = "lmtier:",
        ttl_s: float = 15.0,
        timeout_s: float = 1.0,
        max_connections: int = 4,
    ) -> None:
        base = f"{key_prefix}{{peer}}:"
        self._node_prefix = f"{base}node:"
        self._chunk_prefix = f"{base}chunk:".encode()
        self.ttl_s = ttl_s
        self._redis = ScriptedRedis(
            url, what="peer directory", timeout_s=timeout_s, max_connections=max_connections
        )
        self.timeout_s = timeout_s
        self.where = self._redis.where

    def __repr__(self) -> str:
        return f"PeerDirectory({self.where})"

    # ---- names ---------------------------------------------------------------------

    def chunk_name(self, key: ChunkKey) -> bytes:
        """The Redis key of chunk ``key``'s entry."""
        return self._chunk_prefix + key.hex().encode()

    def node_name(self, node_id: str) -> str:
        """The Redis key of node ``node_id``'s heartbeat."""
        return self._node_prefix + node_id

    # ---- operations ----------------------------------------------------------------

    async def lookup(self, keys: Sequence[ChunkKey], *, every: bool = False) -> list[Owner | None]:
        """The owner of each key: the leading run of keys with a live owner (a shorter
        list), or with ``every`` one entry per key, None where no live node holds it."""
        owners: list[Owner | None] = []
        for start in range(0, len(keys), BATCH_KEYS):
            batch = keys[start : start + BATCH_KEYS]
            packed, *pairs = await self._run(
                "lookup",
                _LOOKUP,
                [self.chunk_name(key) for key in batch],
                [self._node_prefix, "1" if every else "0"],
            )
            table: list[Owner | None] = [None]
            table += [(_text(pairs[i]), _text(pairs[i + 1])) for i in range(0, len(pairs), 2)]
            places = struct.unpack(f">{len(packed) // 2}H", packed)
            owners += [table[place] for place in places]
            if not every and len(places) < len(batch):
                break
        return owners

    async def publish(self, node_id: str, keys: Sequence[ChunkKey]) -> int:
        """Claim ``keys`` for ``node_id`` (refreshing its own claims); how many it holds now."""
        ttl_ms = str(int(self.ttl_s * CHUNK_TTL_FACTOR * 1000))
        claimed = 0
        for start in range(0, len(keys), BATCH_KEYS):
            names = [self.chunk_name(key) for key in keys[start : start + BATCH_KEYS]]
            claimed += int(
                await self._run("publish", _PUBLISH, names, [node_id, ttl_ms, self._node_prefix])
            )
        return claimed

    async def withdraw(self, node_id: str, keys: Sequence[ChunkKey]) -> int:
        """Remove the entries of ``keys`` that ``node_id`` owns; how many went."""
        removed = 0
        for start in range(0, len(keys), BATCH_KEYS):
            names = [self.chunk_name(key) for key in keys[start : start + BATCH_KEYS]]
            removed += int(await self._run("withdraw", _WITHDRAW, names, [node_id]))
        return removed

    async def heartbeat(self, node_id: str, address: str) -> None:
        """Announce (or keep alive) ``node_id`` at ``address`` for ``ttl_s``."""
        route = await self._redis.connected()
        ttl_ms = int(self.ttl_s * 1000)
        await self._redis.call(route.client.set(self.node_name(node_id), address, px=ttl_ms))

    async def leave(self, node_id: str, address: str) -> None:
        """Remove ``node_id``'s heartbeat if it still names ``address``: its chunks stop
        being found at once."""
        await self._run("leave", _LEAVE, [self.node_name(node_id)], [address])

    async def close(self) -> None:
        """Close the connections; idempotent."""
        await self._redis.close()

    async def _run(self, name: str, source: str, keys: list[Any], args: list[Any]) -> Any:
        return await self._redis.run(name, source, keys, args)


def _text(value: Any) -> str:
    """A directory value as text: anyone who can write the Redis may have written any
    bytes, which then fail the address checks (:mod:`.owners`), never a decode."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
