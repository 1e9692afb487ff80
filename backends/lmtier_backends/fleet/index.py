"""The fleet index: which node holds which chunk in which tier, in a shared Redis.

Keys, all under one hash tag (a Redis Cluster keeps them in one slot, and one script
reads them together)::

    <prefix>{fleet}:nodes         ZSET  node id -> heartbeat expiry (ms since the epoch)
    <prefix>{fleet}:c:<key hex>   HASH  owner -> tier bits (a decimal number)
    <prefix>{fleet}:o:<owner>     ZSET  key hex -> when the owner last wrote it (us)

An owner is a node id, or ``*`` for the tiers every node reads (Redis, S3: what one
node wrote there, any node can load). A chunk's hash has one field per owner; its
bits name the tiers (:data:`TIER_BITS`). Each owner's ZSET bounds what it keeps
(``max_keys``, the least recently written dropped first) and is how a node withdraws
everything at once.

* :meth:`FleetIndex.apply`: one script per batch of up to :data:`BATCH_KEYS` chunks
  sets and clears bits for this node and for ``*``, renews the heartbeat, trims;
* :meth:`FleetIndex.query`: one script, one round trip, for up to
  :data:`MAX_QUERY_KEYS` keys: the live nodes and each key's owners, until the first
  key nobody holds, as three strings (a reply of many small strings cost 4 ms to
  parse for 128 keys, this one a fourth of that); :func:`prefixes` turns that into
  each node's cached prefix, by tier;
* a node whose heartbeat expired is not in the answer, whatever its entries say (they
  expire ``entry_ttl_s`` after their last write).

Anyone who can write this Redis can make a node look like it holds chunks it does
not: that costs routing quality, never a wrong byte (the cache checks every chunk it
loads, and the router only sends requests to the engines it was given). Values are
parsed defensively: a field that is not a small number counts as nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmtier.chunks.keys import ChunkKey
from lmtier.config.fleet import NODE_ID
from lmtier.config.secrets import SecretURL
from lmtier_backends.redis.scripted import ScriptedRedis

__all__ = [
    "BATCH_KEYS",
    "MAX_QUERY_KEYS",
    "SHARED",
    "TIER_BITS",
    "Change",
    "FleetIndex",
    "Holding",
    "fastest_tier",
    "prefixes",
]

SHARED = "*"
"""The owner of what the shared tiers hold."""
TIER_BITS: dict[str, int] = {"cpu": 1, "disk": 2, "redis": 4, "s3": 8}
"""The tiers the index knows, fastest first; any other tier counts as ``other``."""
OTHER_BIT = 16
_TIER_ORDER = [*TIER_BITS, "other"]
_BIT_OF = {**TIER_BITS, "other": OTHER_BIT}
ALL_BITS = sum(_BIT_OF.values())
BATCH_KEYS = 1024
"""Chunks per apply script: about a millisecond of Redis's single thread."""
MAX_QUERY_KEYS = 256
"""Keys one query reads (a longer prompt is asked about its first 256 chunks)."""
RESET_BATCH = 4096
"""Entries one withdraw script removes (it runs until none is left)."""


def tier_bit(tier: str) -> int:
    """The bit of ``tier`` (a tier's name in lmtier's config)."""
    return TIER_BITS.get(tier, OTHER_BIT)


def fastest_tier(bits: int) -> str:
    """The name of the fastest tier among ``bits``."""
    for name in _TIER_ORDER:
        if bits & _BIT_OF[name]:
            return name
    return "other"


@dataclass(slots=True)
class Change:
    """Bits to set and clear on one chunk, for this node and for the shared owner."""

    node_set: int = 0
    node_clear: int = 0
    shared_set: int = 0
    shared_clear: int = 0

    def add(self, bit: int, *, shared: bool, held: bool) -> None:
        """The chunk is (``held``) or is no longer in the tier of ``bit``."""
        if shared:
            self.shared_set, self.shared_clear = _flip(
                self.shared_set, self.shared_clear, bit, held
            )
        else:
            self.node_set, self.node_clear = _flip(self.node_set, self.node_clear, bit, held)


def _flip(set_bits: int, clear_bits: int, bit: int, held: bool) -> tuple[int, int]:
    if held:
        return set_bits | bit, clear_bits & ~bit
    return set_bits & ~bit, clear_bits | bit


@dataclass(slots=True)
class Holding:
    """How much of a prompt's prefix one node can serve, and from which tiers."""

    chunks: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)

    def tokens_by_tier(self, chunk_size: int) -> dict[str, int]:
        return {tier: n * chunk_size for tier, n in self.by_tier.items()}


_APPLY = """
local node, now, expiry, stamp = ARGV[1], ARGV[2], ARGV[3], ARGV[7]
local ttl, maxkeys, cprefix = ARGV[4], tonumber(ARGV[5]), ARGV[6]
local known = tonumber(redis.call('ZSCORE', KEYS[1], node) or '0') or 0
redis.call('ZADD', KEYS[1], expiry, node)
local function update(hkey, owner, ozset, keyhex, set, clear)
  if set == 0 and clear == 0 then return end
  local cur = tonumber(redis.call('HGET', hkey, owner) or '0') or 0
  if cur < 0 or cur > 1023 then cur = 0 end
  local new = bit.band(bit.bor(cur, set), bit.bnot(clear))
  if new == 0 then
    redis.call('HDEL', hkey, owner)
    redis.call('ZREM', ozset, keyhex)
  else
    redis.call('HSET', hkey, owner, new)
    redis.call('PEXPIRE', hkey, ttl)
    redis.call('ZADD', ozset, stamp, keyhex)
  end
end
for i = 4, #KEYS do
  local a = 7 + (i - 4) * 5
  local keyhex = ARGV[a + 1]
  update(KEYS[i], node, KEYS[2], keyhex, tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]))
  update(KEYS[i], '*', KEYS[3], keyhex, tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]))
end
local function trim(ozset, owner)
  local excess = redis.call('ZCARD', ozset) - maxkeys
  if excess > 0 then
    local gone = redis.call('ZPOPMIN', ozset, excess)
    for j = 1, #gone, 2 do
      redis.call('HDEL', cprefix .. gone[j], owner)
    end
  end
  redis.call('PEXPIRE', ozset, ttl)
end
trim(KEYS[2], node)
trim(KEYS[3], '*')
if known < tonumber(now) then
  return 0
end
return 1
"""

_WITHDRAW = """
local gone = redis.call('ZPOPMIN', KEYS[1], tonumber(ARGV[3]))
for j = 1, #gone, 2 do
  redis.call('HDEL', ARGV[2] .. gone[j], ARGV[1])
end
return #gone / 2
"""

_QUERY = """
local live = redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[1], '+inf')
local rows = {}
for i = 2, #KEYS do
  local owners = redis.call('HGETALL', KEYS[i])
  if #owners == 0 then
    break
  end
  local row = {}
  for j = 1, #owners, 2 do
    local owner, bits = owners[j], owners[j + 1]
    if string.find(owner, '^[%w%.%_%-%*]+$') and string.find(bits, '^%d%d?%d?%d?$') then
      row[#row + 1] = owner .. '=' .. bits
    end
  end
  rows[#rows + 1] = table.concat(row, ',')
end
return {table.concat(live, '\\n'), table.concat(rows, '\\n'), #rows}
"""


class FleetIndex:
    """The index in Redis (module docstring). Loop-bound; ``close`` when done."""

    def __init__(
        self,
        url: str | SecretURL,
        *,
        key_prefix: str = "lmtier:",
        ttl_s: float = 10.0,
        entry_ttl_s: float = 3600.0,
        max_keys: int = 262_144,
        timeout_s: float = 1.0,
    ) -> None:
        base = f"{key_prefix}{{fleet}}:"
        self._nodes = f"{base}nodes"
        self._chunk_prefix = f"{base}c:"
        self._owner_prefix = f"{base}o:"
        self.ttl_s = ttl_s
        self.entry_ttl_s = entry_ttl_s
        self.max_keys = max_keys
        self._redis = ScriptedRedis(url, what="fleet index", timeout_s=timeout_s)
        self.where = self._redis.where

    def __repr__(self) -> str:
        return f"FleetIndex({self.where})"

    def chunk_name(self, key: ChunkKey | str) -> str:
        """The Redis key of a chunk's entry (``key`` or its hex)."""
        return self._chunk_prefix + (key if isinstance(key, str) else key.hex())

    def owner_name(self, owner: str) -> str:
        """The Redis key of an owner's ZSET."""
        return self._owner_prefix + owner

    # ---- a node's writes ---------------------------------------------------------------

    async def apply(self, node_id: str, changes: Mapping[ChunkKey, Change]) -> bool:
        """Set and clear the bits of ``changes`` for ``node_id`` (and the shared owner),
        renewing its heartbeat; in batches of :data:`BATCH_KEYS`. Whether the index
        knew the node as live before: False after its heartbeat expired or the Redis
        lost its data (the node's entries may be gone: it should start over)."""
        items = list(changes.items())
        known = True
        for start in range(0, max(1, len(items)), BATCH_KEYS):
            batch = items[start : start + BATCH_KEYS]
            now = int(time.time() * 1000)
            keys = [self._nodes, self.owner_name(node_id), self.owner_name(SHARED)]
            args: list[Any] = [
                node_id,
                now,
                now + int(self.ttl_s * 1000),
                int(self.entry_ttl_s * 1000),
                self.max_keys,
                self._chunk_prefix,
                int(time.time() * 1e6),  # the owners' ZSET scores: finer than ms
            ]
            for key, change in batch:
                hexed = key.hex()
                keys.append(self.chunk_name(hexed))
                args += [
                    hexed,
                    change.node_set,
                    change.node_clear,
                    change.shared_set,
                    change.shared_clear,
                ]
            known = bool(await self._redis.run("apply", _APPLY, keys, args)) and known
        return known

    async def heartbeat(self, node_id: str) -> bool:
        """Renew ``node_id``'s heartbeat (for ``ttl_s``); :meth:`apply`'s answer."""
        return await self.apply(node_id, {})

    async def owned(self, owner: str, namespace: bytes) -> list[ChunkKey]:
        """The chunks of ``namespace`` that ``owner`` has entries for (a scan: for a
        purge, which is rare)."""
        route = await self._redis.connected()
        found: list[ChunkKey] = []
        pattern = namespace.hex() + "*"
        cursor: Any = 0
        while True:
            cursor, page = await self._redis.call(
                route.client.zscan(self.owner_name(owner), cursor, match=pattern, count=1000)
            )
            for member, _ in page:
                text = member.decode() if isinstance(member, bytes) else str(member)
                try:
                    found.append(ChunkKey(bytes.fromhex(text)))
                except ValueError:
                    continue  # not written by lmtier: not ours to clear
            if int(cursor) == 0:
                return found

    async def withdraw(self, node_id: str) -> int:
        """Remove every entry of ``node_id``; how many there were."""
        removed = 0
        while True:
            count = int(
                await self._redis.run(
                    "withdraw",
                    _WITHDRAW,
                    [self.owner_name(node_id)],
                    [node_id, self._chunk_prefix, RESET_BATCH],
                )
            )
            removed += count
            if count < RESET_BATCH:
                return removed

    async def leave(self, node_id: str) -> None:
        """``node_id`` stops counting at once (its heartbeat removed)."""
        route = await self._redis.connected()
        await self._redis.call(route.client.zrem(self._nodes, node_id))

    # ---- the router's reads ------------------------------------------------------------

    async def query(
        self, keys: Sequence[ChunkKey], *, at: float | None = None
    ) -> tuple[list[str], list[dict[str, int]]]:
        """The live nodes (at time ``at``, default now), and for each of the leading
        ``keys`` (up to the first that no owner holds; at most :data:`MAX_QUERY_KEYS`)
        its owners' tier bits."""
        keys = keys[:MAX_QUERY_KEYS]
        now = int((time.time() if at is None else at) * 1000)
        reply = await self._redis.run(
            "query", _QUERY, [self._nodes, *(self.chunk_name(k) for k in keys)], [now]
        )
        live = [name for name in _text(reply[0]).split("\n") if NODE_ID.fullmatch(name)]
        rows = _text(reply[1]).split("\n") if int(reply[2]) else []
        return live, [_owners(row) for row in rows]

    async def close(self) -> None:
        await self._redis.close()


def prefixes(
    live: Iterable[str], owners: Sequence[Mapping[str, int]]
) -> tuple[dict[str, Holding], Holding]:
    """Each live node's cached prefix (its own tiers and the shared ones), and the
    shared tiers' alone, from :meth:`FleetIndex.query`'s answer."""
    shared = _walk(owners, None)
    return {node: _walk(owners, node) for node in live}, shared


def _walk(owners: Sequence[Mapping[str, int]], node: str | None) -> Holding:
    holding = Holding()
    for entry in owners:
        bits = entry.get(SHARED, 0) | (entry.get(node, 0) if node is not None else 0)
        if not bits:
            break
        tier = fastest_tier(bits)
        holding.chunks += 1
        holding.by_tier[tier] = holding.by_tier.get(tier, 0) + 1
    return holding


def _owners(row: str) -> dict[str, int]:
    """``owner=bits,...`` (the query script's row for one key) as a dict, what is not
    lmtier's left out."""
    out: dict[str, int] = {}
    for pair in row.split(",") if row else ():
        owner, _, value = pair.partition("=")
        if value.isdigit() and len(value) <= 4:
            bits = int(value) & ALL_BITS
            if bits and (owner == SHARED or NODE_ID.fullmatch(owner)):
                out[owner] = bits
    return out


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
