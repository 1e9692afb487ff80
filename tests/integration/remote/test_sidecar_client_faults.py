"""A sidecar client under faults: what a fault-injection probe of real ``lmtier serve``
processes (SIGSTOP, SIGKILL, SIGTERM, a paused Redis) found wrong in the client and in
the drain, each kept here as a regression test.

* A shared-memory result is leases on slabs of the sidecar's pool. The client must
  keep them valid while it holds the result: when it gives up on a paused sidecar
  (its session is then dropped), and when the sidecar's reaper ends another, older
  lease of the same client. Before the fix both ended every lease of the session,
  and a result still held read another prompt's bytes once the slabs were reused.
* A client outlives sidecar restarts and short-lived threads: it must not keep every
  dead sidecar's pool mapped, nor a lane socket per thread that ever called.
* ``LaneClient.close()`` while another thread awaits a lane reply fails that call
  with UNAVAILABLE (it raised AttributeError).
* SIGTERM while a load is in flight lets it finish (it missed: the drain ended the
  sessions first) and the sidecar exits 0 without logging a traceback.
* A client frozen in the middle of a StoreStream is noticed by the keepalive like any
  other (it took 60 s: grpc's ping timeout, not the keepalive's, applied). The test's
  sidecar sets ``sidecar.keepalive_s`` short (2 s, not the default 10 s).

Everything is a real process or a real socket; waits poll for a condition, except
where the test is about time itself (a lease's age).
"""

from __future__ import annotations

import gc
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from lmtier import LMTier, load_config
from lmtier.remote.connection import serving_problem
from lmtier.testing.sidecar import SidecarProcess
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.v1 import sidecar_pb2_grpc as pb_grpc
from lmtier.wire.lane import LaneClient, LaneError, lane_path
from support import TESTS
from support.redis_servers import RedisServer
from support.sidecar_client import MODEL, SPEC, connect, gauges, kv_of, prompt
from support.sidecar_helpers import LANE_HEADER, open_session, read_exactly, wait_for
from support.sidecar_helpers import gauges as sidecar_gauges

pytestmark = pytest.mark.integration

SETTINGS: dict[str, Any] = {
    "cpu": {"capacity_bytes": "8MiB", "staging_bytes": "4MiB"},
    "sidecar": {"slab_bytes": "520KiB"},
}
"""A small pool (22 slabs of 520 KiB): a few stores reuse every free slab."""
CHUNK = 256
N = 4 * CHUNK


def same(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    """Whether a result's KV is ``want``, bit for bit (None: no KV)."""
    return got is not None and torch.equal(got, want)


def reuse_every_free_slab(cache: LMTier) -> None:
    """Store more new chunks than the pool has slabs: every slab not leased is
    written with other prompts' bytes."""
    prompts = int(gauges(cache)["slabs_total"]) // 4 + 2
    for seed in range(1000, 1000 + prompts):
        assert cache.store(prompt(seed, N), kv_of(seed, N)) == 4


def running(directory: Path, settings: dict[str, Any]) -> Iterator[SidecarProcess]:
    """A started sidecar, stopped at the end (resumed first: a paused one could not
    drain)."""
    process = SidecarProcess(directory, settings)
    try:
        yield process.start()
    finally:
        if process.process is not None and process.process.poll() is None:
            process.signal(signal.SIGCONT)
        process.stop()


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[SidecarProcess]:
    yield from running(tmp_path / "sidecar", SETTINGS)


@pytest.fixture
def observer(sidecar: SidecarProcess) -> Iterator[LMTier]:
    """Another shared-memory client of ``sidecar``."""
    with connect(sidecar.target, stream=False) as cache:
        yield cache


# ---- leases held by the client ------------------------------------------------------


@pytest.mark.slow  # a real timer: a paused sidecar
def test_a_result_held_while_its_client_gives_up_on_a_paused_sidecar_keeps_its_bytes(
    sidecar: SidecarProcess, observer: LMTier
) -> None:
    ids, kv = prompt(1, N), kv_of(1, N)
    with connect(sidecar.target, stream=False, timeout_s=1.0) as client:
        assert client.store(ids, kv) == 4
        hit = client.load(ids)
        try:
            assert hit.num_tokens == N
            sidecar.signal(signal.SIGSTOP)
            try:
                assert client.lookup(ids).num_tokens == 0  # times out: the session is dropped
            finally:
                sidecar.signal(signal.SIGCONT)
            wait_for(lambda: client.lookup(ids).num_tokens == N, "the client reconnecting")
            reuse_every_free_slab(observer)
            exact = same(hit.kv(), kv)
            assert exact, "the held result read other chunks' bytes"
        finally:
            hit.release()
        wait_for(lambda: gauges(observer)["leases"] == 0, "the held result's leases ending")


@pytest.mark.slow  # a real timer: the lease reaper
def test_the_reaper_ends_a_late_lease_and_spares_a_fresh_one_of_the_same_client(
    tmp_path: Path,
) -> None:
    ttl_s = 8.0  # the reaper runs every second
    settings = {**SETTINGS, "sidecar": {**SETTINGS["sidecar"], "lease_ttl_s": ttl_s}}
    tokens = 2 * CHUNK
    old_ids, ids, kv = prompt(2, tokens), prompt(3, tokens), kv_of(3, tokens)
    with (
        SidecarProcess(tmp_path / "sidecar", settings) as sidecar,
        connect(sidecar.target, stream=False) as client,
        connect(sidecar.target, stream=False) as observer,
    ):
        assert client.store(old_ids, kv_of(2, tokens)) == 2
        assert client.store(ids, kv) == 2
        old = client.load(old_ids)  # held too long: a stuck request
        old_at = time.monotonic()
        try:
            # The scenario is about age: the fresh load comes just before the old lease
            # expires, so the reaper ends the old one while the fresh one is young
            # (this client uses it until 0.9 * ttl_s after its load: seconds to spare
            # on a loaded machine).
            time.sleep(max(0.0, old_at + ttl_s - 1.5 - time.monotonic()))
            with client.load(ids) as fresh:
                assert fresh.num_tokens == tokens
                wait_for(
                    lambda: gauges(observer)["leases_expired"] >= 2,
                    "the reaper ending the old lease",
                    timeout_s=ttl_s + 5,
                )
                reuse_every_free_slab(observer)
                exact = same(fresh.kv(), kv)
                assert exact, "the fresh result read other chunks' bytes"
                leases = gauges(observer)["leases"]
                assert leases == 2, f"{leases} leases held: the fresh load's 2 expected"
        finally:
            old.release()


MAPPED_POOL = re.compile(r"/lmtier-(\d+)-[0-9a-f]+\.pool")


def mapped_pools(pids: set[int]) -> set[str]:
    """The pool files of sidecars ``pids`` this process maps now (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        found = (MAPPED_POOL.search(line) for line in maps)
        return {m[0] for m in found if m is not None and int(m[1]) in pids}


@pytest.mark.slow  # restarts of the sidecar
def test_a_client_keeps_one_pool_mapped_however_often_its_sidecar_restarts(
    tmp_path: Path,
) -> None:
    tokens = 2 * CHUNK
    ids, kv = prompt(4, tokens), kv_of(4, tokens)
    sidecars = [SidecarProcess(tmp_path / "sidecar0", SETTINGS)]
    try:
        target = sidecars[0].start().target
        with connect(target, stream=False, timeout_s=2.0) as client:
            assert client.store(ids, kv) == 2
            for restart in range(1, 4):
                sidecars[-1].signal(signal.SIGKILL)
                sidecars[-1].wait()
                sidecars.append(
                    SidecarProcess(tmp_path / f"sidecar{restart}", SETTINGS, listen=target)
                )
                sidecars[-1].start()
                wait_for(
                    lambda: client.store(ids, kv) > 0 or client.lookup(ids).num_tokens == tokens,
                    f"the client storing into restarted sidecar {restart}",
                )
                with client.load(ids) as hit:
                    assert hit.num_tokens == tokens
                    assert same(hit.kv(), kv)
            pools = mapped_pools({s.pid for s in sidecars})
            assert len(pools) <= 2, f"{len(pools)} pools mapped after 3 restarts: {pools}"
    finally:
        for process in sidecars:
            process.stop()


# ---- the lane's connections ---------------------------------------------------------


def unix_sockets() -> int:
    """Unix sockets this process has open (its fds, against /proc/net/unix)."""
    with open("/proc/net/unix") as table:
        inodes = {line.split()[6] for line in list(table)[1:]}
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        count += link.startswith("socket:[") and link[8:-1] in inodes
    return count


def test_lane_sockets_of_threads_that_ended_are_closed(sidecar: SidecarProcess) -> None:
    tokens = 2 * CHUNK
    ids, kv = prompt(5, tokens), kv_of(5, tokens)
    failures: list[str] = []

    def load() -> None:
        try:
            with client.load(ids) as hit:
                assert same(hit.kv(), kv)
        except Exception as exc:  # reported below
            failures.append(repr(exc))

    with connect(sidecar.target, stream=False) as client:
        assert client.store(ids, kv) == 2
        load()  # this thread's lane connection, and the channel's, are open
        gc.collect()
        before = unix_sockets()
        for _ in range(30):
            thread = threading.Thread(target=load)
            thread.start()
            thread.join(60)
            assert not thread.is_alive()
        assert failures == []
        gc.collect()
        after = unix_sockets()
        assert after - before <= 3, f"{after - before} more unix sockets after 30 threads"


class SilentLane:
    """A unix socket that speaks the lane's framing: it answers a connection's hello,
    reads the next request (``received`` is set) and never answers it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.listener.settimeout(60)
        self.received = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="silent-lane", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(60)
            try:
                length, method = LANE_HEADER.unpack(read_exactly(conn, LANE_HEADER.size))
                read_exactly(conn, length)
                assert method == 0  # the hello
                conn.sendall(LANE_HEADER.pack(0, 0))  # OK
                length, _ = LANE_HEADER.unpack(read_exactly(conn, LANE_HEADER.size))
                read_exactly(conn, length)
                self.received.set()
            except OSError:
                return
            self._done.wait(60)  # never answer

    def close(self) -> None:
        self._done.set()
        self.listener.close()
        self._thread.join(10)


def waiting_in_poll(thread: threading.Thread) -> bool:
    """Whether ``thread`` sleeps in poll(2) (a blocking socket read with a timeout), as
    the kernel tells (/proc/self/task/TID/wchan); True where it does not tell (the
    test then holds all the same, only without that guarantee)."""
    try:
        with open(f"/proc/self/task/{thread.native_id}/wchan") as wchan:
            where = wchan.read().strip()
    except OSError:
        return True
    return "poll" in where or where in ("", "0")


@pytest.mark.parametrize("when", ["before-reading", "while-reading"])
def test_closing_the_lane_fails_a_call_waiting_on_it_with_unavailable(
    tmp_path: Path, when: str
) -> None:
    """``before-reading``: close() comes between the request and its wait (as a
    pipelined Commit's, while the next batch is copied); ``while-reading``: the
    waiting thread is blocked reading the reply. The lane's timeout (60 s) is far off:
    close() itself must end the wait."""
    server = SilentLane(tmp_path / "lane.sock")
    lane = LaneClient(str(server.path), None, timeout_s=60.0)
    sent, closed = threading.Event(), threading.Event()
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            wait = lane.start("Lookup", pb.LookupRequest(session_id=b"s"))
            sent.set()
            if when == "before-reading":
                closed.wait(30)
            wait()
        except BaseException as exc:  # the test asserts which
            outcome.append(exc)
        else:
            outcome.append(None)

    caller = threading.Thread(target=call, name="lane-caller")
    try:
        caller.start()
        assert sent.wait(30) and server.received.wait(30)
        if when == "while-reading":
            wait_for(lambda: waiting_in_poll(caller), "the caller blocked reading its reply")
        lane.close()
        closed.set()
        caller.join(10)
        assert not caller.is_alive(), "close() did not end the wait for a reply"
    finally:
        closed.set()
        lane.close()
        server.close()
        if caller.ident is not None:
            caller.join(70)
    (error,) = outcome
    assert isinstance(error, LaneError), repr(error)
    assert error.code() == grpc.StatusCode.UNAVAILABLE


# ---- drain --------------------------------------------------------------------------


def seed_redis(url: str, ids: list[int], kv: torch.Tensor) -> None:
    """Store ``kv`` in Redis with an in-process cache of the sidecar clients' model."""
    overrides = {
        **SETTINGS,
        "disk": {"enabled": False},
        "redis": {"url": url},
    }
    with LMTier.open(load_config(env={}, overrides=overrides), kv=SPEC, model_id=MODEL) as cache:
        assert cache.store(ids, kv) == 4
        cache.flush()


def redis_backlog(port: int) -> int:
    """Bytes sent to the Redis server on ``port`` that it has not read (a paused server
    reads none): the receive queues of its connections, from /proc/net/tcp."""
    total = 0
    with open("/proc/net/tcp") as table:
        for line in list(table)[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == "01":  # ESTABLISHED
                total += int(fields[4].split(":")[1], 16)
    return total


@pytest.mark.slow  # a sidecar stopped mid-load
@pytest.mark.parametrize("transport", ["lane", "grpc"])
def test_sigterm_lets_a_load_in_flight_finish_bit_exact(tmp_path: Path, transport: str) -> None:
    ids, kv = prompt(6, N), kv_of(6, N)
    result: dict[str, Any] = {}
    with RedisServer(tmp_path / "redis") as redis:
        seed_redis(redis.url, ids, kv)
        settings = {
            **SETTINGS,
            "redis": {"url": redis.url, "timeout_s": 30.0},
            "sidecar": {**SETTINGS["sidecar"], "drain_timeout_s": 20.0},
        }
        with SidecarProcess(tmp_path / "sidecar", settings) as sidecar:
            if transport == "grpc":  # shared memory still, its calls over gRPC
                lane_path(sidecar.socket).unlink()
            with connect(sidecar.target, stream=False, timeout_s=30.0) as client:
                assert client.lookup(ids).tokens_by_tier(CHUNK) == {"redis": N}

                def load() -> None:
                    try:
                        with client.load(ids) as hit:
                            result["tokens"] = hit.num_tokens
                            result["exact"] = same(hit.kv(), kv)
                    except Exception as exc:  # reported by the assertion below
                        result["error"] = repr(exc)

                loader = threading.Thread(target=load, name="loader")
                redis.pause()
                try:
                    loader.start()
                    wait_for(lambda: redis_backlog(redis.port) > 0, "the load waiting on Redis")
                    sidecar.signal(signal.SIGTERM)
                    wait_for(
                        lambda: serving_problem(sidecar.target, 1.0) is not None,
                        "the sidecar draining",
                    )
                finally:
                    redis.resume()
                    if loader.ident is not None:
                        loader.join(60)
                assert not loader.is_alive()
                assert result == {"tokens": N, "exact": True}
                assert sidecar.wait(60) == 0
        log = sidecar.log()
        assert "lmtier sidecar stopped" in log
        assert "Traceback" not in log, log[-3000:]


# ---- a frozen client ----------------------------------------------------------------

HALF_A_STORE = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[2])
    import grpc
    from support.sidecar_helpers import chunk_for, open_session, pieces
    from lmtier.v1 import sidecar_pb2_grpc as pb_grpc

    stub = pb_grpc.SidecarStub(grpc.insecure_channel(sys.argv[1]))
    session = open_session(stub, shared_memory=False)
    keys = [session.key() for _ in range(16)]
    chunks = [(key, chunk_for(key, seed=i)) for i, key in enumerate(keys)]
    messages = list(pieces(session.id, chunks, piece_bytes=1024))

    def half():
        yield from messages[: len(messages) // 2]
        print("MID", flush=True)
        time.sleep(3600)

    stub.StoreStream(half(), metadata=session.metadata)
    """
)


KEEPALIVE_S = 2.0
"""The frozen-client test's ``sidecar.keepalive_s`` (the default is 10 s): a frozen
client is noticed within about 2 x 2 s, not 20 s; every live connection (the monitor's
here) still has 2 s to answer a ping, seconds to spare on a loaded machine."""


@pytest.fixture
def short_keepalive_sidecar(tmp_path: Path) -> Iterator[SidecarProcess]:
    settings = {**SETTINGS, "sidecar": {**SETTINGS["sidecar"], "keepalive_s": KEEPALIVE_S}}
    yield from running(tmp_path / "sidecar", settings)


@pytest.mark.slow  # a real timer: the keepalive
def test_a_client_frozen_mid_store_stream_loses_its_session_to_the_keepalive(
    short_keepalive_sidecar: SidecarProcess,
) -> None:
    """SIGSTOP: no FIN, no ping answered. The keepalive (a ping every ``keepalive_s``,
    as long to answer: 2 s here) ends its connection; while it was uploading, grpc's
    own flow-control pings were in flight, and their 60 s timeout applied until the
    sidecar set it to ``keepalive_s``."""
    sidecar = short_keepalive_sidecar
    with grpc.insecure_channel(sidecar.target) as channel:
        stub = pb_grpc.SidecarStub(channel)
        with open_session(stub, shared_memory=False, client_name="monitor") as monitor:
            here = str(TESTS)
            child = subprocess.Popen(
                [sys.executable, "-c", HALF_A_STORE, sidecar.target, here],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert child.stdout is not None and child.stdout.readline() == "MID\n"
                assert sidecar_gauges(stub, monitor)["sessions"] == 2
                child.send_signal(signal.SIGSTOP)
                wait_for(
                    lambda: sidecar_gauges(stub, monitor)["sessions"] == 1,
                    # About 2 x KEEPALIVE_S (60 s before the fix); the deadline is a hang
                    # guard.
                    "the frozen client's session ending (keepalive: ~4 s; was 60 s)",
                    timeout_s=45,
                )
            finally:
                child.kill()
                child.communicate()  # reaps it and closes its stdout
