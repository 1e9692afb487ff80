"""A sidecar's clients ping at ``sidecar.keepalive_s``, as the sidecar does: a client
pinging more often than every half of the server's keepalive is refused by it, and one
pinging at the default while the operator shortened both ends noticed a lost sidecar
late. (The clients used the 10 s default whatever the config said.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

import lmtier
from lmtier import KVSpec, LMTierConfig
from lmtier.remote import connection

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8)


def test_lmtier_connect_pings_at_the_configured_keepalive(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[dict[str, Any]] = []
    real = grpc.insecure_channel

    def recording(target: str, options: Any = None, **kwargs: Any) -> grpc.Channel:
        seen.append(dict(options or ()))
        return real(target, options=options, **kwargs)

    monkeypatch.setattr(connection.grpc, "insecure_channel", recording)
    config = LMTierConfig(sidecar={"keepalive_s": 3.5})
    target = f"unix://{tmp_path / 'nobody-listens.sock'}"
    with lmtier.connect(target, config, kv=SPEC, model_id="m", timeout_s=1.0):
        pass
    assert seen, "no channel was built"
    assert {opts["grpc.keepalive_time_ms"] for opts in seen} == {3500}
    assert {opts["grpc.keepalive_timeout_ms"] for opts in seen} == {3500}
