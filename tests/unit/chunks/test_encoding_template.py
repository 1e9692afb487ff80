"""HeaderTemplate.frames: a chunk framed by the template is recognised with one
compare; anything else (another key, a sealed header, damage, a bad time stamp) is not,
and is left to a decode."""

from __future__ import annotations

import math
import struct

import torch

from lmtier.chunks.encoding import HeaderTemplate
from lmtier.chunks.keys import ChunkKey
from lmtier.kv_spec import ChunkFramer, KVSpec
from lmtier.storage.host_pool import HostPool

SPEC = KVSpec(2, 2, 8)
KEY = ChunkKey(bytes(range(32)))


def framed() -> tuple[HostPool, memoryview, HeaderTemplate]:
    pool = HostPool(SPEC.encoded_chunk_bytes(16), 1, align=64)
    handle = pool.acquire()
    assert handle is not None
    framer = ChunkFramer(SPEC, 16)
    length = framer.write(handle, KEY, torch.ones(SPEC.shape(16)), 1234.5)
    return pool, handle.view[:length], framer.template


def test_a_chunk_the_template_framed_is_recognised() -> None:
    _, data, template = framed()
    assert template.frames(data, KEY)


def test_anything_else_is_left_to_a_decode() -> None:
    _, data, template = framed()
    assert not template.frames(data, ChunkKey(bytes(32)))  # another key
    assert not template.frames(data[:-1], KEY)  # cut short
    offset = template._offsets["ctime"]
    for bad in (math.nan, math.inf, -1.0):
        copy = bytearray(data)
        struct.pack_into(">d", copy, offset, bad)  # msgpack floats are big-endian
        assert not template.frames(memoryview(copy), KEY)
    damaged = bytearray(data)
    damaged[8] ^= 1
    assert not template.frames(memoryview(damaged), KEY)
    other = ChunkFramer(KVSpec(3, 2, 8), 16).template
    assert not other.frames(data, KEY)
