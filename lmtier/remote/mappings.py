"""The sidecars' shared pools a client has mapped: one per sidecar incarnation (each
sidecar process has its own pool file), counted by the leases held on each.

A sidecar that restarts hands out a new pool; the old one stays mapped while a result
loaded from it is still held (its bytes stay valid: nobody writes a dead sidecar's
pool), and is unmapped once none is, so that restarts do not pile up mappings (each
a whole pool of memory, and of ``/dev/shm`` while mapped)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from lmtier.storage.host_pool import HostPool
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.wire.shm import SharedRegion

__all__ = ["PoolMappings"]

logger = logging.getLogger(__name__)


class PoolMappings:
    """Mapped pools by file path; the last mapped is the live sidecar's. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[str, tuple[SharedRegion, HostPool]] = {}
        self._live = ""
        self._held: dict[HostPool, int] = {}

    def map(self, shm: pb.SharedMemory) -> HostPool | None:
        """The slabs of the pool ``shm`` describes (mapped once); None when it cannot
        be mapped here (then the client streams)."""
        with self._lock:
            found = self._regions.get(shm.path)
            if found is not None:
                self._live = shm.path
                return found[1]
        try:
            region = SharedRegion.attach(Path(shm.path), shm.size)
        except OSError as exc:
            logger.warning("cannot map the sidecar's shared pool (%s): streaming instead", exc)
            return None
        region.pin()
        memory = region.tensor[shm.first_slab_offset :]
        pool = HostPool(shm.slab_stride, shm.num_slabs, align=64, region=memory)
        with self._lock:
            self._regions[shm.path] = (region, pool)
            self._live = shm.path
        self._unmap_retired()
        return pool

    def hold(self, pool: HostPool) -> None:
        """A lease on ``pool`` is held (until :meth:`unhold`)."""
        with self._lock:
            self._held[pool] = self._held.get(pool, 0) + 1

    def unhold(self, pool: HostPool) -> None:
        with self._lock:
            self._held[pool] -= 1
            retired = not self._held[pool] and self._live_pool() is not pool
        if retired:
            self._unmap_retired()

    def regions(self) -> list[SharedRegion]:
        """The pools mapped now (the live sidecar's last)."""
        with self._lock:
            return sorted(
                (r for r, _ in self._regions.values()), key=lambda r: str(r.path) == self._live
            )

    def close(self) -> None:
        """Unmap every pool."""
        with self._lock:
            regions, self._regions, self._held = list(self._regions.values()), {}, {}
        for region, pool in regions:
            pool.close()
            region.close()

    def _live_pool(self) -> HostPool | None:
        found = self._regions.get(self._live)
        return None if found is None else found[1]

    def _unmap_retired(self) -> None:
        with self._lock:
            retired = [
                path
                for path, (_, pool) in self._regions.items()
                if path != self._live and not self._held.get(pool)
            ]
            gone = [self._regions.pop(path) for path in retired]
            for _, pool in gone:
                self._held.pop(pool, None)
        for region, pool in gone:
            pool.close()
            region.close()
