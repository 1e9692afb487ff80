"""The chunk byte format: round trips with real tensors, every typed error, fuzzing."""

from __future__ import annotations

import ast
import dataclasses
import math
import struct
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lmtier.chunks.format as cf
from lmtier.chunks.encoding import (
    HeaderTemplate,
    encode,
    encode_into,
    encoded_size,
    header_bytes,
    seal_header,
)
from lmtier.chunks.format import (
    DTYPE_ITEMSIZE,
    FORMAT_VERSION,
    LAYOUTS,
    MAX_HEADER_LEN,
    PAGED_LAYOUTS,
    PAYLOAD_ALIGN,
    ChunkMeta,
    align_up,
    decode,
    decode_header,
    verify_payload,
)
from lmtier.errors import (
    BadMagic,
    ChecksumMismatch,
    CorruptChunk,
    HeaderTooLarge,
    InconsistentChunk,
    TruncatedChunk,
    UnsupportedVersion,
)

KEY = bytes(range(16))
NS = bytes(range(100, 116))
PREFIX = struct.Struct("<4sHHIIQ")
NUM_TOKENS = 3
DIMS = {"L": 2, "K": 2, "T": NUM_TOKENS, "H": 2, "D": 4, "B": 3, "S": 2, "C": 8}
DTYPES = [name for name in DTYPE_ITEMSIZE if hasattr(torch, name)]


def make_meta(dtype: str = "bfloat16", layout: str = "LKTHD", created: float = 0.0) -> ChunkMeta:
    shape = tuple(DIMS[axis] for axis in layout)
    tokens = NUM_TOKENS if "T" in layout else DIMS["B"] * DIMS["S"]  # paged: whole blocks
    return ChunkMeta(KEY, NS, dtype, shape, layout, tokens, created)


def make_tensor(dtype: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype in ("int8", "uint8"):
        low, high = (-128, 128) if dtype == "int8" else (0, 256)
        return torch.randint(low, high, shape, generator=gen, dtype=getattr(torch, dtype))
    return torch.randn(shape, generator=gen).to(getattr(torch, dtype))


def tensor_bytes(t: torch.Tensor) -> np.ndarray[Any, Any]:
    return t.contiguous().flatten().view(torch.uint8).numpy()


def read_prefix(blob: bytes) -> tuple[Any, ...]:
    return PREFIX.unpack_from(blob)


def frame(header: bytes, payload: bytes, **prefix: int) -> bytes:
    """Build a chunk by hand around any header bytes, with a correct header checksum."""
    fields = {"version": FORMAT_VERSION, "flags": 0, "reserved": 0, "header_len": len(header)}
    fields |= prefix
    head = PREFIX.pack(
        b"LMTC",
        fields["version"],
        fields["flags"],
        fields["header_len"],
        fields["reserved"],
        xxhash.xxh3_64_intdigest(header),
    )
    padding = bytes(align_up(len(head) + len(header)) - len(head) - len(header))
    return head + header + padding + payload


def valid_fields(meta: ChunkMeta, payload: bytes) -> dict[str, Any]:
    return {
        "key": meta.key,
        "ns": meta.namespace,
        "dtype": meta.dtype,
        "shape": list(meta.shape),
        "layout": meta.layout,
        "tokens": meta.num_tokens,
        "nbytes": meta.nbytes,
        "xxh": xxhash.xxh3_64_intdigest(bytes(payload)),
        "ctime": 1.0,
        "mac": bytes(32),
    }


# --- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_with_real_tensors(dtype: str, layout: str) -> None:
    meta = make_meta(dtype, layout)
    tensor = make_tensor(dtype, meta.shape)
    before = time.time()
    blob = encode(meta, tensor_bytes(tensor))
    after = time.time()

    chunk = decode(bytearray(blob))
    assert dataclasses.replace(chunk.meta, created=0.0) == meta
    assert before <= chunk.meta.created <= after
    # The payload follows the header at the next 64-byte boundary: no page of padding.
    assert chunk.payload_offset % PAYLOAD_ALIGN == 0
    assert 24 + read_prefix(blob)[3] <= chunk.payload_offset < 24 + read_prefix(blob)[3] + 64
    assert chunk.payload_offset <= 256
    assert len(blob) == encoded_size(meta) == chunk.payload_offset + meta.nbytes
    assert chunk.checksum == xxhash.xxh3_64_intdigest(tensor_bytes(tensor).tobytes())
    restored = torch.frombuffer(chunk.payload, dtype=getattr(torch, dtype)).reshape(meta.shape)
    assert restored.dtype == tensor.dtype
    assert torch.equal(restored.view(torch.uint8), tensor.view(torch.uint8))

    stamped = make_meta(dtype, layout, created=1234.5)
    expected = encode(stamped, tensor_bytes(tensor))
    slab = bytearray(b"\xab" * (len(expected) + 5000))
    written = encode_into(stamped, tensor_bytes(tensor), slab)
    assert written == len(expected)
    assert slab[:written] == expected
    assert slab[written:] == b"\xab" * 5000
    assert header_bytes(stamped, tensor_bytes(tensor)) + tensor_bytes(tensor).tobytes() == expected
    assert decode(slab).meta == stamped


def test_dtype_itemsizes_match_torch() -> None:
    assert set(DTYPES) == set(DTYPE_ITEMSIZE)  # this torch has every dtype the format names
    for name, size in DTYPE_ITEMSIZE.items():
        assert getattr(torch, name).itemsize == size


def test_layouts_and_nbytes() -> None:
    assert set(LAYOUTS) == {"LKTHD", "KLTHD", "KTLHD", "LTD", "TLD", "LBHSC", "LBSHC"}
    assert {"LBHSC", "LBSHC"} == PAGED_LAYOUTS
    assert ChunkMeta(KEY, NS, "float16", (4, 16, 8, 16, 256), "LBHSC", 256).nbytes == 1 << 22
    meta = ChunkMeta(KEY, NS, "float32", (4, 2, 16, 8, 128), "LKTHD", 16)
    assert meta.nbytes == 4 * 2 * 16 * 8 * 128 * 4
    assert ChunkMeta(KEY, NS, "float8_e5m2", (3, 5, 7), "LTD", 5).nbytes == 105


@pytest.mark.parametrize(
    "convert",
    [bytes, bytearray, memoryview, lambda b: np.frombuffer(b, np.float16).reshape(8, -1)],
)
def test_encode_accepts_any_contiguous_buffer(convert: Any) -> None:
    meta = make_meta("float16", created=7.0)
    raw = bytes(range(256)) * (meta.nbytes // 256) + bytes(meta.nbytes % 256)
    assert encode(meta, convert(raw)) == encode(meta, raw)
    assert bytes(decode(encode(meta, convert(raw))).payload) == raw


def test_header_length_does_not_depend_on_checksum_or_time() -> None:
    meta = make_meta("uint8", "LTD")
    lengths = set()
    for seed in range(64):
        payload = bytes([seed]) * meta.nbytes
        lengths.add(read_prefix(encode(dataclasses.replace(meta, created=seed * 1e8), payload))[3])
    assert len(lengths) == 1


def test_payload_is_zero_copy() -> None:
    meta = make_meta("int8")
    src = bytearray(encode(meta, bytes(meta.nbytes)))
    chunk = decode(src, verify=False)
    assert chunk.payload_offset % PAYLOAD_ALIGN == 0
    assert chunk.payload[5] == 0
    src[chunk.payload_offset + 5] = 0x7F
    assert chunk.payload[5] == 0x7F  # the view sees the write: it shares src's memory
    with pytest.raises(ChecksumMismatch):
        decode(src)


def test_trailing_bytes_are_ignored() -> None:
    meta = make_meta("float32", "KLTHD")
    payload = tensor_bytes(make_tensor("float32", meta.shape))
    blob = encode(meta, payload)
    padded = blob + b"\xff" * (align_up(len(blob)) - len(blob) + 4096)
    chunk = decode(padded)
    assert bytes(chunk.payload) == payload.tobytes()
    assert len(chunk.payload) == meta.nbytes


def test_decode_header_then_payload() -> None:
    meta = make_meta("bfloat16", created=99.0)
    payload = tensor_bytes(make_tensor("bfloat16", meta.shape))
    blob = encode(meta, payload)
    header_end = 24 + read_prefix(blob)[3]
    got_meta, offset, nbytes, checksum = decode_header(blob[:header_end])
    assert (got_meta, offset, nbytes) == (meta, align_up(header_end), meta.nbytes)
    verify_payload(blob[offset : offset + nbytes], checksum)
    with pytest.raises(ChecksumMismatch):
        verify_payload(bytes(nbytes), checksum)
    with pytest.raises(TruncatedChunk):
        decode_header(blob[: header_end - 1])


# --- encode-side errors are ValueError --------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        {"key": KEY[:15]},
        {"namespace": "n" * 16},
        {"dtype": "float64"},
        {"dtype": "torch.float16"},
        {"layout": "LTHD"},
        {"shape": (2, 2, 3, 2)},
        {"shape": [2, 2, 3, 2, 4]},
        {"shape": (2, 2, 3, 0, 4)},
        {"shape": (2, 2, 3, True, 4)},
        {"shape": (2, 3, 3, 2, 4)},
        {"num_tokens": 4},
        {"shape": (2, 2, 0, 2, 4), "num_tokens": 0},
        {"created": math.nan},
        {"created": -1.0},
    ],
)
def test_bad_meta_is_value_error(change: dict[str, Any]) -> None:
    fields = dataclasses.asdict(make_meta()) | change
    with pytest.raises(ValueError, match=r"\S"):
        ChunkMeta(**fields)


def test_encode_rejects_bad_payloads() -> None:
    meta = make_meta("float32", "LTD")
    with pytest.raises(ValueError, match="needs"):
        encode(meta, bytes(meta.nbytes - 1))
    strided = np.zeros((meta.nbytes // 4, 2), np.float32)[:, 0]
    with pytest.raises(ValueError, match="contiguous"):
        encode(meta, strided)
    with pytest.raises(ValueError, match="needs"):
        encode_into(meta, bytes(meta.nbytes + 1), bytearray(10**5))
    payload = bytes(meta.nbytes)
    with pytest.raises(ValueError, match="out has"):
        encode_into(meta, payload, bytearray(encoded_size(meta) - 1))
    with pytest.raises(ValueError, match="writable"):
        encode_into(meta, payload, bytes(encoded_size(meta)))


# --- decode-side typed errors --------------------------------------------------------------


@pytest.fixture
def blob() -> bytes:
    meta = make_meta("float16", "LKTHD", created=5.0)
    return encode(meta, tensor_bytes(make_tensor("float16", meta.shape)))


def repack(blob: bytes, index: int, value: Any) -> bytes:
    fields = list(read_prefix(blob))
    fields[index] = value
    return PREFIX.pack(*fields) + blob[24:]


def test_bad_magic(blob: bytes) -> None:
    with pytest.raises(BadMagic):
        decode(b"XXXX" + blob[4:])
    with pytest.raises(BadMagic):
        decode(b"PK\x03\x04")
    with pytest.raises(BadMagic):
        decode(bytes(4096))


@pytest.mark.parametrize(("index", "value"), [(1, 4), (1, 2), (1, 1), (1, 0), (2, 2), (2, 0x8001)])
def test_unsupported_version_or_flags(blob: bytes, index: int, value: int) -> None:
    with pytest.raises(UnsupportedVersion):
        decode(repack(blob, index, value))


def test_header_too_large(blob: bytes) -> None:
    with pytest.raises(HeaderTooLarge):
        decode(repack(blob, 3, MAX_HEADER_LEN + 1))
    with pytest.raises(HeaderTooLarge):
        decode_header(repack(blob, 3, 2**32 - 1))


def test_reserved_must_be_zero(blob: bytes) -> None:
    with pytest.raises(InconsistentChunk, match="reserved"):
        decode(repack(blob, 4, 1))


def test_truncated_everywhere(blob: bytes) -> None:
    header_end = 24 + read_prefix(blob)[3]
    payload = align_up(header_end)
    cuts = [0, 2, 4, 23, 24, 30, header_end - 1, header_end, payload, payload + 1, len(blob) - 1]
    for cut in cuts:
        with pytest.raises(TruncatedChunk):
            decode(blob[:cut])
    decode(blob)  # and the uncut chunk is fine


def test_flipped_bytes_fail_checksums(blob: bytes) -> None:
    payload = decode(blob).payload_offset
    for pos in (payload, payload + 77, len(blob) - 1):
        broken = bytearray(blob)
        broken[pos] ^= 0x01
        with pytest.raises(ChecksumMismatch, match="payload"):
            decode(broken)
        assert decode(broken, verify=False).meta == decode(blob).meta
    for pos in (24, 40, 24 + read_prefix(blob)[3] - 1, 16):  # header bytes, then its checksum
        broken = bytearray(blob)
        broken[pos] ^= 0x10
        with pytest.raises(ChecksumMismatch, match="header"):
            decode(broken, verify=False)


PAYLOAD = bytes(range(96))  # an LTD float32 chunk of shape (2, 3, 4)
BASE_META = ChunkMeta(KEY, NS, "float32", (2, 3, 4), "LTD", 3)


def test_crafted_baseline_decodes() -> None:
    """The crafted-header helper makes valid chunks, so the cases below test one field each."""
    chunk = decode(frame(msgpack.packb(valid_fields(BASE_META, PAYLOAD)), PAYLOAD))
    assert chunk.meta == dataclasses.replace(BASE_META, created=1.0)
    assert bytes(chunk.payload) == PAYLOAD


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"shape": [2, 3, 5]}, "nbytes"),
        ({"nbytes": 97}, "nbytes"),
        ({"nbytes": True}, "nbytes"),
        ({"dtype": "float16"}, "nbytes"),
        ({"dtype": "float64"}, "dtype"),
        ({"dtype": b"float32"}, "dtype"),
        ({"layout": "LXD"}, "layout"),
        ({"shape": [2, 3, 4, 1]}, "shape"),
        ({"shape": [2, 3, 0]}, "shape"),
        ({"shape": [2, 3, -4]}, "shape"),
        ({"shape": [2, 3, 4.0]}, "shape"),
        ({"shape": "234"}, "shape"),
        ({"tokens": 4}, "token"),
        ({"tokens": -3}, "token"),
        ({"tokens": 3.0}, "token"),
        ({"key": KEY + b"!"}, "key"),
        ({"key": KEY.hex()}, "key"),
        ({"ns": None}, "namespace"),
        ({"ctime": "now"}, "created"),
        ({"ctime": math.inf}, "created"),
        ({"ctime": -5.0}, "created"),
        ({"xxh": -1}, "checksum"),
        ({"xxh": b"12345678"}, "checksum"),
        ({"extra": 1}, "fields"),
        ({"xxh": None, "shape": None}, "nbytes|shape|checksum"),
    ],
)
def test_inconsistent_headers(change: dict[str, Any], match: str) -> None:
    fields = valid_fields(BASE_META, PAYLOAD) | change
    with pytest.raises(InconsistentChunk, match=match):
        decode(frame(msgpack.packb(fields), PAYLOAD))


@pytest.mark.parametrize(
    ("layout", "change"),
    [
        ("LBHSC", {"num_tokens": 5}),  # not blocks x slots = 6
        ("LBSHC", {"num_tokens": 3}),  # one block's worth, or one axis alone
        ("LBHSC", {"shape": (2, 3, 2, 2, 7)}),  # odd C: K and V are equal halves
        ("LBSHC", {"shape": (2, 3, 2, 2, 8, 1)}),
        ("LBHSC", {"shape": (2, 0, 2, 2, 8), "num_tokens": 0}),
    ],
)
def test_bad_paged_meta_is_value_error(layout: str, change: dict[str, Any]) -> None:
    fields = dataclasses.asdict(make_meta("float16", layout)) | change
    with pytest.raises(ValueError, match=r"\S"):
        ChunkMeta(**fields)


def test_paged_layouts_count_tokens_as_blocks_times_slots_and_have_no_k_axis() -> None:
    meta = ChunkMeta(KEY, NS, "float16", (3, 4, 8, 16, 6), "LBHSC", 64)  # C = 6, not 2
    assert meta.nbytes == 3 * 4 * 8 * 16 * 6 * 2
    assert ChunkMeta(KEY, NS, "uint8", (1, 1, 1, 1, 2), "LBSHC", 1).nbytes == 2


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"tokens": 3}, "blocks x slots"),
        ({"tokens": 7}, "blocks x slots"),
        ({"shape": [2, 3, 2, 2, 7], "nbytes": 2 * 3 * 2 * 2 * 7}, "odd"),
        ({"shape": [2, 3, 2, 8], "nbytes": 2 * 3 * 2 * 8}, "shape"),
        ({"shape": [2, 3, 2, 0, 8]}, "shape"),
        ({"shape": [2, 3, 2, 2, 2**62]}, "nbytes"),
        ({"layout": "LBHSD"}, "layout"),
        ({"layout": "LKTHD"}, "k/v|token"),
    ],
)
def test_inconsistent_paged_headers(change: dict[str, Any], match: str) -> None:
    meta = make_meta("uint8", "LBHSC")
    payload = bytes(meta.nbytes)
    fields = valid_fields(meta, payload) | change
    with pytest.raises(InconsistentChunk, match=match):
        decode(frame(msgpack.packb(fields), payload))


def test_k_axis_must_be_two() -> None:
    meta = make_meta("uint8", "KLTHD")
    payload = bytes(meta.nbytes // 2 * 3)
    fields = valid_fields(meta, payload) | {"shape": [3, 2, 3, 2, 4], "nbytes": len(payload)}
    with pytest.raises(InconsistentChunk, match="k/v"):
        decode(frame(msgpack.packb(fields), payload))


@pytest.mark.parametrize(
    "header",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"\x93\x01\x02\x03",  # an array, not a map
        msgpack.packb(valid_fields(BASE_META, PAYLOAD)) + b"\x00",  # trailing data
        msgpack.packb({k: v for k, v in valid_fields(BASE_META, PAYLOAD).items() if k != "xxh"}),
        msgpack.packb({1: 2}),  # non-string key
        msgpack.packb({"a": b"x" * 100}),  # bin longer than the limit
        b"\x82\xa1a\x01\xa1a\x02",  # duplicate key
        b"\x91" * 5000 + b"\xc0",  # deep nesting
        b"\xc7\x00\x05",  # ext type
    ],
)
def test_undecodable_headers(header: bytes) -> None:
    with pytest.raises(InconsistentChunk):
        decode(frame(header, PAYLOAD))


def test_module_imports_neither_torch_nor_pickle() -> None:
    tree = ast.parse(Path(cf.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported >= {"msgpack", "xxhash", "struct"}
    assert not imported & {"torch", "pickle", "cloudpickle", "dill"}


# --- fuzzing -------------------------------------------------------------------------------


def _small_blob(layout: str, dtype: str) -> bytes:
    meta = make_meta(dtype, layout, created=3.0)
    return encode(meta, tensor_bytes(make_tensor(dtype, meta.shape, seed=len(layout))))


SEED_BLOBS = [
    _small_blob("LKTHD", "float16"),
    _small_blob("KLTHD", "int8"),
    _small_blob("LTD", "float32"),
    _small_blob("LBHSC", "bfloat16"),
    _small_blob("LBSHC", "float8_e4m3fn"),
]


def assert_valid_or_corrupt(buf: bytes) -> None:
    """decode may only raise CorruptChunk subclasses; what it returns must be a real chunk."""
    header: tuple[ChunkMeta, int, int, int] | None
    try:
        header = decode_header(buf)
    except CorruptChunk:
        header = None
    try:
        chunk = decode(buf)
    except CorruptChunk:
        return
    assert header == (chunk.meta, chunk.payload_offset, chunk.meta.nbytes, chunk.checksum)
    assert len(chunk.payload) == chunk.meta.nbytes
    assert chunk.payload_offset % PAYLOAD_ALIGN == 0
    verify_payload(chunk.payload, chunk.checksum)


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**5), st.integers(0, 7)),
    st.tuples(st.just("insert"), st.integers(0, 10**5), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), st.integers(0, 10**5), st.integers(1, 64)),
    st.tuples(st.just("truncate"), st.integers(0, 10**5), st.just(0)),
    st.tuples(st.just("overwrite"), st.integers(0, 10**5), st.binary(min_size=1, max_size=16)),
)


def mutate(data: bytes, ops: list[tuple[str, int, Any]], limit: int | None = None) -> bytes:
    buf = bytearray(data)
    for kind, where, arg in ops:
        pos = where % (limit or len(buf) or 1)
        if kind == "flip" and pos < len(buf):
            buf[pos] ^= 1 << arg
        elif kind == "insert":
            buf[pos:pos] = arg
        elif kind == "delete":
            del buf[pos : pos + arg]
        elif kind == "truncate":
            del buf[pos:]
        elif kind == "overwrite":
            buf[pos : pos + len(arg)] = arg
    return bytes(buf)


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.sampled_from(SEED_BLOBS), st.lists(mutation, min_size=1, max_size=4))
def test_fuzz_mutated_chunks(seed: bytes, ops: list[tuple[str, int, Any]]) -> None:
    # Half the mutations land in the first 128 bytes, where prefix and header live.
    assert_valid_or_corrupt(mutate(seed, ops, limit=128 if ops[0][1] % 2 else None))


@FUZZ
@given(st.binary(max_size=300), st.sampled_from([b"", b"LMTC", b"LMTC\x01\x00\x00\x00"]))
def test_fuzz_random_bytes(data: bytes, start: bytes) -> None:
    assert_valid_or_corrupt(start + data)


@FUZZ
@given(st.sampled_from(SEED_BLOBS), st.lists(mutation, min_size=1, max_size=3))
def test_fuzz_mutated_headers_with_valid_checksum(
    seed: bytes, ops: list[tuple[str, int, Any]]
) -> None:
    """Mutate the msgpack header, then fix its checksum, so the parser itself is fuzzed."""
    header_len = read_prefix(seed)[3]
    header = mutate(seed[24 : 24 + header_len], ops)
    payload = seed[align_up(24 + header_len) :]
    assert_valid_or_corrupt(frame(header, payload))


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner, max_size=6)
    ),
    max_leaves=12,
)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(sorted(valid_fields(BASE_META, PAYLOAD))) | st.text(max_size=4),
        msgpack_values,
        max_size=10,
    ),
    st.booleans(),
)
def test_fuzz_random_msgpack_headers(replace: dict[str, Any], merge: bool) -> None:
    fields = (valid_fields(BASE_META, PAYLOAD) | replace) if merge else replace
    assert_valid_or_corrupt(frame(msgpack.packb(fields), PAYLOAD))


# --- header templates and sealing later ---------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_template_frames_exactly_what_header_bytes_writes(dtype: str, layout: str) -> None:
    meta = make_meta(dtype, layout, created=1234.5)
    payload = tensor_bytes(make_tensor(dtype, meta.shape))
    mac = bytes(range(32))
    expected = header_bytes(meta, payload, lambda header, body: mac)
    template = HeaderTemplate(meta)
    out = bytearray(template.encoded_size)
    out[template.payload_offset :] = bytes(payload)
    key = meta.namespace + meta.key
    checksum = xxhash.xxh3_64_intdigest(payload)
    size = template.frame_into(memoryview(out), key, ctime=1234.5, checksum=checksum, mac=mac)
    assert size == len(out) == encoded_size(meta)
    assert bytes(out[: template.payload_offset]) == expected


def test_unsealed_chunks_are_served_only_without_verification_until_sealed() -> None:
    meta = make_meta("float16", "LKTHD")
    payload = tensor_bytes(make_tensor("float16", meta.shape))
    template = HeaderTemplate(meta)
    out = bytearray(template.encoded_size)
    out[template.payload_offset :] = bytes(payload)
    template.frame_into(memoryview(out), meta.namespace + meta.key, ctime=7.0, sealed=False)
    trusted = decode(out, verify=False)  # the host memory that framed it
    assert not trusted.sealed
    assert bytes(trusted.payload) == bytes(payload)
    for read in (lambda: decode(out), lambda: decode_header(out)):
        with pytest.raises(InconsistentChunk, match="unsealed"):
            read()
    mac = bytes([9]) * 32
    head = seal_header(memoryview(out), lambda header, body: mac)
    assert head is not None
    assert len(head) == template.payload_offset
    out[: len(head)] = head
    sealed = decode(out)  # verified now: checksum computed over the payload
    assert sealed.sealed
    assert sealed.mac == mac
    assert sealed.checksum == xxhash.xxh3_64_intdigest(payload)
    assert sealed.meta.created == 7.0
    assert seal_header(memoryview(out)) is None  # sealing twice is a no-op


def test_a_planted_unsealed_chunk_is_refused_by_verifying_readers() -> None:
    meta = make_meta("float32", "LKTHD")
    blob = bytearray(encode(meta, tensor_bytes(make_tensor("float32", meta.shape))))
    forged = repack(bytes(blob), 2, 1)  # flags: UNSEALED, header checksum still right
    with pytest.raises(InconsistentChunk, match="unsealed"):
        decode(forged)
