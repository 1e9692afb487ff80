"""A seeded random walk of valid, half-valid and hostile calls against a real sidecar:
every method over gRPC and the lane, session ids right and wrong, leases of this
session, another's or none, commits of good chunks, garbage and lies, chunk pieces out
of order, odd floats, and clients scribbling over slabs of the shared pool.

What must hold whatever the order (test_sidecar_hostile.py has each case alone): every
failure is a status code naming the caller's error or the sidecar's state, never
UNKNOWN or INTERNAL and never a hang; the process lives, logs no traceback, answers a
fresh session; and once the walk's sessions end, no lease is left."""

from __future__ import annotations

import random
import secrets
import socket
import struct
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from lmtier.chunks.keys import ChunkKey
from lmtier.testing.sidecar import SidecarProcess
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.v1 import sidecar_pb2_grpc as pb_grpc
from lmtier.wire.lane import LaneClient
from lmtier.wire.shm import SharedRegion
from support.sidecar_helpers import (
    CALL_TIMEOUT_S,
    Session,
    assert_unharmed,
    chunk_for,
    gauges,
    namespace,
    open_session,
    pieces,
    wait_for,
    write_slab,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 1500
SETTINGS = {
    "cpu": {"capacity_bytes": "2MiB", "staging_bytes": "1MiB"},
    "disk": {"enabled": True, "capacity_bytes": "4MiB"},
    "sidecar": {
        "slab_bytes": "16KiB",
        "max_message_bytes": "256KiB",
        "stream_piece_bytes": "4KiB",
        "lease_ttl_s": 5,
    },
}
NEVER = {
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.DATA_LOSS,
}
LANE_CALLS = {"Lookup", "Load", "AcquireSlabs", "Commit", "Release"}
NAMESPACE_FIELDS = ["model_id", "model_revision", "kv_dtype", "kv_layout", "cache_salt"]
GEOMETRY_FIELDS = ["num_layers", "num_kv_heads", "head_dim", "chunk_size", "tp_size", "tp_rank"]
STEP_NAMES = ["open", "close", "Lookup", "Load", "LoadStream", "acquire", "commit", "store"]
STEP_NAMES += ["Release", "Flush", "Stats", "Purge", "Pin", "scribble", "lane"]


class Walk:
    """The walk's state (open sessions, leases held, chunks committed) and its steps."""

    def __init__(self, sidecar: SidecarProcess, stub: pb_grpc.SidecarStub, seed: int) -> None:
        self.sidecar, self.stub, self.rng = sidecar, stub, random.Random(seed)
        self.sessions: list[Session] = []
        self.held: list[tuple[Session, int, int, bool]] = []  # session, lease, slab, writable
        self.stored: list[bytes] = []
        self.codes: Counter[tuple[str, str]] = Counter()
        self.lane: LaneClient | None = None
        self.regions: dict[str, SharedRegion] = {}

    # ---- random values -------------------------------------------------------------

    def blob(self) -> bytes:
        size = self.rng.choice([0, 1, 16, 31, 32, 33, 64, self.rng.randint(0, 5000)])
        return secrets.token_bytes(size)

    def number(self, bits: int = 32) -> int:
        return self.rng.choice([0, 1, 7, 16, 17, 100, 2**bits - 1, self.rng.getrandbits(bits)])

    def text(self) -> str:
        return self.rng.choice(["", "cpu", "disk", "x" * 300, "\u00e9\u4e2d", "../..", "\x00"])

    def session_id(self) -> bytes:
        if self.sessions and self.rng.random() < 0.8:
            return self.rng.choice(self.sessions).id
        return self.blob()

    def keys(self) -> bytes:
        roll = self.rng.random()
        if roll < 0.3 and self.stored:
            return b"".join(self.rng.sample(self.stored, min(len(self.stored), 5)))
        if roll < 0.6 and self.sessions:
            session = self.rng.choice(self.sessions)
            return b"".join(session.key() for _ in range(self.rng.randint(0, 8)))
        return self.blob()

    def leases(self) -> list[int]:
        return [
            self.rng.choice(self.held)[1]
            if self.held and self.rng.random() < 0.6
            else self.number(64)
            for _ in range(self.rng.randint(0, 4))
        ]

    # ---- calls ---------------------------------------------------------------------

    def call(self, method: str, request: Any) -> Any:
        """``method(request)`` over the lane (when open and it carries it) or gRPC;
        the reply, or None after counting its status code."""
        try:
            if self.lane is not None and method in LANE_CALLS and self.rng.random() < 0.4:
                reply = self.lane.call(method, request)
            else:
                reply = getattr(self.stub, method)(request, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as exc:
            self.codes[method, exc.code().name] += 1
            return None
        self.codes[method, "OK"] += 1
        return reply

    def consume(self, method: str, stream: Callable[[], Any]) -> None:
        try:
            for _ in stream():
                pass
        except grpc.RpcError as exc:
            self.codes[method, exc.code().name] += 1
        else:
            self.codes[method, "OK"] += 1

    def session_of(self, session_id: bytes) -> Session | None:
        return next((s for s in self.sessions if s.id == session_id), None)

    # ---- steps ---------------------------------------------------------------------

    def open(self) -> None:
        space = namespace()
        if self.rng.random() < 0.5:  # a namespace with some fields wrong
            for name in self.rng.sample(NAMESPACE_FIELDS + GEOMETRY_FIELDS, 2):
                setattr(space, name, self.text() if name in NAMESPACE_FIELDS else self.number())
        try:
            opened = open_session(self.stub, space, shared_memory=self.rng.random() < 0.7)
        except grpc.RpcError as exc:
            self.codes["OpenSession", exc.code().name] += 1
            return
        self.codes["OpenSession", "OK"] += 1
        self.sessions.append(opened)
        if self.lane is None and opened.info.lane:
            self.lane = LaneClient(opened.info.lane, None, CALL_TIMEOUT_S)

    def close(self) -> None:
        if self.sessions and self.rng.random() < 0.3:
            gone = self.sessions.pop(self.rng.randrange(len(self.sessions)))
            gone.close()
            self.held = [h for h in self.held if h[0] is not gone]

    def lookup_or_load(self, method: str) -> None:
        request: Any = (pb.LookupRequest if method == "Lookup" else pb.LoadRequest)(
            session_id=self.session_id(), max_tokens=self.number()
        )
        if self.rng.random() < 0.6:
            request.keys = self.keys()
        else:
            request.tokens.ids.extend(self.number() for _ in range(self.rng.choice([0, 16, 48])))
        if method != "Lookup":
            for _ in range(self.rng.choice([0, 0, 1, 3])):
                request.lookup.add(tier=self.text(), start=self.number(), stop=self.number())
            request.release.extend(self.leases())
        if method == "LoadStream":
            self.consume(method, lambda: self.stub.LoadStream(request, timeout=CALL_TIMEOUT_S))
            return
        reply = self.call(method, request)
        owner = self.session_of(request.session_id)
        if method == "Load" and reply is not None and owner is not None:
            self.held += [(owner, c.lease, c.slab, False) for c in reply.chunks]

    def acquire(self) -> None:
        request = pb.AcquireSlabsRequest(
            session_id=self.session_id(),
            count=self.rng.choice([0, 1, 3, self.number()]),
            release=self.leases(),
        )
        if self.rng.random() < 0.4:
            request.keys = self.keys()
        reply = self.call("AcquireSlabs", request)
        owner = self.session_of(request.session_id)
        if reply is not None and owner is not None:
            self.held += [(owner, g.lease, g.slab, True) for g in reply.slabs]

    def commit(self) -> None:
        request = pb.CommitRequest(session_id=self.session_id())
        writable = [h for h in self.held if h[3]]
        for _ in range(self.rng.randint(0, 3)):
            if not writable or self.rng.random() < 0.3:
                request.chunks.add(lease=self.number(64), key=self.blob(), length=self.number(64))
                continue
            owner, lease, slab, _ = self.rng.choice(writable)
            key = owner.key() if self.rng.random() < 0.8 else self.blob()
            good = len(key) == 32 and self.rng.random() < 0.7
            data = chunk_for(ChunkKey(key)) if good else self.blob()
            self.write(owner, slab, 0, data)
            length = self.rng.choice([len(data), len(data), 0, self.number(64)])
            request.chunks.add(lease=lease, key=key, length=length)
            if good and length == len(data):
                self.stored.append(key)
        self.call("Commit", request)
        ended = {c.lease for c in request.chunks}
        self.held = [h for h in self.held if h[1] not in ended]

    def store_stream(self) -> None:
        owner = self.rng.choice(self.sessions) if self.sessions else None

        def messages() -> Iterator[pb.ChunkPiece]:
            if owner is not None and self.rng.random() < 0.6:
                chunks = [(k, chunk_for(k)) for k in (owner.key() for _ in range(2))]
                for piece in pieces(owner.id, chunks, self.rng.choice([1024, 4096, 100_000])):
                    if self.rng.random() < 0.05:
                        piece.offset = self.number(64)
                    if self.rng.random() < 0.05:
                        piece.total_length = self.number(64)
                    yield piece
                return
            for _ in range(self.rng.randint(0, 5)):
                yield pb.ChunkPiece(
                    session_id=self.session_id() if self.rng.random() < 0.5 else b"",
                    key=self.blob(),
                    total_length=self.number(64),
                    offset=self.number(64),
                    data=self.blob(),
                    tier=self.text(),
                )

        self.consume("StoreStream", lambda: [self.stub.StoreStream(messages(), timeout=30)])

    def scribble(self) -> None:
        """A buggy client writing over a random slab of the shared pool."""
        owner = self.rng.choice(self.sessions) if self.sessions else None
        if owner is not None and owner.info.HasField("shm"):
            slab = self.rng.randrange(owner.info.shm.num_slabs)
            at = self.rng.choice([0, 1, 8, 64, 200, self.rng.randrange(16 * 1024)])
            self.write(owner, slab, at, secrets.token_bytes(self.rng.choice([1, 8, 100])))

    def write(self, owner: Session, slab: int, at: int, data: bytes) -> None:
        """``data`` (cut at the slab's end) at byte ``at`` of ``slab``, through the pool
        as ``owner``'s client maps it."""
        shm = owner.info.shm if owner.info.HasField("shm") else None
        if shm is None or slab >= shm.num_slabs:
            return
        region = self.regions.get(shm.path)
        if region is None:
            region = self.regions[shm.path] = SharedRegion.attach(Path(shm.path), shm.size)
        write_slab(region, owner, slab, data[: max(0, shm.slab_stride - at)], at)

    def raw_lane_frame(self) -> None:
        """A lane connection that says hello, then sends one random frame."""
        path = self.lane.path if self.lane is not None else None
        if path is None:
            return
        with socket.socket(socket.AF_UNIX) as raw:
            raw.settimeout(0.5)
            body = self.blob()
            length = len(body) if self.rng.random() < 0.8 else self.rng.randint(0, 300)
            try:
                raw.connect(path)
                raw.sendall(struct.pack("<IB", 0, 0))
                raw.recv(5)
                raw.sendall(struct.pack("<IB", length, self.rng.randint(0, 10)) + body)
                raw.recv(100)
            except OSError:
                pass  # a frame cut short waits for the rest: this end gives up first

    def step(self) -> None:
        choice = self.rng.choice(STEP_NAMES)
        if choice in ("Lookup", "Load", "LoadStream"):
            self.lookup_or_load(choice)
        elif choice == "Release":
            leases = self.leases()
            self.call("Release", pb.ReleaseRequest(session_id=self.session_id(), leases=leases))
            self.held = [h for h in self.held if h[1] not in leases]
        elif choice == "Flush":
            timeout = self.rng.choice([0.0, -1.0, float("nan"), float("inf"), 1e308, 0.01])
            self.call("Flush", pb.FlushRequest(session_id=self.session_id(), timeout_s=timeout))
        elif choice == "Stats":
            self.call("Stats", pb.StatsRequest(session_id=self.session_id()))
        elif choice == "Purge" and self.rng.random() < 0.2:
            dry_run = self.rng.random() < 0.5
            self.call("Purge", pb.PurgeRequest(session_id=self.session_id(), dry_run=dry_run))
        elif choice == "Pin":
            unpin = self.rng.random() < 0.5
            self.call(
                "Pin", pb.PinRequest(session_id=self.session_id(), keys=self.keys(), unpin=unpin)
            )
        else:
            action = {
                "open": self.open,
                "close": self.close,
                "acquire": self.acquire,
                "commit": self.commit,
                "store": self.store_stream,
                "scribble": self.scribble,
                "lane": self.raw_lane_frame,
            }.get(choice)
            if action is not None:
                action()

    def end(self) -> None:
        for session in self.sessions:
            session.close()
        if self.lane is not None:
            self.lane.close()
        for region in self.regions.values():
            region.close()


@pytest.mark.parametrize("seed", [1, 2])
def test_a_random_walk_of_hostile_calls(tmp_path: Path, seed: int) -> None:
    with (
        SidecarProcess(tmp_path / "sidecar", SETTINGS) as sidecar,
        grpc.insecure_channel(sidecar.target) as channel,
    ):
        stub = pb_grpc.SidecarStub(channel)
        walk = Walk(sidecar, stub, seed)
        try:
            for _ in range(3):
                walk.open()
            for _ in range(STEPS):
                walk.step()
                assert sidecar.process is not None and sidecar.process.poll() is None
        finally:
            walk.end()
        wrong = {code: n for code, n in walk.codes.items() if grpc.StatusCode[code[1]] in NEVER}
        assert not wrong, (wrong, sidecar.log()[-3000:])
        assert walk.codes["Commit", "OK"] and walk.codes["Load", "OK"], walk.codes
        assert_unharmed(sidecar)
        with open_session(stub) as session:
            wait_for(lambda: gauges(stub, session)["leases"] == 0, "every lease ended")
        assert "Traceback" not in sidecar.log()
