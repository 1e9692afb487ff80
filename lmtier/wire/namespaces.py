"""A namespace on the wire: the message a client sends to open a session on it.

The client writes it here; the server reads it back into its own session space
(:class:`lmtier.sidecar.namespaces.SessionSpace`), checking every field.
"""

from __future__ import annotations

from lmtier.chunks.keys import Namespace
from lmtier.v1 import sidecar_pb2 as pb

__all__ = ["to_wire"]


def to_wire(namespace: Namespace) -> pb.Namespace:
    """The wire form of ``namespace`` (what a client sends to open a session)."""
    return pb.Namespace(
        model_id=namespace.model_id,
        model_revision=namespace.model_revision,
        kv_dtype=namespace.kv_dtype,
        kv_layout=namespace.kv_layout,
        num_layers=namespace.num_layers,
        num_kv_heads=namespace.num_kv_heads,
        head_dim=namespace.head_dim,
        chunk_size=namespace.chunk_size,
        tp_size=namespace.tp_size,
        tp_rank=namespace.tp_rank,
        cache_salt=namespace.cache_salt,
        kv_block_size=namespace.kv_block_size,
        kv_page_interior=namespace.kv_page_interior,
    )
