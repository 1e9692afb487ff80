"""An OpenSession the sidecar refuses leaves nothing behind: a real ``Sidecar`` (its
gRPC server on a unix socket, in this process, so that its namespace bookkeeping can
be read) refuses opens past ``max_sessions``; the refused namespaces are not counted
as live, so the geometries it remembers stay bounded."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from lmtier.config import config_from_dict
from lmtier.sidecar.server import Sidecar
from lmtier.v1 import sidecar_pb2 as pb
from lmtier.v1 import sidecar_pb2_grpc as pb_grpc

NAMESPACE = {
    "model_id": "m",
    "kv_dtype": "float32",
    "kv_layout": "LKTHD",
    "num_layers": 1,
    "num_kv_heads": 1,
    "head_dim": 64,
    "chunk_size": 16,
}


def test_refused_opens_leave_no_namespace_live(tmp_path: Path) -> None:
    async def run() -> None:
        config = config_from_dict(
            {
                "cpu": {"capacity_bytes": "64KiB", "staging_bytes": "32KiB"},
                "disk": {"enabled": False},
                "sidecar": {"slab_bytes": "16KiB", "max_sessions": 1, "shm_dir": str(tmp_path)},
            }
        )
        sidecar = Sidecar(config, f"unix://{tmp_path}/sidecar.sock")
        await sidecar.start()
        try:
            assert sidecar.service is not None
            check = sidecar.service.parts.check
            async with grpc.aio.insecure_channel(sidecar.target) as channel:
                stub = pb_grpc.SidecarStub(channel)
                holder = stub.OpenSession(
                    pb.OpenSessionRequest(namespace=pb.Namespace(**NAMESPACE))
                )
                assert (await holder.read()).WhichOneof("event") == "opened"
                for index in range(20):  # each a namespace of its own
                    space = pb.Namespace(**{**NAMESPACE, "model_id": f"m{index}"})
                    refused = stub.OpenSession(pb.OpenSessionRequest(namespace=space))
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await refused.read()
                    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert check.num_live == 1
                holder.cancel()
                for _ in range(3000):  # the sidecar sees the cancel on its loop
                    if check.num_live == 0:
                        break
                    await asyncio.sleep(0.01)
                assert check.num_live == 0
        finally:
            await sidecar.drain()

    asyncio.run(run())
