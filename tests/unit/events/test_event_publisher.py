"""KV events on ZMQ (lmtier.events): an embedded cache's events read by a real SUB
socket and decoded by vLLM's own decoder, sequence numbers without a gap, the
replay socket answering a subscriber that restarted, a resync after lost events, and
the endpoints that are refused."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from lmtier import KVSpec, LMTier
from lmtier.chunks.keys import BLOCK_SIZE
from lmtier.chunks.vllm_hash import vllm_block_hashes
from lmtier.config import LMTierConfig
from lmtier.errors import ConfigError
from lmtier.events.publisher import END_SEQ

kv_events = pytest.importorskip("vllm.distributed.kv_events")
msgspec = pytest.importorskip("msgspec")

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=16)
CHUNK = 16
WAIT_S = 30.0  # catches a hang; events arrive within an interval
DECODER = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)


def config(tmp_path: Path, **events: Any) -> LMTierConfig:
    slab = SPEC.encoded_chunk_bytes(CHUNK)
    return LMTierConfig(
        **{
            "chunk_size": CHUNK,
            "cpu": {"capacity_bytes": 8 * slab, "staging_bytes": 4 * slab},
            "disk": {"path": str(tmp_path / "disk")},
            "events": {
                "enabled": True,
                "endpoint": f"ipc://{tmp_path}/events",
                "replay_endpoint": f"ipc://{tmp_path}/replay",
                "interval_s": 0.01,
                "topic": "kv",
                **events,
            },
        }
    )


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def subscribe(context: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)
    time.sleep(0.2)  # a SUB misses what is sent before it joins (the replay covers it)
    return sub


def receive(sub: zmq.Socket[Any], until: Any) -> list[tuple[int, Any]]:
    """(seq, decoded batch) until ``until(batches)`` holds."""
    got: list[tuple[int, Any]] = []
    deadline = time.monotonic() + WAIT_S
    while not until(got):
        assert time.monotonic() < deadline, f"no more events after {len(got)} batches"
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            got.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    return got


def events_of(batches: list[tuple[int, Any]]) -> list[Any]:
    return [event for _, batch in batches for event in batch.events]


def stored_keys(batches: list[tuple[int, Any]], medium: str) -> set[bytes]:
    return {
        bytes(h)
        for event in events_of(batches)
        if isinstance(event, kv_events.BlockStored) and event.medium == medium
        for h in event.block_hashes
    }


def test_stores_evictions_and_disk_writes_decode_with_vllms_decoder(
    tmp_path: Path, context: zmq.Context[Any]
) -> None:
    with LMTier.open(config(tmp_path), kv=SPEC, model_id="events") as cache:
        publisher = cache._store.event_publisher  # type: ignore[attr-defined]
        sub = subscribe(context, publisher.endpoint)
        tokens = list(range(12 * CHUNK))  # 12 chunks through an 8-chunk CPU tier
        cache.store(tokens, torch.randn(SPEC.shape(len(tokens))))
        cache.flush()
        keys = {bytes(k) for k in cache.keys(tokens)}
        batches = receive(sub, lambda got: stored_keys(got, "DISK") == keys)
        seqs = [seq for seq, _ in batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "no gap"
        assert stored_keys(batches, "CPU") == keys
        removed = [e for e in events_of(batches) if isinstance(e, kv_events.BlockRemoved)]
        assert {e.medium for e in removed} == {"CPU"}
        assert len({bytes(h) for e in removed for h in e.block_hashes}) == 4, "evicted"
        first = next(e for e in events_of(batches) if isinstance(e, kv_events.BlockStored))
        assert first.block_size == CHUNK and first.token_ids == []
        assert all(batch.data_parallel_rank == 0 for _, batch in batches)
        sub.close(linger=0)


def test_a_restarted_subscriber_replays_what_it_missed(
    tmp_path: Path, context: zmq.Context[Any]
) -> None:
    with LMTier.open(config(tmp_path), kv=SPEC, model_id="events") as cache:
        publisher = cache._store.event_publisher  # type: ignore[attr-defined]
        for round_ in range(3):  # published while nobody listens, a batch or more each
            before = publisher.batches
            tokens = [round_ * 1000 + t for t in range(2 * CHUNK)]
            cache.store(tokens, torch.randn(SPEC.shape(len(tokens))))
            cache.flush()
            deadline = time.monotonic() + WAIT_S
            while publisher.batches == before:
                assert time.monotonic() < deadline, "no batch published"
                time.sleep(0.01)
        time.sleep(0.1)  # the disk's events of the last round, if they came late
        published = publisher.batches
        replay = context.socket(zmq.DEALER)
        replay.connect(publisher.replay_endpoint)
        replay.send_multipart((b"", (1).to_bytes(8, "big")))
        frames: list[list[bytes]] = []
        while True:
            assert replay.poll(int(WAIT_S * 1000)), "the replay never ended"
            frames.append(replay.recv_multipart())
            if frames[-1][2] == END_SEQ:
                break
        *batches, end = frames
        assert end == [b"", b"", END_SEQ, b""]
        seqs = [int.from_bytes(f[2], "big") for f in batches]
        assert seqs == list(range(1, published)), "every kept batch from 1 on"
        assert all(f[1] == b"kv" for f in batches)
        for frame in batches:
            DECODER.decode(frame[3])
        replay.send_multipart((b"", b"bad"))  # a malformed request is ignored
        replay.send_multipart((b"", (10**6).to_bytes(8, "big")))
        assert replay.poll(int(WAIT_S * 1000))
        assert replay.recv_multipart() == [b"", b"", END_SEQ, b""], "nothing that late"
        replay.close(linger=0)


def test_lost_events_are_followed_by_a_clear_and_a_snapshot(
    tmp_path: Path, context: zmq.Context[Any]
) -> None:
    # A queue of 2 events: one store of 6 chunks emits 6 at once (and 6 more when
    # the disk writes land), far more than the publisher takes between two batches.
    setting = config(tmp_path, max_queue_size=2, interval_s=0.3)
    with LMTier.open(setting, kv=SPEC, model_id="events") as cache:
        publisher = cache._store.event_publisher  # type: ignore[attr-defined]
        sub = subscribe(context, publisher.endpoint)
        tokens = list(range(6 * CHUNK))
        cache.store(tokens, torch.randn(SPEC.shape(len(tokens))))
        held = {bytes(k) for k in cache.keys(tokens)}
        batches = receive(sub, lambda got: stored_keys(got, "CPU") >= held)
        events = events_of(batches)
        cleared = [i for i, e in enumerate(events) if isinstance(e, kv_events.AllBlocksCleared)]
        assert cleared, "a resync"
        after = [(0, kv_events.KVEventBatch(ts=0.0, events=events[cleared[0] :]))]
        assert stored_keys(after, "CPU") == held, "the snapshot names what memory holds"
        assert publisher.resyncs >= 1
        sub.close(linger=0)


def test_endpoints_reachable_from_elsewhere_need_curve(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="reachable from other machines"):
        config(tmp_path, endpoint="tcp://*:5557")
    with pytest.raises(ConfigError, match="reachable from other machines"):
        config(tmp_path, replay_endpoint="tcp://10.1.2.3:5558")
    with pytest.raises(ConfigError, match="not a ZMQ endpoint"):
        config(tmp_path, endpoint="http://127.0.0.1:80")
    with pytest.raises(ConfigError, match="publisher 'kafka'"):
        config(tmp_path, publisher="kafka")
    assert not config(tmp_path, publisher="null").events.enabled
    assert config(tmp_path, endpoint="tcp://127.0.0.1:0").events.endpoint.endswith(":0")
    key = tmp_path / "curve.key"
    key.write_text(zmq.curve_keypair()[1].decode())
    assert config(tmp_path, endpoint="tcp://*:0", curve_secret_key_file=str(key)).events.enabled


def test_a_taken_endpoint_fails_the_open_with_a_config_error(
    tmp_path: Path, context: zmq.Context[Any]
) -> None:
    squatter = context.socket(zmq.PUB)
    port = squatter.bind_to_random_port("tcp://127.0.0.1")
    with pytest.raises(ConfigError, match=r"events\.endpoint: cannot bind"):
        LMTier.open(
            config(tmp_path, endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=None),
            kv=SPEC,
            model_id="events",
        )
    squatter.close(linger=0)


def test_curve_lets_only_subscribers_that_know_the_key_in(
    tmp_path: Path, context: zmq.Context[Any]
) -> None:
    public, secret = zmq.curve_keypair()
    key = tmp_path / "curve.key"
    key.write_text(secret.decode())
    setting = config(
        tmp_path, endpoint="tcp://127.0.0.1:0", replay_endpoint=None, curve_secret_key_file=str(key)
    )
    with LMTier.open(setting, kv=SPEC, model_id="events") as cache:
        publisher = cache._store.event_publisher  # type: ignore[attr-defined]
        assert publisher.public_key == public.decode()
        stranger = subscribe(context, publisher.endpoint)
        member = context.socket(zmq.SUB)
        member.curve_serverkey = public
        member.curve_publickey, member.curve_secretkey = zmq.curve_keypair()
        member.setsockopt(zmq.SUBSCRIBE, b"kv")
        member.connect(publisher.endpoint)
        time.sleep(0.2)
        tokens = list(range(2 * CHUNK))
        cache.store(tokens, torch.randn(SPEC.shape(len(tokens))))
        keys = {bytes(k) for k in cache.keys(tokens)}
        batches = receive(member, lambda got: stored_keys(got, "CPU") == keys)
        assert batches
        assert not stranger.poll(200), "a subscriber without the key gets nothing"
        stranger.close(linger=0)
        member.close(linger=0)


def test_in_vllm_hash_mode_events_name_vllms_own_block_hashes(
    tmp_path: Path, context: zmq.Context[Any]
) -> None:
    setting = config(tmp_path).replace(hash_algorithm="vllm")
    with LMTier.open(setting, kv=SPEC, model_id="events") as cache:
        publisher = cache._store.event_publisher  # type: ignore[attr-defined]
        sub = subscribe(context, publisher.endpoint)
        tokens = list(range(3 * CHUNK + 5))
        cache.store(tokens, torch.randn(SPEC.shape(len(tokens))))
        cache.flush()
        blocks = vllm_block_hashes(tokens)[: 3 * CHUNK // BLOCK_SIZE]
        batches = receive(sub, lambda got: stored_keys(got, "DISK") == set(blocks))
        for medium in ("CPU", "DISK"):
            events = [
                e
                for e in events_of(batches)
                if isinstance(e, kv_events.BlockStored) and e.medium == medium
            ]
            assert [bytes(h) for e in events for h in e.block_hashes] == blocks, medium
            assert {e.block_size for e in events} == {BLOCK_SIZE}
            assert events[0].parent_block_hash is None
        sub.close(linger=0)
    # vLLM's integer form, as VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES makes it.
    with LMTier.open(
        config(tmp_path / "ints", int_block_hashes=True).replace(hash_algorithm="vllm"),
        kv=SPEC,
        model_id="events",
    ) as cache:
        publisher = cache._store.event_publisher  # type: ignore[attr-defined]
        sub = subscribe(context, publisher.endpoint)
        cache.store(tokens, torch.randn(SPEC.shape(len(tokens))))
        expected = [int.from_bytes(h, "big") & (2**64 - 1) for h in blocks]
        got = receive(
            sub, lambda got: sum(len(e.block_hashes) for e in events_of(got)) >= len(blocks)
        )
        first = next(e for e in events_of(got) if isinstance(e, kv_events.BlockStored))
        assert first.block_hashes == expected[: len(first.block_hashes)]
        sub.close(linger=0)
