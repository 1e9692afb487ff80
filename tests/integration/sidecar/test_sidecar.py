"""The sidecar as users run it: a real ``lmtier serve`` process and real client
processes (``sidecar_client.py``), sharing one node's cache through shared memory or
gRPC streams; slabs that come back when clients die; a sidecar killed, restarted
and drained.

Tests that neither stop, signal nor reconfigure their sidecar, nor read its gauges as
a fresh one's, share one per module (``sidecar``, per xdist worker) and each works in
a model of its own (``model``): what another test stored, in any order, is not
theirs. The rest get a sidecar of their own (``own_sidecar``) or start one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import lmtier.remote.client as client_module
from lmtier import LMTier
from lmtier.chunks.keys import ChunkKey
from lmtier.errors import HandleError
from lmtier.remote.streaming import MessageSlab, ReceivedSlab
from lmtier.storage.host_pool import SlabHandle
from lmtier.testing.sidecar import SidecarProcess
from support import child_env
from support.sidecar_client import MODEL, connect, digest, gauges, kv_of, prompt

pytestmark = pytest.mark.integration

CLIENT = ("-m", "support.sidecar_client")
"""The raw client, a process of its own (``python -m``, with :func:`support.child_env`)."""
SETTINGS: dict[str, Any] = {
    "cpu": {"capacity_bytes": "32MiB", "staging_bytes": "8MiB"},
    "sidecar": {"slab_bytes": "520KiB"},
}
ROOMY: dict[str, Any] = {**SETTINGS, "cpu": {"capacity_bytes": "96MiB", "staging_bytes": "64MiB"}}
"""The shared sidecar's: room for the longest prompt of a test (100 chunks) beside
what the tests before it stored."""
TOKENS = 256 * 6 + 100  # six full chunks and a tail


def run_client(target: str, *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, *CLIENT, target, *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def eventually(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Wait for ``condition`` (a state the system converges to, not a race)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    """The module's sidecar (module docstring): not to be stopped, signalled or read
    as a fresh one."""
    with SidecarProcess(tmp_path_factory.mktemp("shared"), ROOMY) as process:
        yield process


@pytest.fixture
def model() -> str:
    """A model id of this test's own: its chunks in the shared sidecar are its own."""
    return f"{MODEL}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def observer(sidecar: SidecarProcess, model: str) -> Iterator[LMTier]:
    with connect(sidecar.target, stream=False, model_id=model) as cache:
        yield cache


@pytest.fixture
def own_sidecar(tmp_path: Path) -> Iterator[SidecarProcess]:
    """A sidecar of this test's own: it stops or signals it, or reads its gauges."""
    with SidecarProcess(tmp_path / "sidecar", SETTINGS) as process:
        yield process


@pytest.fixture
def own_observer(own_sidecar: SidecarProcess) -> Iterator[LMTier]:
    with connect(own_sidecar.target, stream=False) as cache:
        yield cache


class InPlace(NamedTuple):
    enabled: bool
    sent: list[int]  # chunks sent as the message they were written into


@pytest.fixture(params=[False, True], ids=["copied", "in-place"])
def in_place(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[InPlace]:
    """Streaming stores either way: chunks copied out of private slabs into their
    messages (glibc's defaults), or written into the messages themselves (a process
    that keeps freed memory, as the sidecar's benchmarks and ``lmtier serve`` do)."""
    state = InPlace(request.param, [])
    real = MessageSlab.message

    def counting(slab: MessageSlab, *args: Any) -> bytes | None:
        message = real(slab, *args)
        state.sent.append(message is not None)
        return message

    monkeypatch.setattr(client_module, "reuses_freed_memory", lambda: request.param)
    monkeypatch.setattr(MessageSlab, "message", counting)
    yield state
    assert any(state.sent) == request.param  # the path asked for was the one taken


@pytest.mark.slow  # a topology: client processes beside the sidecar
def test_two_client_processes_share_cpu_hits_bit_exact(
    sidecar: SidecarProcess, observer: LMTier, model: str
) -> None:
    stored = run_client(sidecar.target, "store", "1", str(TOKENS), "--model", model)
    assert stored == {"stored": 6}
    expected = digest(kv_of(1, TOKENS)[:, :, : 6 * 256])
    for mode in ([], ["--stream"]):
        loaded = run_client(sidecar.target, "load", "1", str(TOKENS), "--model", model, *mode)
        assert loaded == {"tokens": 6 * 256, "tiers": {"cpu": 6 * 256}, "sha": expected}
    # A second store from another process finds the chunks cached: nothing new.
    again = run_client(sidecar.target, "store", "1", str(TOKENS), "--stream", "--model", model)
    assert again == {"stored": 0}


def test_streaming_store_is_loaded_through_shared_memory(
    sidecar: SidecarProcess, observer: LMTier, model: str
) -> None:
    stored = run_client(sidecar.target, "store", "2", str(TOKENS), "--stream", "--model", model)
    assert stored == {"stored": 6}
    with observer.load(prompt(2, TOKENS)) as hit:
        assert hit.num_tokens == 6 * 256
        assert torch.equal(hit.kv(), kv_of(2, TOKENS)[:, :, : 6 * 256])


@pytest.mark.parametrize("piece", ["4MiB", "64KiB"], ids=["whole", "in-pieces"])
def test_a_streamed_load_reads_a_whole_chunk_in_the_message_it_came_in(
    tmp_path: Path, piece: str
) -> None:
    # A chunk that comes in one message is read there (its copy into a slab spared);
    # one cut into pieces is put together in a slab. Either way every slab of the
    # private pool comes back once the load is released.
    settings = {**SETTINGS, "sidecar": {**SETTINGS["sidecar"], "stream_piece_bytes": piece}}
    ids, kv = prompt(14, TOKENS), kv_of(14, TOKENS)
    with (
        SidecarProcess(tmp_path / "sidecar", settings) as sidecar,
        connect(sidecar.target, stream=True) as client,
    ):
        assert client.store(ids, kv) == 6
        in_place = piece == "4MiB" and not torch.cuda.is_available()  # a pinned pool copies
        with client.load(ids) as hit:
            kinds = {type(chunk.handle) for chunk in hit.chunks}
            assert kinds == ({ReceivedSlab} if in_place else {SlabHandle})
            assert torch.equal(hit.kv(), kv[:, :, : 6 * 256])
            assert torch.equal(torch.cat(hit.tensors(), dim=2), kv[:, :, : 6 * 256])
            assert client.host_memory().slabs_in_use == 6
        assert client.host_memory().slabs_in_use == 0


def test_a_streaming_store_bigger_than_its_private_pool_waits_for_slabs(
    sidecar: SidecarProcess, observer: LMTier, model: str, in_place: InPlace
) -> None:
    # One private slab: each chunk's StoreStream must end (and give it back) before
    # the next chunk is copied; nothing is dropped.
    with connect(sidecar.target, stream=True, staging_bytes=1, model_id=model) as client:
        assert client.host_memory().slabs == 0  # made on first use
        assert client.store(prompt(12, TOKENS), kv_of(12, TOKENS)) == 6
        assert client.host_memory().slabs == 1
        assert client.host_memory().slabs_in_use == 0
    with observer.load(prompt(12, TOKENS)) as hit:
        assert hit.num_tokens == 6 * 256
        assert torch.equal(hit.kv(), kv_of(12, TOKENS)[:, :, : 6 * 256])


def test_threads_of_one_streaming_client_store_and_load_bit_exact(
    sidecar: SidecarProcess, model: str, in_place: InPlace
) -> None:
    # Four threads share one client, its private pool and its store calls in flight
    # (eight prompts, 48 chunks: within the sidecar's CPU tier, so none is evicted
    # before it is loaded: older chunks, other tests' too, go first).
    failures: list[str] = []

    def work(thread: int) -> None:
        try:
            for seed in range(20 + 10 * thread, 22 + 10 * thread):
                assert client.store(prompt(seed, TOKENS), kv_of(seed, TOKENS)) == 6
                with client.load(prompt(seed, TOKENS)) as hit:
                    assert hit.num_tokens == 6 * 256
                    assert torch.equal(hit.kv(), kv_of(seed, TOKENS)[:, :, : 6 * 256])
        except Exception as exc:  # reported below, with the thread
            failures.append(f"thread {thread}: {exc!r}")

    with connect(sidecar.target, stream=True, model_id=model) as client:
        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads)
        assert failures == []
        assert client.host_memory().slabs_in_use == 0


def test_a_streaming_store_to_a_stopped_sidecar_misses_and_gives_its_slabs_back(
    own_sidecar: SidecarProcess, own_observer: LMTier, in_place: InPlace
) -> None:
    sidecar, observer = own_sidecar, own_observer
    ids, kv = prompt(13, TOKENS), kv_of(13, TOKENS)
    client = connect(sidecar.target, stream=True, timeout_s=1.0, staging_bytes=4 << 20)
    streams = client.chunk_store._sending  # type: ignore[attr-defined]
    start = streams.start

    def start_stopped(*args: Any) -> Any:
        sidecar.signal(signal.SIGSTOP)  # after the lookup, before the chunks travel
        return start(*args)

    try:
        streams.start = start_stopped
        assert client.store(ids, kv) == 0  # deadlines passed: a miss, nothing raised
        assert client.host_memory().slabs_in_use == 0
        streams.start = start
        sidecar.signal(signal.SIGCONT)
        # The stopped call's whole chunks may land once the sidecar runs again (each is
        # stored as it arrives, the call's deadline notwithstanding): then a store of
        # the same prompt finds them cached and stores nothing.
        eventually(
            lambda: client.store(ids, kv) == 6 or client.lookup(ids).num_tokens == 6 * 256,
            "the prompt stored once the sidecar runs again",
        )
        fresh, fresh_kv = prompt(14, TOKENS), kv_of(14, TOKENS)  # never sent before
        stored: list[int] = []

        def stores_again() -> bool:
            stored.append(client.store(fresh, fresh_kv))
            return client.lookup(fresh).num_tokens == 6 * 256

        eventually(stores_again, "this client storing a new prompt")
        assert sum(stored) > 0, stored  # this client's own stores, not the stopped call's
        assert client.host_memory().slabs_in_use == 0
    finally:
        sidecar.signal(signal.SIGCONT)
        client.close()
    for seed, tokens in ((13, ids), (14, prompt(14, TOKENS))):
        with observer.load(tokens) as hit:
            assert torch.equal(hit.kv(), kv_of(seed, TOKENS)[:, :, : 6 * 256])


def test_tenants_do_not_see_each_other(
    sidecar: SidecarProcess, observer: LMTier, model: str
) -> None:
    stored = run_client(sidecar.target, "store", "3", str(TOKENS), "--salt", "a", "--model", model)
    assert stored == {"stored": 6}
    ids = prompt(3, TOKENS)
    assert observer.lookup(ids, cache_salt="a").num_tokens == 6 * 256
    assert observer.lookup(ids, cache_salt="b").num_tokens == 0
    assert observer.lookup(ids).num_tokens == 0


@pytest.mark.slow  # a topology: a client process killed
def test_sigkill_of_a_client_holding_leases_returns_every_slab(
    own_sidecar: SidecarProcess, own_observer: LMTier
) -> None:
    """Reads the sidecar's gauges (leases, sessions): its own sidecar."""
    sidecar, observer = own_sidecar, own_observer
    assert run_client(sidecar.target, "store", "4", str(TOKENS)) == {"stored": 6}
    before = gauges(observer)
    holder = subprocess.Popen(
        [sys.executable, *CLIENT, sidecar.target, "hold", "4", str(TOKENS)],
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert json.loads(holder.stdout.readline()) == {"tokens": 6 * 256, "acquired": 2}
        held = gauges(observer)
        assert held["leases"] == 8 and held["slabs_in_use"] == before["slabs_in_use"] + 2
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    eventually(lambda: gauges(observer)["leases"] == 0, "the dead client's leases end")
    after = gauges(observer)
    assert after["slabs_in_use"] == before["slabs_in_use"]
    assert after["sessions"] == before["sessions"]


@pytest.mark.slow  # a real timer: the lease's ttl
def test_a_lease_past_its_deadline_is_reclaimed_and_unusable(tmp_path: Path) -> None:
    settings = {**SETTINGS, "sidecar": {**SETTINGS["sidecar"], "lease_ttl_s": 1.0}}
    with SidecarProcess(tmp_path / "sidecar", settings) as sidecar:
        assert run_client(sidecar.target, "store", "5", str(TOKENS)) == {"stored": 6}
        cache = connect(sidecar.target, stream=False)
        try:
            hit = cache.load(prompt(5, TOKENS))
            assert hit.num_tokens == 6 * 256
            watcher = connect(sidecar.target, stream=False)
            eventually(lambda: gauges(watcher)["leases_expired"] >= 6, "the reaper runs")
            watcher.close()
            with pytest.raises(HandleError, match="lease expired"):
                hit.kv()
            hit.release()
            # The client reopens a session and carries on.
            with cache.load(prompt(5, TOKENS)) as again:
                assert torch.equal(again.kv(), kv_of(5, TOKENS)[:, :, : 6 * 256])
        finally:
            cache.close()


@pytest.mark.parametrize("stream", [False, True], ids=["shm", "stream"])
def test_a_hung_sidecar_is_probed_in_the_background_not_by_callers(
    own_sidecar: SidecarProcess, stream: bool
) -> None:
    sidecar = own_sidecar
    ids, kv = prompt(15, TOKENS), kv_of(15, TOKENS)
    client = connect(sidecar.target, stream=stream, timeout_s=1.0)
    connection = client.chunk_store._connection  # type: ignore[attr-defined]
    breaker = connection._breaker
    opened_by: list[str] = []
    open_session = connection._open

    def recorded_open(*args: Any, **kwargs: Any) -> Any:
        opened_by.append(threading.current_thread().name)
        return open_session(*args, **kwargs)

    try:
        assert client.store(ids, kv) == 6
        connection._open = recorded_open
        sidecar.signal(signal.SIGSTOP)
        assert client.lookup(ids).num_tokens == 0  # this call waits out its timeout
        opens = breaker.opens
        assert opens >= 1

        def probed_twice() -> bool:  # callers keep calling; each probe fails meanwhile
            assert client.lookup(ids).num_tokens == 0
            return breaker.opens >= opens + 2

        eventually(probed_twice, "two failed reconnect probes")
        assert opened_by and set(opened_by) == {"lmtier-sidecar-probe"}, opened_by
        sidecar.signal(signal.SIGCONT)
        eventually(lambda: client.lookup(ids).num_tokens == 6 * 256, "a reconnect")
        assert "MainThread" not in opened_by
    finally:
        sidecar.signal(signal.SIGCONT)
        client.close()


@pytest.mark.slow  # a restart of the sidecar
def test_sidecar_killed_mid_load_costs_a_miss_and_a_restart_serves_disk(
    tmp_path: Path,
) -> None:
    settings = {**SETTINGS, "disk": {"path": str(tmp_path / "disk"), "capacity_bytes": "1GiB"}}
    first = SidecarProcess(tmp_path / "one", settings).start()
    cache = connect(first.target, stream=False, timeout_s=5.0)
    ids = prompt(6, TOKENS)
    try:
        assert cache.store(ids, kv_of(6, TOKENS)) == 6
        cache.flush()  # on disk before the kill
        first.signal(signal.SIGSTOP)  # a load is now stuck in the sidecar...
        result: dict[str, Any] = {}

        def load() -> None:
            with cache.load(ids) as hit:
                result["tokens"] = hit.num_tokens

        loader = threading.Thread(target=load)
        loader.start()
        first.signal(signal.SIGKILL)  # ...and the sidecar dies under it
        first.wait()
        loader.join(30)
        assert result == {"tokens": 0}  # the engine recomputes; nothing raised
        assert cache.lookup(ids).num_tokens == 0
        assert cache.store(ids, kv_of(6, TOKENS)) == 0
        second = SidecarProcess(tmp_path / "two", settings, listen=first.target).start()
        try:
            eventually(lambda: cache.lookup(ids).num_tokens == 6 * 256, "a reconnect")
            with cache.load(ids) as hit:
                assert hit.tokens_by_tier() == {"disk": 6 * 256}
                assert torch.equal(hit.kv(), kv_of(6, TOKENS)[:, :, : 6 * 256])
        finally:
            second.stop()
    finally:
        cache.close()
        first.stop()


@pytest.mark.slow  # a sidecar stopped and drained
def test_sigterm_drains_writes_and_exits_zero(tmp_path: Path) -> None:
    settings = {**SETTINGS, "disk": {"path": str(tmp_path / "disk"), "capacity_bytes": "1GiB"}}
    sidecar = SidecarProcess(tmp_path / "one", settings).start()
    cache = connect(sidecar.target, stream=False)
    ids = prompt(7, TOKENS)
    try:
        assert cache.store(ids, kv_of(7, TOKENS)) == 6  # queued for disk, not flushed
        sidecar.signal(signal.SIGTERM)
        assert sidecar.wait() == 0
        assert "lmtier sidecar stopped" in sidecar.log()
        assert not Path(sidecar.socket).exists()
        assert cache.lookup(ids).num_tokens == 0  # a miss, not an error
    finally:
        cache.close()
    with SidecarProcess(tmp_path / "two", settings) as again:
        fresh = connect(again.target, stream=False)
        try:
            assert fresh.lookup(ids).tokens_by_tier(256) == {"disk": 6 * 256}
        finally:
            fresh.close()


def test_socket_and_pool_are_owner_only(own_sidecar: SidecarProcess, own_observer: LMTier) -> None:
    sidecar = own_sidecar  # stopped below
    assert os.stat(sidecar.socket).st_mode & 0o777 == 0o600
    assert os.stat(sidecar.socket.parent).st_mode & 0o777 == 0o700
    pools = [p for p in Path("/dev/shm").glob(f"lmtier-{sidecar.pid}-*.pool")]
    assert len(pools) == 1 and pools[0].stat().st_mode & 0o777 == 0o600
    sidecar.stop()
    assert not pools[0].exists()


def test_purge_empties_one_tenant_and_keeps_the_other(observer: LMTier) -> None:
    ids = prompt(8, TOKENS)
    assert observer.store(ids, kv_of(8, TOKENS), cache_salt="a") == 6
    assert observer.store(ids, kv_of(8, TOKENS), cache_salt="b") == 6
    assert observer.purge("a") == {"cpu": 6}
    assert observer.lookup(ids, cache_salt="a").num_tokens == 0
    assert observer.lookup(ids, cache_salt="b").num_tokens == 6 * 256


def test_the_sidecar_hashes_token_ids_as_clients_do(observer: LMTier) -> None:
    from lmtier.remote.client import SidecarStore
    from lmtier.v1 import sidecar_pb2 as pb

    store = observer.chunk_store
    assert isinstance(store, SidecarStore)
    ids = prompt(9, TOKENS)
    connection = store._conn()
    session = connection.session(observer.namespace())
    request = pb.LookupRequest(session_id=session.id, tokens=pb.TokenIds(ids=ids))
    assert connection.stub.Lookup(request).keys == b"".join(observer.keys(ids))


def test_a_long_load_is_pipelined_and_stops_at_the_first_miss(
    sidecar: SidecarProcess, model: str
) -> None:
    with connect(sidecar.target, stream=False, model_id=model) as cache:
        tokens = 100 * 256
        ids, kv = prompt(12, tokens), kv_of(12, tokens)
        assert cache.store(ids, kv) == 100
        keys = cache.keys(ids)
        with cache.load_keys(keys) as hit:  # 4 Loads of 32, 32, 32 and 4 chunks
            assert hit.num_tokens == tokens
            assert torch.equal(hit.kv(), kv)
        holed = [*keys[:40], ChunkKey(keys[0][:16] + os.urandom(16)), *keys[41:]]
        with cache.load_keys(holed) as hit:  # chunks after the hole are given back
            assert hit.num_tokens == 40 * 256
            assert torch.equal(hit.kv(), kv[:, :, : 40 * 256])
        eventually(lambda: gauges(cache)["leases"] == 0, "every lease ended")


def test_a_store_asks_for_slabs_ahead_and_frees_none_for_chunks_the_sidecar_holds(
    observer: LMTier,
) -> None:
    """A shared-memory store asks for its first batch's slabs and the rest's at once;
    re-storing a cached prompt into a full pool must still evict nothing. (The
    sidecar is shared: its eviction count is compared with itself, before and after.)"""
    slabs = int(gauges(observer)["slabs_total"])
    before = observer.stats()["cpu"]["evictions"]
    filler = kv_of(40, 8 * 256)  # any bytes: what counts is how many chunks
    for seed in range(40, 40 + slabs // 8 + 1):  # more chunks than the pool holds
        observer.store(prompt(seed, 8 * 256), filler)
    assert observer.stats()["cpu"]["evictions"] > before  # full: any new slab evicts
    chunks = 20  # more than one store batch (8)
    ids, kv = prompt(21, chunks * 256), kv_of(21, chunks * 256)
    assert observer.store(ids, kv) == chunks
    with observer.load(ids) as hit:
        assert torch.equal(hit.kv(), kv)
    evictions = observer.stats()["cpu"]["evictions"]
    assert observer.store(ids, kv) == 0  # every chunk is held: no slab is asked for
    assert observer.stats()["cpu"]["evictions"] == evictions
    assert observer.lookup(ids).num_tokens == chunks * 256
    eventually(lambda: gauges(observer)["leases"] == 0, "every lease ended")


@pytest.mark.parametrize("stream", [False, True])
def test_store_keys_with_skip_stores_only_the_chunks_after_it(
    sidecar: SidecarProcess, model: str, stream: bool
) -> None:
    cache = connect(sidecar.target, stream=stream, model_id=model)
    try:
        seed = 30 + stream
        ids, kv = prompt(seed, 10 * 256), kv_of(seed, 10 * 256)
        keys = cache.keys(ids)
        assert cache.store_keys(keys, kv, skip=3) == 7
        assert cache.lookup_keys(keys).num_chunks == 0  # the first three were not stored
        with cache.load_keys(keys[3:]) as hit:
            assert hit.num_tokens == 7 * 256
            assert torch.equal(hit.kv(), kv[:, :, 3 * 256 :])
        eventually(lambda: gauges(cache)["leases"] == 0, "every lease ended")
    finally:
        cache.close()


def test_a_streaming_store_longer_than_one_call_is_stored_whole(
    sidecar: SidecarProcess, model: str, in_place: InPlace
) -> None:
    """A store's chunks travel in one StoreStream fed as they are copied, and in a
    new one past a private pool's worth of chunks: every chunk arrives, in order."""
    with (
        connect(sidecar.target, stream=True, staging_bytes=8 << 20, model_id=model) as client,
        connect(sidecar.target, stream=False, model_id=model) as reader,
    ):
        chunks = 70
        ids, kv = prompt(50, chunks * 256), kv_of(50, chunks * 256)
        assert client.store(ids, kv) == chunks  # in 5 calls, through a pool of 15 slabs
        assert sum(in_place.sent) == (chunks if in_place.enabled else 0)
        assert client.host_memory().slabs == 15
        assert client.host_memory().slabs_in_use == 0
        with reader.load(ids) as hit:
            assert hit.num_tokens == chunks * 256
            assert torch.equal(hit.kv(), kv)
