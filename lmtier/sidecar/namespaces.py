"""The namespaces one sidecar serves: what a session's wire description means, and the
chunk check that knows every namespace's geometry.

One sidecar caches KV of many models and tenants in one host pool. Every chunk key
starts with its namespace's 16-byte digest, so the geometry a loaded chunk must have
is found from its key: :class:`NamespaceCheck` keeps digest -> geometry for every
namespace a session has opened, and refuses chunks of any other (a chunk of a model
no session has described is never served).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from lmtier.chunks.encoding import HeaderTemplate
from lmtier.chunks.format import ChunkGeometry, DecodedChunk, decode_as
from lmtier.chunks.integrity import ChunkMac
from lmtier.chunks.keys import KEY_BYTES, NAMESPACE_BYTES, ChunkKey, Namespace
from lmtier.config import chunk_size_problem
from lmtier.errors import CorruptChunk, InvalidRequestError, brief
from lmtier.kv_spec import ChunkFramer, KVSpec
from lmtier.namespaces import model_namespace
from lmtier.storage.check import ChunkCheck
from lmtier.v1 import sidecar_pb2 as pb

__all__ = [
    "MAX_CLIENT_NAME_CHARS",
    "MAX_NAME_CHARS",
    "MAX_NAMESPACES",
    "NamespaceCheck",
    "SessionSpace",
    "check_unique",
    "check_written",
    "parse_keys",
    "template_of",
]

MAX_NAMESPACES = 65536
"""Geometries remembered (a few dozen bytes each); past it, the oldest are dropped
(their chunks then miss until a session describes them again)."""
MAX_KEYS = 1 << 16
"""Keys in one call: 16M tokens at 256 per chunk."""
MAX_CHUNK_PAYLOAD = 1 << 34
"""The largest chunk payload a namespace may describe (16 GiB); slabs are far smaller."""
_MAX_DIM = 1 << 20
MAX_NAME_CHARS = 1024
"""Longest model id, revision or cache salt a session may name: a session keeps its
namespace for its whole life, and 4096 sessions of 8 MiB names would be 32 GiB."""
MAX_CLIENT_NAME_CHARS = 256
"""Longest client name (logs and metrics quote it)."""


@dataclass(frozen=True, slots=True)
class SessionSpace:
    """A session's namespace: the key space, the KV spec and chunk size behind it."""

    namespace: Namespace
    spec: KVSpec
    chunk_size: int

    @property
    def digest(self) -> bytes:
        return self.namespace.digest

    @property
    def geometry(self) -> ChunkGeometry:
        return self.spec.geometry(self.chunk_size)

    @property
    def chunk_bytes(self) -> int:
        """Encoded bytes of one full chunk (what one slab must hold)."""
        return self.spec.encoded_chunk_bytes(self.chunk_size)

    @classmethod
    def from_wire(cls, message: pb.Namespace) -> SessionSpace:
        """Check a wire namespace and build it; InvalidRequestError naming the field."""
        if not message.model_id.strip() and not message.model_revision.strip():
            raise InvalidRequestError("namespace.model_id (or model_revision) is required")
        for name in ("model_id", "model_revision", "cache_salt"):
            if len(getattr(message, name)) > MAX_NAME_CHARS:
                raise InvalidRequestError(
                    f"namespace.{name} is {len(getattr(message, name))} characters; at most "
                    f"{MAX_NAME_CHARS}"
                )
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(message, name)
            if not 0 < value <= _MAX_DIM:
                raise InvalidRequestError(f"namespace.{name} must be in 1..{_MAX_DIM}, got {value}")
        problem = chunk_size_problem(message.chunk_size)
        if problem is not None:
            raise InvalidRequestError(f"namespace.chunk_size {problem}")
        tp_size = message.tp_size or 1
        if message.tp_rank >= tp_size:
            raise InvalidRequestError(
                f"namespace.tp_rank must be below tp_size {tp_size}, got {message.tp_rank}"
            )
        try:
            spec = KVSpec(
                message.num_layers,
                message.num_kv_heads,
                message.head_dim,
                dtype=message.kv_dtype or "float32",
                layout=message.kv_layout or "LKTHD",
                block_size=message.kv_block_size,
                page_interior=message.kv_page_interior,
            )
        except ValueError as exc:
            raise InvalidRequestError(f"namespace: {exc}") from None
        if spec.paged and message.chunk_size % spec.block_size:
            raise InvalidRequestError(
                f"namespace.kv_block_size {spec.block_size} does not divide chunk_size "
                f"{message.chunk_size}: a {spec.layout} chunk holds whole blocks"
            )
        payload = spec.bytes_per_token * message.chunk_size
        if payload > MAX_CHUNK_PAYLOAD:
            raise InvalidRequestError(
                f"namespace: a chunk would hold {payload} bytes of KV; at most {MAX_CHUNK_PAYLOAD}"
            )
        namespace = model_namespace(
            spec,
            message.chunk_size,
            model_id=message.model_id,
            model_revision=message.model_revision,
            tp_size=tp_size,
            tp_rank=message.tp_rank,
            cache_salt=message.cache_salt,
        )
        return cls(namespace, spec, message.chunk_size)


@functools.lru_cache(maxsize=1024)
def template_of(space: SessionSpace) -> HeaderTemplate:
    """The header template of ``space``'s full chunks (what clients frame them with)."""
    return ChunkFramer(space.spec, space.chunk_size).template


def check_written(space: SessionSpace, key: ChunkKey, data: memoryview, index: int) -> None:
    """That ``data`` (a slab a client filled, cut to the length it gave) is chunk ``key``
    in ``space``'s geometry: InvalidRequestError naming chunk ``index`` if not."""
    if template_of(space).frames(data, key):
        return  # the header the facade's framer writes: one compare, no decode
    try:
        chunk = decode_as(key, data, verify=False)
    except CorruptChunk as exc:
        raise InvalidRequestError(f"chunk {index}: not a valid chunk ({exc})") from None
    if not space.geometry.matches(chunk.meta):
        raise InvalidRequestError(f"chunk {index}: not of its namespace's KV geometry")


def parse_keys(data: bytes, digest: bytes) -> list[ChunkKey]:
    """Concatenated 32-byte keys, each of the namespace ``digest``.

    InvalidRequestError for a length that is no multiple of 32 or too many keys;
    PermissionError for a key of another namespace (another model or tenant).
    """
    if len(data) % KEY_BYTES:
        raise InvalidRequestError(f"keys must be 32 bytes each; got {len(data)} bytes")
    if len(data) > MAX_KEYS * KEY_BYTES:
        raise InvalidRequestError(f"at most {MAX_KEYS} keys per call, got {len(data) // 32}")
    keys = [ChunkKey(data[i : i + KEY_BYTES]) for i in range(0, len(data), KEY_BYTES)]
    for index, key in enumerate(keys):
        if key[:NAMESPACE_BYTES] != digest:
            raise PermissionError(
                f"key {index} ({brief(key.hex())}) is not of this session's namespace"
            )
    return keys


def check_unique(keys: list[ChunkKey]) -> None:
    """InvalidRequestError if a key comes twice. A load names the chunks of one prefix,
    each once; one LoadStream naming a key 65,536 times streamed it as often (550 MB
    for a 2 MB request)."""
    if len(set(keys)) == len(keys):
        return
    first: dict[ChunkKey, int] = {}
    for index, key in enumerate(keys):
        if first.setdefault(key, index) != index:
            raise InvalidRequestError(f"key {index} repeats key {first[key]}: name each chunk once")


class NamespaceCheck(ChunkCheck):
    """:class:`ChunkCheck` for many namespaces: a chunk must have the geometry of the
    namespace its key names (see the module docstring). Namespaces with a session open
    are always known; of the others, the last ``MAX_NAMESPACES`` are remembered."""

    __slots__ = ("_geometries", "_live")

    def __init__(self, mac: ChunkMac | None = None) -> None:
        super().__init__(None, mac)
        self._geometries: dict[bytes, ChunkGeometry] = {}
        self._live: dict[bytes, int] = {}

    def register(self, space: SessionSpace) -> None:
        """A session opened on ``space``: know its geometry while it is open (and
        after, while there is room)."""
        geometries = self._geometries
        geometries.pop(space.digest, None)
        geometries[space.digest] = space.geometry
        self._live[space.digest] = self._live.get(space.digest, 0) + 1
        if len(geometries) > MAX_NAMESPACES:
            idle = [d for d in geometries if d not in self._live]
            for digest in idle[: len(geometries) - MAX_NAMESPACES]:
                del geometries[digest]

    @property
    def num_live(self) -> int:
        """Namespaces with a session open (their geometries are never dropped)."""
        return len(self._live)

    def unregister(self, space: SessionSpace) -> None:
        """A session on ``space`` closed."""
        left = self._live.get(space.digest, 0) - 1
        if left > 0:
            self._live[space.digest] = left
        else:
            self._live.pop(space.digest, None)

    def fits(self, chunk: DecodedChunk) -> bool:
        geometry = self._geometries.get(chunk.meta.namespace)
        return geometry is not None and geometry.matches(chunk.meta)
