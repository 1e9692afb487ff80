"""The page interior in the namespace: vLLM's CPU attention backend and its GPU ones
hold different bytes in pages of one shape, so their ``page`` chunks never share a
key; the transcoded layouts are refused on the CPU backend."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from lmtier.api import LMTier
from lmtier.config import load_config
from lmtier.errors import ConfigError
from lmtier.kv_spec import KVSpec

with warnings.catch_warnings():  # vLLM's imports of torch's deprecated parts
    warnings.simplefilter("ignore", DeprecationWarning)
    import vllm.platforms as platforms
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from lmtier_connector.vllm import connector
    from support.vllm_helpers import (
        CHUNK,
        GEOMETRY,
        REAL_PAGE_INTERIOR_OF,
        Geometry,
        make_vllm_config,
        write_model_dir,
    )

CPU_GEOMETRY = Geometry(block_size=32)  # what vLLM's CPU backend accepts (MultipleOf(32))


class CudaLike(type(platforms.current_platform)):  # type: ignore[misc]
    """This machine's platform, saying it is CUDA (vLLM's GPU platform)."""

    def is_cpu(self) -> bool:
        return False

    def is_cuda(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def real_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """The connector's own page_interior_of (the harness makes it say "flash")."""
    monkeypatch.setattr(connector, "page_interior_of", REAL_PAGE_INTERIOR_OF)


def page_namespace(spec: KVSpec) -> bytes:
    cache = LMTier(load_config(overrides={"chunk_size": CHUNK}), spec, model_id="m")
    return cache.namespace("").digest


def test_a_cpu_page_and_a_gpu_page_of_one_model_never_share_a_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_vllm_config(
        write_model_dir(tmp_path, geometry=CPU_GEOMETRY), {}, geometry=CPU_GEOMETRY
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
    config = make_vllm_config(write_model_dir(tmp_path), {})
    assert connector.page_interior_of(config) == "cpu_attn"  # vLLM's CPU platform here
    monkeypatch.setattr(platforms, "_current_platform", CudaLike())
    assert connector.page_interior_of(config) == "flash"

    class Other(CudaLike):
        def is_cuda(self) -> bool:
            return False

    monkeypatch.setattr(platforms, "_current_platform", Other())
    with pytest.raises(ConfigError, match="CUDA and CPU"):
        connector.page_interior_of(config)


def test_lkthd_is_refused_on_the_cpu_backend(tmp_path: Path) -> None:
    config = make_vllm_config(
        write_model_dir(tmp_path, geometry=CPU_GEOMETRY), {}, geometry=CPU_GEOMETRY
    )
    with pytest.raises(ConfigError, match="chunk_layout to 'page'") as caught:
        connector.kv_spec_of(config, "LKTHD")
    assert "\n" not in str(caught.value)
    # Through the connector too, before any cache is opened.
    extra = {"chunk_layout": "LKTHD", "config": {"chunk_size": CHUNK}}
    config = make_vllm_config(
        write_model_dir(tmp_path / "m", geometry=CPU_GEOMETRY), extra, geometry=CPU_GEOMETRY
    )
    with pytest.raises(ConfigError, match="'page'"):
        connector.LMTierConnector(config, KVConnectorRole.SCHEDULER, None)  # type: ignore[arg-type]


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
