"""KV events published on ZMQ the way vLLM publishes its own: a PUB socket sending
``(topic, sequence number, KVEventBatch)`` and a ROUTER socket that replays the
batches a subscriber missed.

The protocol is vLLM's ``ZmqEventPublisher``'s, so that its subscribers (llm-d's
indexer, Dynamo's, lmtier's fleet index) need no change:

* every ``interval_s`` the events queued since the last batch go out as one
  ``KVEventBatch`` (:mod:`.wire`), as a three-part message: the topic, the batch's
  sequence number (8 bytes, big-endian, from 0, one per batch, never a gap), the
  msgpack payload;
* the last ``buffer_steps`` batches are kept; a subscriber that sends the ROUTER
  socket a sequence number (8 bytes, big-endian) gets every kept batch from it on,
  each as ``(topic, seq, payload)`` after an empty delimiter frame, then an end
  marker with sequence number -1 and an empty payload.

The events come from the StorageManager's :class:`~lmtier.storage.events.TierEvents`
through a bounded subscription. When that subscription lost events (the publisher
fell ``max_queue_size`` behind) or a tier dropped a whole namespace it cannot list
(a byte tier's purge), a batch starts with ``AllBlocksCleared`` and then ``BlockStored``
of what the node's CPU tier holds, so that a subscriber's view is whole again rather
than silently wrong.

One thread owns both sockets (ZMQ sockets are not thread-safe); they are bound in
:meth:`EventPublisher.start`, so that a taken port is an error at start, not a
silent absence of events.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import zmq

from lmtier.chunks.keys import ChunkKey
from lmtier.config.events import EventsConfig
from lmtier.errors import ConfigError
from lmtier.events.wire import all_cleared, encode_batch, vllm_events
from lmtier.storage.events import TierEvent, TierEvents

__all__ = ["END_SEQ", "SNAPSHOT_KEYS", "EventPublisher"]

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence number of the replay's end marker."""
SNAPSHOT_KEYS = 1024
"""Keys per ``BlockStored`` of a snapshot (one event per this many)."""

Snapshot = Callable[[], Sequence[ChunkKey]]
"""The keys the node's CPU tier holds now."""


class EventPublisher:
    """Publishes one StorageManager's events (module docstring)."""

    def __init__(
        self,
        config: EventsConfig,
        events: TierEvents,
        *,
        block_size: int,
        snapshot: Snapshot,
        memory_tier: str = "cpu",
    ) -> None:
        self.config = config
        self._events = events
        self._block_size = block_size
        self._snapshot = snapshot
        self._memory_tier = memory_tier
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sockets: tuple[Any, Any | None] | None = None
        self.endpoint = config.endpoint
        self.replay_endpoint = config.replay_endpoint
        self.public_key: str | None = None
        """The CURVE public key subscribers need (None without CURVE)."""
        self.batches = 0
        self.resyncs = 0
        """Batches that began with ``AllBlocksCleared`` and a snapshot."""

    def start(self) -> EventPublisher:
        """Bind the sockets and start publishing; ConfigError if an endpoint cannot be
        bound (taken, no such directory) or the CURVE key cannot be read."""
        config = self.config
        context: zmq.Context[Any] = zmq.Context.instance()
        secret = _curve_secret(config.curve_secret_key_file)
        pub = context.socket(zmq.PUB)
        replay = None
        try:
            pub.set_hwm(config.hwm)
            self._secure(pub, secret)
            self.endpoint = _bind(pub, config.endpoint, "endpoint")
            if config.replay_endpoint is not None:
                replay = context.socket(zmq.ROUTER)
                replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self._secure(replay, secret)
                self.replay_endpoint = _bind(replay, config.replay_endpoint, "replay_endpoint")
        except BaseException:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            raise
        self._sockets = (pub, replay)
        self._subscription = self._events.subscribe(config.max_queue_size)
        self._thread = threading.Thread(target=self._run, name="lmtier-events", daemon=True)
        self._thread.start()
        logger.info("KV events on %s (replay: %s)", self.endpoint, self.replay_endpoint)
        return self

    def _secure(self, sock: Any, secret: bytes | None) -> None:
        if secret is None:
            return
        public = zmq.curve_public(secret)
        sock.curve_server = True
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        self.public_key = public.decode()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Publish what is queued, stop the thread, close the sockets. Idempotent."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout_s)
        self._subscription.close()
        if self._sockets is not None and not thread.is_alive():
            for sock in self._sockets:
                if sock is not None:
                    sock.close(linger=0)
            self._sockets = None

    # ---- the thread ------------------------------------------------------------------

    def _run(self) -> None:
        assert self._sockets is not None
        pub, replay = self._sockets
        poller = zmq.Poller()
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        interval = self.config.interval_s
        lost = 0
        next_batch = time.monotonic() + interval
        while True:
            stopping = self._stop.is_set()
            wait = max(0.0, next_batch - time.monotonic())
            if replay is not None:
                if poller.poll(0 if stopping else int(wait * 1000)):
                    self._serve_replay(replay)
            elif not stopping:
                self._stop.wait(wait)
            if time.monotonic() < next_batch and not stopping:
                continue
            next_batch = time.monotonic() + interval
            try:
                lost = self._publish(pub, lost)
            except Exception:  # a publisher error costs events, never the cache
                logger.exception("publishing KV events failed")
            if stopping:
                return

    def _publish(self, pub: Any, lost: int) -> int:
        """One batch of what is queued (with a resync first where needed); the
        subscription's lost count so far."""
        subscription = self._subscription
        taken = subscription.take()
        events, cleared = self._vllm(taken)
        if subscription.lost != lost or cleared:
            lost = subscription.lost
            self.resyncs += 1
            keys = list(self._snapshot())
            snapshot = [
                TierEvent("stored", self._memory_tier, tuple(keys[i : i + SNAPSHOT_KEYS]))
                for i in range(0, len(keys), SNAPSHOT_KEYS)
            ]
            events = [all_cleared(), *self._vllm(snapshot)[0]]
        if not events:
            return lost
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(time.time(), events, self.config.data_parallel_rank)
        topic = self.config.topic.encode()
        pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.batches += 1
        return lost

    def _vllm(self, events: list[TierEvent]) -> tuple[list[dict[str, Any]], bool]:
        return vllm_events(
            events,
            self._block_size,
            self._events.name_of,
            int_hashes=self.config.int_block_hashes,
        )

    def _serve_replay(self, replay: Any) -> None:
        """Answer one replay request: the kept batches from its sequence number on."""
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignored a malformed KV-event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        topic = self.config.topic.encode()
        for seq, payload in list(self._buffer):
            if seq >= first:
                replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _bind(sock: Any, endpoint: str, what: str) -> str:
    """Bind ``sock``; the endpoint bound (a TCP port 0 resolved)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise ConfigError(f"events.{what}: cannot bind {endpoint!r} ({exc})") from None
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return str(bound) if bound else endpoint


def _curve_secret(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"events.curve_secret_key_file: cannot read it ({exc.strerror})"
        ) from None
    if len(text) != 40:
        raise ConfigError(
            "events.curve_secret_key_file: not a Z85 CURVE secret key (40 characters)"
        )
    return text.encode()
