"""One vLLM worker process for ``test_vllm_sidecar.py``: a WORKER connector on real KV
tensors (vLLM's ``allocate_kv_cache``), driven by the SchedulerOutputs a scheduler in
another process made, as vLLM's workers are.

    python -m support.vllm_worker_process JOB RESULT   (tests/ on PYTHONPATH)

``JOB`` (a pickle): ``model_dir``, ``extra`` (``kv_connector_extra_config``),
``layout`` (a KVCacheLayout name), ``steps`` (SchedulerOutputs, run in order around
the fake forward pass of :func:`vllm_helpers.fake_forward`), ``finished`` (request
ids the scheduler finished: the process waits until their saves are through),
``read`` (``(block_ids, num_tokens)``: KV to send back) and ``flush``.
``RESULT`` (a pickle): ``failed`` (block ids of loads that failed), ``finished``,
``received`` (requests whose asynchronous loads completed),
``events`` (the KV events of the steps), ``listening`` (whether the worker follows a
CPU tier's evictions) and ``read`` (one ``[tokens, heads, 2 * head_dim]`` tensor per
layer). Any exception fails the process, and so the test.
"""

from __future__ import annotations

import pickle
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from lmtier_connector.vllm.connector import LMTierConnector
    from support.vllm_helpers import (
        LAYERS,
        block_tokens,
        kv_cache_config,
        make_vllm_config,
        worker_step,
    )


def run(job: dict[str, Any]) -> dict[str, Any]:
    layout = KVCacheLayout[job["layout"]]
    config = kv_cache_config(layout)
    vllm_config = make_vllm_config(Path(job["model_dir"]), job["extra"])
    worker = LMTierConnector(vllm_config, KVConnectorRole.WORKER, config)
    try:
        kv = allocate_kv_cache(config, torch.device("cpu"), layout)
        worker.register_kv_caches(kv)
        failed: set[int] = set()
        events: list[Any] = []
        for out in job["steps"]:
            worker_step(worker, kv, out)
            failed |= worker.get_block_ids_with_load_errors()
        # The save thread runs one step's saves after another: once this no-op has
        # run, every save queued above is through. Asynchronous loads likewise.
        worker._work()._writer.submit(lambda: None).result()
        worker._work().loader.wait()
        failed |= worker.get_block_ids_with_load_errors()
        finished, received = worker.get_finished(set(job["finished"]))
        step_events = worker.get_kv_connector_kv_cache_events()
        if step_events is not None:
            events = step_events.get_all_events()
        if job["flush"]:
            worker.lmtier.flush()
        block_ids, num_tokens = job["read"]
        layers = range(LAYERS) if num_tokens else range(0)
        read = [block_tokens(kv, block_ids, 0, num_tokens, layer) for layer in layers]
        return {
            "failed": failed,
            "finished": finished or set(),
            "received": received or set(),
            "events": events,
            "listening": worker._work()._listening,
            "read": read,
        }
    finally:
        worker.shutdown()


def main(argv: list[str]) -> int:
    job = pickle.loads(Path(argv[1]).read_bytes())
    Path(argv[2]).write_bytes(pickle.dumps(run(job)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
