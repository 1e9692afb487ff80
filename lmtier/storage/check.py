"""What a loaded chunk must be before it is served: the chunk asked for, of the cache's
geometry, and (from a shared tier, when an integrity key is set) authentic.

Tiers validate checksums and keys as they read (``Tier.read_chunks``, which decodes
each chunk once); the last line of defence is here, in the StorageManager, for every
tier including host memory: a slab reused too early, a tier bug or a planted chunk
must never put another prompt's or another model's KV into a request. The geometry
compare is a few field compares per chunk (no pass over the payload); the MAC is a
pass over the payload, paid only for chunks from tiers that declare ``shared``.
"""

from __future__ import annotations

import logging

from lmtier.chunks.format import ChunkGeometry, ChunkMeta, DecodedChunk, decode_as
from lmtier.chunks.integrity import ChunkMac
from lmtier.chunks.keys import ChunkKey
from lmtier.errors import CorruptChunk
from lmtier.storage.tier import Tier

__all__ = ["ChunkCheck"]

SEEN_HEADERS = 65536
"""Good headers remembered (a few hundred bytes each)."""

logger = logging.getLogger(__name__)


class ChunkCheck:
    """The checks one cache applies to every chunk it serves (module docstring).

    ``geometry``: what every chunk of the cache looks like (None: not checked, for
    byte-level users without a KV spec). ``mac``: the integrity key (None: off).
    """

    __slots__ = ("_seen", "geometry", "mac")

    def __init__(self, geometry: ChunkGeometry | None = None, mac: ChunkMac | None = None) -> None:
        self.geometry = geometry
        self.mac = mac
        # key -> the header bytes last found good under it, and their decoding (no
        # view of the buffer: that would keep it alive).
        self._seen: dict[ChunkKey, tuple[bytes, ChunkMeta, int, int, bytes, bool]] = {}

    def header(self, key: ChunkKey, data: memoryview) -> DecodedChunk | None:
        """``data`` decoded without a payload pass, if it is chunk ``key`` of the
        expected geometry; None (logged at DEBUG) if it is anything else.

        Decoding is a pure function of the header's bytes, so bytes equal to a header
        already found good under ``key`` are that decoding again: one compare of a few
        hundred bytes instead of a msgpack parse (~7 us a chunk; a chunk served from
        host memory again and again is checked every time, and costs this)."""
        seen = self._seen.get(key)
        if seen is not None:
            prefix, meta, offset, checksum, mac, sealed = seen
            end = offset + meta.nbytes
            if len(data) >= end and data[:offset] == prefix:
                return DecodedChunk(meta, data[offset:end], offset, checksum, mac, sealed)
        try:
            chunk = decode_as(key, data, verify=False)
        except CorruptChunk as exc:
            logger.debug("chunk %s: %s", key.hex(), exc)
            return None
        if not self.fits(chunk):
            return None
        if len(self._seen) >= SEEN_HEADERS:
            self._seen.clear()  # a bound, not a policy: the hot ones come back at once
        offset = chunk.payload_offset
        self._seen[key] = (
            bytes(data[:offset]),
            chunk.meta,
            offset,
            chunk.checksum,
            chunk.mac,
            chunk.sealed,
        )
        return chunk

    def fits(self, chunk: DecodedChunk) -> bool:
        """Whether a decoded chunk has the cache's geometry (logged at DEBUG if not)."""
        meta = chunk.meta
        if self.geometry is None or self.geometry.matches(meta):
            return True
        logger.debug(
            "chunk %s is %s%s, not %s", meta.key.hex(), meta.dtype, meta.shape, self.geometry
        )
        return False

    def needs_mac(self, tier: Tier) -> bool:
        """Whether chunks from ``tier`` must carry a valid MAC."""
        return self.mac is not None and tier.properties.shared

    def authentic(self, chunk: DecodedChunk) -> bool:
        """Whether ``chunk`` carries a valid MAC (a pass over its payload: call it from a
        worker thread for large chunks)."""
        return self.mac is not None and self.mac.verify(chunk)
