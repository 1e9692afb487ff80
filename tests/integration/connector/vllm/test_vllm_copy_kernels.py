"""``kv_connector_extra_config.copy_kernels``: the setting that turns the fused CUDA copy
kernels on (required), off, or leaves the choice to the machine; a worker without a
GPU copies with torch's ops, and one told ``on`` refuses its pages saying why."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from lmtier.api import LMTier
from lmtier.config import load_config
from lmtier.errors import ConfigError
from lmtier.kv_spec import KVSpec

with warnings.catch_warnings():  # vLLM's imports of torch's deprecated parts
    warnings.simplefilter("ignore", DeprecationWarning)
    from lmtier_connector.vllm.common import ConnectorSettings
    from lmtier_connector.vllm.worker import WorkerHalf

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

SMALL = {"chunk_size": 32, "cpu": {"capacity_bytes": "1MiB", "staging_bytes": "1MiB"}}


@pytest.mark.parametrize(("value", "kernels"), [("auto", None), ("on", True), ("off", False)])
def test_the_setting_says_what_the_engine_gets(value: str, kernels: bool | None) -> None:
    assert ConnectorSettings.from_extra_config({"copy_kernels": value}).kernels is kernels
    assert ConnectorSettings.from_extra_config({}).copy_kernels == "auto"


@pytest.mark.parametrize("value", ["yes", True, 1, None])
def test_a_bad_value_is_a_config_error_naming_the_choices(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"copy_kernels must be one of \['auto', 'on', 'off'\]"):
        ConnectorSettings.from_extra_config({"copy_kernels": value})


@pytest.mark.parametrize("kernels", [None, False, True])
def test_a_worker_without_a_gpu_copies_with_torch_or_refuses(kernels: bool | None) -> None:
    spec = KVSpec(2, 2, 8, "float32", "LKTHD")
    config = load_config(overrides={**SMALL, "disk": {"enabled": False}})
    cache = LMTier.open(config, kv=spec, model_id="m")
    worker = WorkerHalf(cache, 16, kernels=kernels)
    layers = {f"layer.{i}": torch.zeros(2, 8, 16, 2, 8) for i in range(2)}
    try:
        if kernels:
            with pytest.raises(RuntimeError, match="asked for, but the pages are on cpu"):
                worker.register_kv_caches(layers)
        else:
            worker.register_kv_caches(layers)
            assert worker.engine is not None and not worker.engine.kernels
    finally:
        worker.shutdown()
        cache.close()
