"""LMTierConnector over a sidecar: vLLM's scheduler half and worker halves in different
processes share one real ``lmtier serve`` (``kv_connector_extra_config.sidecar``).

The scheduler half runs in this process inside vLLM's real Scheduler; each worker half
runs in a process of its own (``vllm_worker_process.py``) on real KV tensors, fed the
pickled SchedulerOutputs as vLLM's workers are. Nothing but the sidecar carries chunks
from one process to another.
"""

from __future__ import annotations

import importlib.util
import pickle
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)
pytest.importorskip("grpc")

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    from lmtier.config import Secret
    from lmtier.errors import ConfigError
    from lmtier.remote.client import SidecarStore
    from lmtier.testing.sidecar import SidecarProcess
    from lmtier_connector.vllm.common import (
        ConnectorSettings,
        LMTierConnectorMetadata,
        LMTierKVEvents,
        SidecarSettings,
        chunk_keys,
    )
    from lmtier_connector.vllm.connector import LMTierConnector
    from support import child_env
    from support.vllm_helpers import (
        CHUNK,
        LAYERS,
        PREFIX,
        SchedulerHalf,
        block_hasher,
        expected_tokens,
        kv_cache_config,
        make_request,
        make_vllm_config,
    )

WORKER = ("-m", "support.vllm_worker_process")
TOKEN = "sidecar-test-token"
PROMPT = PREFIX[:200]  # three chunks of 64 tokens, and a tail


def sidecar_settings(disk: Path | None = None) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "cpu": {"capacity_bytes": "64MiB"},
        "sidecar": {"auth_token": TOKEN},
    }
    if disk is not None:
        settings["disk"] = {"enabled": True, "path": str(disk), "fsync": False}
    return settings


def extra_config(target: str, token_file: Path, **more: Any) -> dict[str, Any]:
    """The connector's options: the sidecar, its token, and what keys chunks."""
    return {
        "sidecar": target,
        "sidecar_token_file": str(token_file),
        "config": {"chunk_size": CHUNK},
        **more,
    }


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


class SchedulerSide(SchedulerHalf):
    """vLLM's real Scheduler with our connector over the sidecar, in this process."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config, kv_cache_config(KVCacheLayout.BLHNC))

    def schedule(self) -> tuple[SchedulerOutput, LMTierConnectorMetadata]:
        out = self.scheduler.schedule()
        assert isinstance(out.kv_connector_metadata, LMTierConnectorMetadata)
        return out, out.kv_connector_metadata

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def close(self) -> None:
        self.connector.shutdown()


def run_worker(
    tmp_path: Path,
    name: str,
    model_dir: Path,
    extra: dict[str, Any],
    steps: list[SchedulerOutput],
    *,
    finished: Iterable[str] = (),
    read: tuple[list[int], int] = ([], 0),
    layout: str = "BLHNC",
    flush: bool = False,
) -> dict[str, Any]:
    """Run one worker half in a process of its own (``vllm_worker_process.py``)."""
    job, result = tmp_path / f"{name}.job", tmp_path / f"{name}.result"
    job.write_bytes(
        pickle.dumps(
            {
                "model_dir": str(model_dir),
                "extra": extra,
                "layout": layout,
                "steps": steps,
                "finished": set(finished),
                "read": read,
                "flush": flush,
            }
        )
    )
    done = subprocess.run(
        [sys.executable, *WORKER, str(job), str(result)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, f"worker process {name!r} failed:\n{done.stderr[-6000:]}"
    loaded: dict[str, Any] = pickle.loads(result.read_bytes())
    return loaded


def save_prompt(
    tmp_path: Path, model_dir: Path, extra: dict[str, Any], *, flush: bool = False
) -> tuple[dict[str, Any], list[Any]]:
    """A scheduler here plans the save of PROMPT's chunks; a worker process saves them.
    Returns the worker's result and the KV events the scheduler then publishes."""
    side = SchedulerSide(make_vllm_config(model_dir, extra))
    try:
        request = side.add("a", PROMPT)
        out, meta = side.schedule()
        assert meta.loads == []
        (save,) = meta.saves
        assert (save.refs.first_chunk, save.refs.num_chunks) == (0, 3)
        saved = run_worker(tmp_path, "saver", model_dir, extra, [out], finished={"a"}, flush=flush)
        # What vLLM does with the worker's output: its KV events reach the scheduler.
        events = LMTierKVEvents(saved["events"])
        side.connector.update_connector_output(KVConnectorOutput(kv_cache_events=events))
        published = list(side.connector.take_events())
        assert all(isinstance(e, BlockStored) for e in published)
        assert [h for e in published for h in e.block_hashes] == list(request.block_hashes[:12])
        return saved, published
    finally:
        side.close()


def assert_loaded_bit_exact(loaded: dict[str, Any], num_tokens: int) -> None:
    assert loaded["failed"] == set()
    for layer in range(LAYERS):
        assert torch.equal(loaded["read"][layer], expected_tokens(PROMPT, 0, num_tokens, layer))


@pytest.mark.slow
def test_halves_in_three_processes_share_one_sidecar(
    model_dir: Path, tmp_path: Path, token_file: Path
) -> None:
    with SidecarProcess(tmp_path / "sidecar", sidecar_settings()) as sidecar:
        extra = extra_config(sidecar.target, token_file)
        saved, published = save_prompt(tmp_path, model_dir, extra)
        assert saved["finished"] == {"a"}
        assert saved["failed"] == set()
        # The sidecar's CPU tier evicts in another process: nothing to follow here.
        assert saved["listening"] is False
        assert [e.medium for e in published] == [MEDIUM_CPU] * 3

        # A fresh scheduler (its own client, an empty vLLM prefix cache) finds them.
        side = SchedulerSide(make_vllm_config(model_dir, extra))
        try:
            assert isinstance(side.connector.lmtier.chunk_store, SidecarStore)
            request = side.add("b", [*PROMPT, 5, 6, 7])
            assert side.connector.get_num_new_matched_tokens(request, 0) == (192, False)
            out, meta = side.schedule()
            (load,) = meta.loads
            assert (load.start_token, load.end_token) == (0, 192)
            cache = side.connector.lmtier
            spans = cache.lookup_keys(chunk_keys(cache, load.refs)).spans
            assert [(s.tier, s.start, s.stop) for s in spans] == [("cpu", 0, 3)]
            # A third process loads them into pages laid out otherwise, streaming the
            # chunk bytes over gRPC instead of mapping the shared pool.
            streamed = {**extra, "sidecar_shared_memory": False}
            loaded = run_worker(
                tmp_path,
                "loader",
                model_dir,
                streamed,
                [out],
                read=(side.block_ids("b"), 192),
                layout="LBHNC",
            )
        finally:
            side.close()
        assert_loaded_bit_exact(loaded, 192)


@pytest.mark.slow
def test_a_killed_sidecar_costs_recomputes_and_a_restarted_one_serves_from_disk(
    model_dir: Path, tmp_path: Path, token_file: Path
) -> None:
    settings = sidecar_settings(disk=tmp_path / "disk")
    sidecar = SidecarProcess(tmp_path / "sidecar", settings)
    try:
        sidecar.start()
        extra = extra_config(sidecar.target, token_file)
        save_prompt(tmp_path, model_dir, extra, flush=True)  # flushed: on disk too

        side = SchedulerSide(make_vllm_config(model_dir, extra))
        try:
            side.add("b", [*PROMPT, 5, 6, 7])
            out, meta = side.schedule()  # planned while the sidecar is up
            (load,) = meta.loads
            assert (load.start_token, load.end_token) == (0, 192)
            sidecar.signal(signal.SIGKILL)
            sidecar.wait()
            # The load runs against a dead sidecar: its blocks are recomputed.
            failed = run_worker(tmp_path, "dead", model_dir, extra, [out])
            assert failed["failed"] == set(load.block_ids[:12])
            # Lookups miss meanwhile; nothing raises.
            again = make_request("c", [*PROMPT, 9], side.hasher)
            assert side.connector.get_num_new_matched_tokens(again, 0) == (0, False)
        finally:
            side.close()

        sidecar = SidecarProcess(tmp_path / "sidecar", settings)  # the same disk tier
        sidecar.start()
        # A zero read budget: a hit below the sidecar's host memory loads in the
        # background while vLLM keeps the request waiting.
        side = SchedulerSide(make_vllm_config(model_dir, {**extra, "sync_load_max_ms": 0}))
        try:
            request = side.add("d", [*PROMPT, 9])
            assert side.connector.get_num_new_matched_tokens(request, 0) == (192, True)
            out, meta = side.schedule()
            assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            assert out.num_scheduled_tokens == {}
            (load,) = meta.loads
            assert load.asynchronous
            cache = side.connector.lmtier
            spans = cache.lookup_keys(chunk_keys(cache, load.refs)).spans
            assert [s.tier for s in spans] == ["disk"]
            loaded = run_worker(
                tmp_path, "restarted", model_dir, extra, [out], read=(side.block_ids("d"), 192)
            )
        finally:
            side.close()
        assert loaded["received"] == {"d"}
        assert_loaded_bit_exact(loaded, 192)
    finally:
        sidecar.stop()


# ---- options, and one client per target in a process (no sidecar needed) ----------


def test_sidecar_options_are_checked(tmp_path: Path, token_file: Path) -> None:
    target = "unix:///run/lmtier/sidecar.sock"
    assert ConnectorSettings.from_extra_config({}).sidecar is None
    settings = ConnectorSettings.from_extra_config(
        {"sidecar": target, "sidecar_token_file": str(token_file)}
    )
    assert settings.sidecar == SidecarSettings(target, Secret(TOKEN), shared_memory=True)
    assert TOKEN not in repr(settings)
    streamed = ConnectorSettings.from_extra_config(
        {"sidecar": target, "sidecar_token": TOKEN, "sidecar_shared_memory": False}
    )
    assert streamed.sidecar == SidecarSettings(target, Secret(TOKEN), shared_memory=False)
    quick = ConnectorSettings.from_extra_config({"sidecar": target, "sidecar_timeout_s": 1.5})
    assert quick.sidecar is not None and quick.sidecar.timeout_s == 1.5
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for bad in (
        {"sidecar_token": TOKEN},  # no sidecar
        {"sidecar": ""},
        {"sidecar": target, "sidecar_token": TOKEN, "sidecar_token_file": str(token_file)},
        {"sidecar": target, "sidecar_token_file": str(tmp_path / "missing")},
        {"sidecar": target, "sidecar_token_file": str(empty)},
        {"sidecar": target, "sidecar_shared_memory": "no"},
        {"sidecar": target, "sidecar_timeout_s": 0},
        {"sidecar": target, "sidecar_timeout_s": True},
        {"sidecar": target, "sidecar_timeout_s": "5"},
        {"sidecar": target, "sidecar_timeout_s": float("nan")},
        {"sidecar": target, "sidecar_tokn": TOKEN},
    ):
        with pytest.raises(ConfigError):
            ConnectorSettings.from_extra_config(bad)


def test_one_client_per_sidecar_target_in_a_process(model_dir: Path, tmp_path: Path) -> None:
    layout = kv_cache_config(KVCacheLayout.BLHNC)

    def connector(target: str, role: KVConnectorRole, **more: Any) -> LMTierConnector:
        extra = {"sidecar": target, "config": {"chunk_size": CHUNK}, **more}
        return LMTierConnector(make_vllm_config(model_dir, extra), role, layout)

    # Nothing listens there: the clients start anyway (calls miss until it is up).
    one, other = f"unix://{tmp_path}/one.sock", f"unix://{tmp_path}/other.sock"
    made = [
        connector(one, KVConnectorRole.SCHEDULER),
        connector(one, KVConnectorRole.WORKER),
        connector(other, KVConnectorRole.WORKER, sidecar_timeout_s=2.5),
    ]
    try:
        caches = [c.lmtier for c in made]
        assert all(isinstance(c.chunk_store, SidecarStore) for c in caches)
        assert caches[0] is caches[1]
        assert caches[2] is not caches[0]
        assert [c.chunk_store._timeout_s for c in caches] == [10.0, 10.0, 2.5]  # type: ignore[attr-defined]
        assert made[1]._work()._listening is False
        request = make_request("a", PROMPT, block_hasher())
        assert made[0].get_num_new_matched_tokens(request, 0) == (0, False)
    finally:
        for c in made:
            c.shutdown()
