"""The page interior in the namespace: vLLM's CPU attention backend and its GPU ones
hold different bytes in pages of one shape, so their ``page`` chunks never share a
key; the transcoded layouts are refused on the CPU backend. The interior comes from
vLLM's platform unless ``kv_connector_extra_config.page_interior`` declares it (the
harness declares ``flash``; the tests of the platform path pass ``page_interior=None``
to :func:`make_vllm_config`), and workers check it against their layers' backends."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, get_args

import pytest

pytest.importorskip("vllm")

import torch

from lmtier.api import LMTier
from lmtier.config import load_config
from lmtier.errors import ConfigError
from lmtier.kv_spec import PAGE_INTERIORS, KVSpec

with warnings.catch_warnings():  # vLLM's imports of torch's deprecated parts
    warnings.simplefilter("ignore", DeprecationWarning)
    import vllm.platforms as platforms
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from lmtier_connector.vllm import connector
    from lmtier_connector.vllm.common import ConnectorSettings, PageInterior
    from support.vllm_helpers import (
        CHUNK,
        GEOMETRY,
        Geometry,
        kv_cache_config,
        make_vllm_config,
        write_model_dir,
    )

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

CPU_GEOMETRY = Geometry(block_size=32)  # what vLLM's CPU backend accepts (MultipleOf(32))
SMALL = {
    "chunk_size": CHUNK,
    "cpu": {"capacity_bytes": "1MiB", "staging_bytes": "1MiB"},
    "disk": {"enabled": False},
}
"""The connectors' lmtier config: a small CPU tier (the default 4 GiB is touched at
open) and no disk (the default lies in the home directory)."""


class CudaLike(type(platforms.current_platform)):  # type: ignore[misc]
    """This machine's platform, saying it is CUDA (vLLM's GPU platform)."""

    def is_cpu(self) -> bool:
        return False

    def is_cuda(self) -> bool:
        return True


class Unknown(CudaLike):
    """A platform that is neither vLLM's CPU one nor CUDA."""

    def is_cuda(self) -> bool:
        return False


def page_namespace(spec: KVSpec) -> bytes:
    cache = LMTier(load_config(overrides={"chunk_size": CHUNK}), spec, model_id="m")
    return cache.namespace("").digest


def test_a_cpu_page_and_a_gpu_page_of_one_model_never_share_a_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_vllm_config(
        write_model_dir(tmp_path, geometry=CPU_GEOMETRY),
        {},
        geometry=CPU_GEOMETRY,
        page_interior=None,
    )
    cpu = connector.kv_spec_of(config, "page")
    monkeypatch.setattr(platforms, "_current_platform", CudaLike())
    gpu = connector.kv_spec_of(config, "page")
    # Same model, same page shape and order, same block size: only the interior differs.
    assert (cpu.layout, cpu.block_size) == (gpu.layout, gpu.block_size) == ("LBHSC", 32)
    assert (cpu.page_interior, gpu.page_interior) == ("cpu_attn", "flash")
    assert page_namespace(cpu) != page_namespace(gpu)


def test_the_interior_is_what_the_platform_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_vllm_config(write_model_dir(tmp_path), {}, page_interior=None)
    assert connector.page_interior_of(config) == "cpu_attn"  # vLLM's CPU platform here
    monkeypatch.setattr(platforms, "_current_platform", CudaLike())
    assert connector.page_interior_of(config) == "flash"
    monkeypatch.setattr(platforms, "_current_platform", Unknown())
    with pytest.raises(ConfigError, match="CUDA and CPU") as caught:
        connector.page_interior_of(config)
    assert "page_interior" in str(caught.value)  # names the way out
    assert "\n" not in str(caught.value)


def test_lkthd_is_refused_on_the_cpu_backend(tmp_path: Path) -> None:
    config = make_vllm_config(
        write_model_dir(tmp_path, geometry=CPU_GEOMETRY), {}, geometry=CPU_GEOMETRY
    )
    with pytest.raises(ConfigError, match="chunk_layout to 'page'") as caught:
        connector.kv_spec_of(config, "LKTHD")
    assert "\n" not in str(caught.value)
    # Through the connector too, before any cache is opened.
    extra = {"chunk_layout": "LKTHD", "config": SMALL}
    config = make_vllm_config(
        write_model_dir(tmp_path / "m", geometry=CPU_GEOMETRY),
        extra,
        geometry=CPU_GEOMETRY,
        page_interior=None,
    )
    with pytest.raises(ConfigError, match="'page'"):
        connector.LMTierConnector(config, KVConnectorRole.SCHEDULER, None)  # type: ignore[arg-type]
    # Declared: "cpu_attn" is refused as well, whatever the platform.
    config = make_vllm_config(
        write_model_dir(tmp_path / "d", geometry=CPU_GEOMETRY),
        extra,
        geometry=CPU_GEOMETRY,
        page_interior="cpu_attn",
    )
    with pytest.raises(ConfigError, match="'page'"):
        connector.LMTierConnector(config, KVConnectorRole.SCHEDULER, None)  # type: ignore[arg-type]


def interior_of_scheduler(tmp_path: Path, name: str, page_interior: str | None) -> str:
    """The page interior of the spec a SCHEDULER connector keys its chunks by."""
    config = make_vllm_config(
        write_model_dir(tmp_path / name, geometry=CPU_GEOMETRY),
        {"config": SMALL},
        geometry=CPU_GEOMETRY,
        page_interior=page_interior,
    )
    made = connector.LMTierConnector(config, KVConnectorRole.SCHEDULER, None)  # type: ignore[arg-type]
    try:
        return made.lmtier.kv_spec.page_interior
    finally:
        made.shutdown()


def test_the_setting_overrides_the_platform(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert interior_of_scheduler(tmp_path, "cpu", None) == "cpu_attn"  # vLLM's CPU platform
    assert interior_of_scheduler(tmp_path, "flash", "flash") == "flash"
    monkeypatch.setattr(platforms, "_current_platform", CudaLike())
    assert interior_of_scheduler(tmp_path, "cuda", None) == "flash"
    assert interior_of_scheduler(tmp_path, "cpu_attn", "cpu_attn") == "cpu_attn"
    # A platform the connector cannot identify: refused unless declared.
    monkeypatch.setattr(platforms, "_current_platform", Unknown())
    with pytest.raises(ConfigError, match="CUDA and CPU"):
        interior_of_scheduler(tmp_path, "unknown", None)
    assert interior_of_scheduler(tmp_path, "declared", "flash") == "flash"


@pytest.mark.parametrize("value", ["rocm", "FLASH", "", None, 1, ["flash"]])
def test_a_bad_page_interior_is_refused(tmp_path: Path, value: Any) -> None:
    with pytest.raises(ConfigError, match="page_interior must be one of") as caught:
        ConnectorSettings.from_extra_config({"page_interior": value})
    assert "\n" not in str(caught.value)
    config = make_vllm_config(write_model_dir(tmp_path), {"page_interior": value})
    with pytest.raises(ConfigError, match="page_interior"):
        connector.LMTierConnector(config, KVConnectorRole.SCHEDULER, None)  # type: ignore[arg-type]


def test_the_setting_names_the_interiors_chunks_know() -> None:
    assert set(get_args(PageInterior)) == set(PAGE_INTERIORS)
    assert ConnectorSettings.from_extra_config({}).page_interior is None
    for interior in PAGE_INTERIORS:
        settings = ConnectorSettings.from_extra_config({"page_interior": interior})
        assert settings.page_interior == interior


class _Backend:
    """An attention backend class as vLLM's layers hold it (``get_name()``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def get_name(self) -> str:
        return self.name


class _Layer:
    def __init__(self, backend: str) -> None:
        self.attn_backend = _Backend(backend)


@pytest.mark.parametrize(
    ("declared", "backend", "refused"),
    [
        ("flash", "CPU_ATTN", True),  # a harness's declaration on vLLM's CPU backend
        ("cpu_attn", "FLASH_ATTN", True),  # and the other way round
        ("flash", "ROCM_ATTN", True),  # a backend whose pages the connector does not know
        ("cpu_attn", "CPU_ATTN", False),
        ("flash", "FLASH_ATTN", False),
    ],
)
def test_a_worker_checks_the_declared_interior_against_its_layers(
    tmp_path: Path, declared: str, backend: str, refused: bool
) -> None:
    layout = kv_cache_config(KVCacheLayout.BLHNC, geometry=CPU_GEOMETRY)
    config = make_vllm_config(
        write_model_dir(tmp_path, geometry=CPU_GEOMETRY),
        {"config": SMALL},
        geometry=CPU_GEOMETRY,
        page_interior=declared,
    )
    context = config.compilation_config.static_forward_context
    for name in CPU_GEOMETRY.names:
        context[name] = _Layer(backend)
    worker = connector.LMTierConnector(config, KVConnectorRole.WORKER, layout)
    try:
        kv = allocate_kv_cache(layout, torch.device("cpu"), KVCacheLayout.BLHNC)
        if refused:
            with pytest.raises(ConfigError, match=backend) as caught:
                worker.register_kv_caches(kv)
            assert repr(declared) in str(caught.value)
            assert "page_interior" in str(caught.value)
            assert "\n" not in str(caught.value)
        else:
            worker.register_kv_caches(kv)
    finally:
        worker.shutdown()


def test_the_worker_checks_its_layers_backends() -> None:
    connector.check_page_interior("cpu_attn", ["CPU_ATTN"])
    connector.check_page_interior("flash", ["FLASH_ATTN", "TRITON_ATTN"])
    with pytest.raises(ConfigError, match="CPU_ATTN"):
        connector.check_page_interior("flash", ["CPU_ATTN"])
    with pytest.raises(ConfigError, match="ROCM_ATTN"):
        connector.check_page_interior("flash", ["ROCM_ATTN"])


def test_the_spec_and_namespace_take_the_interior_with_paged_layouts_only() -> None:
    paged = KVSpec(2, 2, 16, layout="LBHSC", block_size=32, page_interior="cpu_attn")
    assert paged.page_interior == "cpu_attn"
    with pytest.raises(ValueError, match="paged layouts"):
        KVSpec(2, 2, 16, page_interior="flash")
    with pytest.raises(ValueError, match="page_interior must be one of"):
        KVSpec(2, 2, 16, layout="LBHSC", block_size=32, page_interior="rocm")
    # Unspecified (an older client, a spec made by hand) keeps its earlier namespace.
    unspecified = KVSpec(2, 2, 16, layout="LBHSC", block_size=32)
    assert page_namespace(unspecified) not in {
        page_namespace(paged),
        page_namespace(KVSpec(2, 2, 16, layout="LBHSC", block_size=32, page_interior="flash")),
    }
    assert GEOMETRY.block_size == 16  # the harness's GPU engine
