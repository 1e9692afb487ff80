"""A streamed chunk's messages as this client writes them: the pieces protobuf reads,
a streaming store's chunk written straight into its message, and a streamed load's
chunk read where its message lies."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from lmtier.errors import HandleError
from lmtier.remote.streaming import MessageSlab, ReceivedSlab, in_messages
from lmtier.storage.host_pool import HostPool
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.wire.pieces import (
    PIECE_BYTES,
    PieceBuffer,
    bytes_tensor,
    chunk_pieces,
    decode_piece,
)

SESSION = bytes(range(16))
KEY = bytes(range(100, 132))


@pytest.mark.parametrize("length", [1, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**21 + 4160])
def test_a_piece_buffer_is_the_piece_protobuf_reads_with_its_data_8_aligned(length: int) -> None:
    buffer = PieceBuffer(SESSION, length)
    data = os.urandom(length)
    buffer.view[:] = data
    assert len(buffer.view) == buffer.tensor.numel() == length
    assert buffer.tensor.data_ptr() % 8 == 0
    message = buffer.seal(KEY)
    parsed = pb.ChunkPiece.FromString(message)
    assert (parsed.session_id, parsed.key, parsed.total_length, parsed.offset) == (
        SESSION,
        KEY,
        length,
        0,
    )
    assert parsed.data == data
    ours = decode_piece(message)
    assert (ours.session_id, ours.key, ours.total_length, bytes(ours.data)) == (
        SESSION,
        KEY,
        length,
        data,
    )


def test_a_piece_buffer_takes_only_a_whole_key() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        PieceBuffer(SESSION, 64).seal(KEY[:31])


def test_chunk_pieces_cut_a_chunk_protobuf_reassembles() -> None:
    data = os.urandom(10_000)
    pieces = [pb.ChunkPiece.FromString(p) for p in chunk_pieces(KEY, memoryview(data), 9000, 4096)]
    assert [p.offset for p in pieces] == [0, 3000, 6000]
    assert pieces[0].key == KEY and pieces[0].total_length == 9000
    assert b"".join(p.data for p in pieces) == data[:9000]


@pytest.fixture
def pool() -> Iterator[HostPool]:
    pool = HostPool.for_chunks(4096, 3 * 4096, align=64)
    yield pool
    pool.close()


def test_a_message_slab_is_sent_as_its_message_and_holds_a_slab_until_released(
    pool: HostPool,
) -> None:
    slabs = in_messages(pool, [pool.acquire(), pool.acquire()], SESSION, 3000)
    assert all(isinstance(slab, MessageSlab) for slab in slabs) and pool.num_free == 1
    first = slabs[0]
    assert isinstance(first, MessageSlab)
    assert first.message(KEY, 3000, SESSION) is None  # nothing written: no message made yet
    first.view[:] = b"x" * 3000
    assert first.message(KEY, 2999, SESSION) is None  # not the length it was made for
    assert first.message(KEY, 3000, bytes(16)) is None  # another call's session
    message = first.message(KEY, 3000, SESSION)
    assert message is not None
    parsed = pb.ChunkPiece.FromString(message)
    assert (parsed.data, parsed.key, parsed.session_id) == (b"x" * 3000, KEY, SESSION)
    first.release()
    assert pool.num_free == 2
    with pytest.raises(HandleError):
        first.release()
    with pytest.raises(HandleError):
        _ = first.view
    with pytest.raises(HandleError):
        first.share()
    pool.close()
    with pytest.raises(HandleError):  # the client closed its pool: nothing is sent
        slabs[1].message(KEY, 3000, SESSION)
    slabs[1].release()  # releasing after the close is allowed, as for any slab


def test_a_chunk_bigger_than_a_message_keeps_its_slab(pool: HostPool) -> None:
    slab = pool.acquire()
    assert slab is not None
    assert in_messages(pool, [slab], SESSION, PIECE_BYTES + 1) == [slab]
    slab.release()


def test_a_parsed_piece_says_where_its_data_lies_in_the_message() -> None:
    data = os.urandom(5000)
    for raw in chunk_pieces(KEY, memoryview(data), 5000, 2048, tier="cpu"):
        piece = decode_piece(raw)
        assert raw[piece.data_at : piece.data_at + len(piece.data)] == bytes(piece.data)


def test_bytes_tensor_is_the_bytes_in_place_and_checks_its_bounds() -> None:
    message = os.urandom(100)
    tensor = bytes_tensor(message, 10, 50)
    assert tensor.numel() == 50 and bytes(tensor.numpy()) == message[10:60]
    assert bytes_tensor(message, 100, 0).numel() == 0
    for start, length in [(-1, 10), (60, 41), (0, 101)]:
        with pytest.raises(ValueError, match="not within 100"):
            bytes_tensor(message, start, length)


def test_a_received_slab_is_its_message_data_and_holds_a_slab_until_released(
    pool: HostPool,
) -> None:
    data = os.urandom(3000)
    (raw,) = chunk_pieces(KEY, memoryview(data), 3000, 4096, tier="disk")
    piece = decode_piece(raw)
    budget = pool.acquire()
    assert budget is not None
    del piece.data  # the parsed piece's view of the message: only the slab's is left
    holders = sys.getrefcount(raw)
    slab = ReceivedSlab(pool, budget, raw, piece.data_at, len(data))
    assert sys.getrefcount(raw) > holders
    assert pool.num_free == 2 and slab.index == budget.index
    assert bytes(slab.view) == data and bytes(slab.tensor.numpy()) == data
    assert not slab.view.readonly  # read as a slab's view is: numpy and torch take it as is
    with pytest.raises(HandleError):
        slab.share()
    slab.release()
    assert pool.num_free == 3
    assert sys.getrefcount(raw) == holders  # a released slab lets its message go
    with pytest.raises(HandleError):
        _ = slab.tensor
    with pytest.raises(HandleError):
        slab.release()
