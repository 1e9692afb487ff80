"""Under vLLM's real Scheduler, ``async_loads: auto`` loads a hit inside the step when
its expected read is short (a small disk hit: it is then computed in the step that
schedules it, as a prefix-cache hit is) and in the background when it is long, by
the rates the workers measured and vLLM carried back (``update_connector_output``)."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.v1.outputs import KVConnectorOutput

    from lmtier_connector.vllm.stats import LMTierConnectorStats
    from support.vllm_helpers import (
        PREFIX,
        Engine,
        block_tokens,
        drain_finished,
        expected_tokens,
        finish,
        lmtier_overrides,
        make_vllm_config,
    )

PROMPT = PREFIX[:200]  # three 64-token chunks and 8 tokens


def test_a_short_disk_read_loads_in_the_step_and_a_slow_disk_in_the_background(
    model_dir: Path, tmp_path: Path, engines: list[Engine]
) -> None:
    writer = Engine(make_vllm_config(model_dir, {"config": lmtier_overrides(tmp_path)}))
    engines.append(writer)
    writer.add("w", PROMPT)
    writer.run_step()
    finish(writer, "w")
    assert drain_finished(writer, {"w"}) == {"w"}
    writer.connector.lmtier.flush()

    # A fresh engine over the same disk (no CPU tier): 3 chunks of 24 KiB from disk.
    config = lmtier_overrides(tmp_path, cpu={"enabled": False})
    reader = Engine(make_vllm_config(model_dir, {"config": config}))
    engines.append(reader)
    request = reader.add("r", [*PROMPT, 1])
    assert reader.connector.get_num_new_matched_tokens(request, 0) == (192, False)
    out, meta = reader.run_step()
    assert out.has_sync_kv_loads and not meta.loads[0].asynchronous
    assert out.num_scheduled_tokens == {"r": 9}  # computed in the step that loaded it
    ids = reader.scheduler.kv_cache_manager.get_block_ids("r")[0]
    for layer in range(2):
        got = block_tokens(reader.kv, ids, 0, 192, layer)
        assert got.equal(expected_tokens(PROMPT, 0, 192, layer))
    # The worker measured that read; the scheduler learnt the disk's rate from it.
    assert "disk" in reader.connector._sched().load_paths.rates

    # The workers now report, step after step, a disk reading 1 MiB/s (busy, or a
    # network disk): the same hit goes to the background.
    for _ in range(20):
        slow = LMTierConnectorStats({"read_bytes|disk": 2**20, "read_seconds|disk": 1.0})
        reader.connector.update_connector_output(KVConnectorOutput(kv_connector_stats=slow))
    again = reader.add("again", [*PROMPT, 2])
    assert reader.connector.get_num_new_matched_tokens(again, 0) == (192, True)
