"""The sidecar's shared pool on CUDA: the client registers its mapping as pinned
memory, and KV moves between GPU tensors and the sidecar's slabs bit-exact (skipped
without CUDA; run by benchmarks/gpu_check.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from lmtier import KVSpec, connect, load_config  # noqa: E402
from lmtier.remote.client import SidecarStore  # noqa: E402
from lmtier.testing.sidecar import SidecarProcess  # noqa: E402

SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16")


def test_gpu_kv_through_the_pinned_shared_pool(tmp_path: Path) -> None:
    settings = {"cpu": {"capacity_bytes": "256MiB", "staging_bytes": "64MiB"}}
    with SidecarProcess(tmp_path, settings) as sidecar:
        cache = connect(sidecar.target, load_config(env={}), kv=SPEC, model_id="gpu")
        try:
            store = cache.chunk_store
            assert isinstance(store, SidecarStore)
            connection = store._conn()
            session = connection.session(cache.namespace())
            assert session.pool is not None
            regions = connection.pools.regions()
            assert regions and regions[-1]._registered  # cudaHostRegister succeeded
            ids = list(range(2048))
            kv = torch.randn(SPEC.shape(2048), device="cuda", dtype=torch.float16)
            assert cache.store(ids, kv) == 8
            out = torch.empty(SPEC.shape(2047 // 256 * 256), device="cuda", dtype=torch.float16)
            with cache.load(ids, max_tokens=2047) as hit:
                assert hit.num_tokens == 7 * 256
                for index, chunk in enumerate(hit.tensors()):  # pinned host -> GPU, DMA
                    assert chunk.is_pinned()
                    out[:, :, index * 256 : (index + 1) * 256].copy_(chunk, non_blocking=True)
                torch.cuda.synchronize()  # the copies are done before the leases end
            assert torch.equal(out, kv[:, :, : 7 * 256])
        finally:
            cache.close()
