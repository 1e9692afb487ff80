"""The namespaces of one model's cache, by tenant: :class:`Namespaces`, and the
namespace of a model's chunks in one geometry: :func:`model_namespace`.

A chunk key starts with its namespace's digest (:mod:`lmtier.chunks.keys`); a store
that opens sessions per namespace (a sidecar's client) must find the whole namespace
again from a key, so the facade keeps the namespaces it made by salt and by digest.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING

from lmtier.chunks.keys import Namespace
from lmtier.errors import InvalidRequestError

if TYPE_CHECKING:
    from lmtier.kv_spec import KVSpec

__all__ = ["NAMESPACE_CACHE", "Namespaces", "model_namespace"]

NAMESPACE_CACHE = 1024
"""Tenants (``cache_salt`` values) whose namespace is kept ready; others are rebuilt
(~3 us) when they come back. A bound: one entry per tenant forever grew without end."""


def model_namespace(
    spec: KVSpec,
    chunk_size: int,
    *,
    model_id: str,
    model_revision: str,
    tp_size: int = 1,
    tp_rank: int = 0,
    cache_salt: str = "",
) -> Namespace:
    """The namespace of ``model_id``'s chunks of ``chunk_size`` tokens in ``spec``'s
    geometry, dtype and layout, on TP rank ``tp_rank`` of ``tp_size``: what an embedded
    cache and a sidecar's session both key them under."""
    return Namespace(
        model_id=model_id,
        model_revision=model_revision,
        kv_dtype=spec.dtype,
        kv_layout=spec.layout,
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        chunk_size=chunk_size,
        tp_size=tp_size,
        tp_rank=tp_rank,
        cache_salt=cache_salt,
        kv_block_size=spec.block_size,
        kv_page_interior=spec.page_interior,
    )


class Namespaces:
    """This model's namespaces by cache salt, the last ``NAMESPACE_CACHE`` used, and
    the same ones by digest: a key names its namespace by digest only, and a store
    that opens sessions per namespace (a sidecar's) needs the whole of it. Both views
    hold the same entries, so any key made from a namespace still held resolves."""

    __slots__ = ("_base", "_by_digest", "_by_salt", "_lock")

    def __init__(self, base: Namespace) -> None:
        self._base = base
        self._by_salt: OrderedDict[str, Namespace] = OrderedDict()
        self._by_digest: dict[bytes, Namespace] = {}
        self._lock = threading.Lock()

    def get(self, salt: str) -> Namespace:
        """The namespace under ``salt`` (made now if it is not held)."""
        with self._lock:
            found = self._by_salt.get(salt)
            if found is not None:
                self._by_salt.move_to_end(salt)
                return found
            found = self._by_salt[salt] = replace(self._base, cache_salt=salt)
            self._by_digest[found.digest] = found
            if len(self._by_salt) > NAMESPACE_CACHE:
                _, dropped = self._by_salt.popitem(last=False)
                del self._by_digest[dropped.digest]
            return found

    def of_digest(self, digest: bytes) -> Namespace:
        """The namespace held with this digest (InvalidRequestError if none)."""
        found = self._by_digest.get(digest)
        if found is None:
            raise InvalidRequestError("these keys are of no namespace this cache made")
        return found
