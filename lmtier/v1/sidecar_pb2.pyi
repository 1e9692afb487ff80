from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Namespace(_message.Message):
    __slots__ = ("model_id", "model_revision", "kv_dtype", "kv_layout", "num_layers", "num_kv_heads", "head_dim", "chunk_size", "tp_size", "tp_rank", "cache_salt", "kv_block_size", "kv_page_interior")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGE_INTERIOR_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_revision: str
    kv_dtype: str
    kv_layout: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    chunk_size: int
    tp_size: int
    tp_rank: int
    cache_salt: str
    kv_block_size: int
    kv_page_interior: str
    def __init__(self, model_id: _Optional[str] = ..., model_revision: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., kv_layout: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., chunk_size: _Optional[int] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., cache_salt: _Optional[str] = ..., kv_block_size: _Optional[int] = ..., kv_page_interior: _Optional[str] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("namespace", "shared_memory", "client_name")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    shared_memory: bool
    client_name: str
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., shared_memory: _Optional[bool] = ..., client_name: _Optional[str] = ...) -> None: ...

class SharedMemory(_message.Message):
    __slots__ = ("path", "size", "first_slab_offset", "slab_stride", "slab_bytes", "num_slabs")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    FIRST_SLAB_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SLAB_STRIDE_FIELD_NUMBER: _ClassVar[int]
    SLAB_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SLABS_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    first_slab_offset: int
    slab_stride: int
    slab_bytes: int
    num_slabs: int
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., first_slab_offset: _Optional[int] = ..., slab_stride: _Optional[int] = ..., slab_bytes: _Optional[int] = ..., num_slabs: _Optional[int] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "namespace_digest", "hash_algorithm", "shm", "lease_ttl_s", "max_chunk_bytes", "server_version", "lane")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    namespace_digest: bytes
    hash_algorithm: str
    shm: SharedMemory
    lease_ttl_s: float
    max_chunk_bytes: int
    server_version: str
    lane: str
    def __init__(self, session_id: _Optional[bytes] = ..., namespace_digest: _Optional[bytes] = ..., hash_algorithm: _Optional[str] = ..., shm: _Optional[_Union[SharedMemory, _Mapping]] = ..., lease_ttl_s: _Optional[float] = ..., max_chunk_bytes: _Optional[int] = ..., server_version: _Optional[str] = ..., lane: _Optional[str] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("opened", "draining")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    opened: SessionInfo
    draining: str
    def __init__(self, opened: _Optional[_Union[SessionInfo, _Mapping]] = ..., draining: _Optional[str] = ...) -> None: ...

class TierSpan(_message.Message):
    __slots__ = ("tier", "start", "stop")
    TIER_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    tier: str
    start: int
    stop: int
    def __init__(self, tier: _Optional[str] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("session_id", "tokens", "keys", "max_tokens", "local_only")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    tokens: TokenIds
    keys: bytes
    max_tokens: int
    local_only: bool
    def __init__(self, session_id: _Optional[bytes] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., keys: _Optional[bytes] = ..., max_tokens: _Optional[int] = ..., local_only: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("num_chunks", "spans", "keys")
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    num_chunks: int
    spans: _containers.RepeatedCompositeFieldContainer[TierSpan]
    keys: bytes
    def __init__(self, num_chunks: _Optional[int] = ..., spans: _Optional[_Iterable[_Union[TierSpan, _Mapping]]] = ..., keys: _Optional[bytes] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("session_id", "tokens", "keys", "max_tokens", "lookup", "release")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    tokens: TokenIds
    keys: bytes
    max_tokens: int
    lookup: _containers.RepeatedCompositeFieldContainer[TierSpan]
    release: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[bytes] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., keys: _Optional[bytes] = ..., max_tokens: _Optional[int] = ..., lookup: _Optional[_Iterable[_Union[TierSpan, _Mapping]]] = ..., release: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadedSlab(_message.Message):
    __slots__ = ("lease", "slab", "length", "tier")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    SLAB_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    lease: int
    slab: int
    length: int
    tier: str
    def __init__(self, lease: _Optional[int] = ..., slab: _Optional[int] = ..., length: _Optional[int] = ..., tier: _Optional[str] = ...) -> None: ...

class LoadReply(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[LoadedSlab]
    def __init__(self, chunks: _Optional[_Iterable[_Union[LoadedSlab, _Mapping]]] = ...) -> None: ...

class ChunkPiece(_message.Message):
    __slots__ = ("session_id", "key", "total_length", "offset", "data", "tier")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LENGTH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    key: bytes
    total_length: int
    offset: int
    data: bytes
    tier: str
    def __init__(self, session_id: _Optional[bytes] = ..., key: _Optional[bytes] = ..., total_length: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., tier: _Optional[str] = ...) -> None: ...

class AcquireSlabsRequest(_message.Message):
    __slots__ = ("session_id", "count", "release", "keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    count: int
    release: _containers.RepeatedScalarFieldContainer[int]
    keys: bytes
    def __init__(self, session_id: _Optional[bytes] = ..., count: _Optional[int] = ..., release: _Optional[_Iterable[int]] = ..., keys: _Optional[bytes] = ...) -> None: ...

class SlabGrant(_message.Message):
    __slots__ = ("lease", "slab")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    SLAB_FIELD_NUMBER: _ClassVar[int]
    lease: int
    slab: int
    def __init__(self, lease: _Optional[int] = ..., slab: _Optional[int] = ...) -> None: ...

class AcquireSlabsReply(_message.Message):
    __slots__ = ("slabs", "present")
    SLABS_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    slabs: _containers.RepeatedCompositeFieldContainer[SlabGrant]
    present: int
    def __init__(self, slabs: _Optional[_Iterable[_Union[SlabGrant, _Mapping]]] = ..., present: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("session_id", "chunks")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    chunks: _containers.RepeatedCompositeFieldContainer[CommittedSlab]
    def __init__(self, session_id: _Optional[bytes] = ..., chunks: _Optional[_Iterable[_Union[CommittedSlab, _Mapping]]] = ...) -> None: ...

class CommittedSlab(_message.Message):
    __slots__ = ("lease", "key", "length")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    lease: int
    key: bytes
    length: int
    def __init__(self, lease: _Optional[int] = ..., key: _Optional[bytes] = ..., length: _Optional[int] = ...) -> None: ...

class StoreReply(_message.Message):
    __slots__ = ("stored", "dropped")
    STORED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    dropped: int
    def __init__(self, stored: _Optional[int] = ..., dropped: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "leases")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    leases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[bytes] = ..., leases: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ("session_id", "timeout_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    timeout_s: float
    def __init__(self, session_id: _Optional[bytes] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class FlushReply(_message.Message):
    __slots__ = ("done",)
    DONE_FIELD_NUMBER: _ClassVar[int]
    done: bool
    def __init__(self, done: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    def __init__(self, session_id: _Optional[bytes] = ...) -> None: ...

class Counters(_message.Message):
    __slots__ = ("values",)
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.ScalarMap[str, float]
    def __init__(self, values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("tiers", "sidecar")
    class TiersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Counters
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Counters, _Mapping]] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.MessageMap[str, Counters]
    sidecar: Counters
    def __init__(self, tiers: _Optional[_Mapping[str, Counters]] = ..., sidecar: _Optional[_Union[Counters, _Mapping]] = ...) -> None: ...

class PurgeRequest(_message.Message):
    __slots__ = ("session_id", "dry_run")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    dry_run: bool
    def __init__(self, session_id: _Optional[bytes] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class PurgeReply(_message.Message):
    __slots__ = ("deleted",)
    class DeletedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: _containers.ScalarMap[str, int]
    def __init__(self, deleted: _Optional[_Mapping[str, int]] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("session_id", "keys", "unpin")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    UNPIN_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    keys: bytes
    unpin: bool
    def __init__(self, session_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., unpin: _Optional[bool] = ...) -> None: ...

class PinReply(_message.Message):
    __slots__ = ("pinned",)
    class PinnedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PINNED_FIELD_NUMBER: _ClassVar[int]
    pinned: _containers.ScalarMap[str, int]
    def __init__(self, pinned: _Optional[_Mapping[str, int]] = ...) -> None: ...

class PeerContainsReply(_message.Message):
    __slots__ = ("leading",)
    LEADING_FIELD_NUMBER: _ClassVar[int]
    leading: int
    def __init__(self, leading: _Optional[int] = ...) -> None: ...

class PeerFetchRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    def __init__(self, keys: _Optional[bytes] = ...) -> None: ...
