"""Keyed integrity on a shared Redis: chunks planted by someone without the key are
misses, deleted and counted; chunks of key holders are served; local tiers are not
checked."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.chunks.format import decode
from lmtier.chunks.integrity import ChunkMac
from lmtier.config import CPUTierConfig, DiskTierConfig, IntegrityConfig, RedisTierConfig
from lmtier.errors import ConfigError
from lmtier.kv_spec import encode_kv_into
from lmtier.storage.host_pool import HostPool
from support.redis_servers import RedisServer

pytestmark = pytest.mark.integration

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8)
CHUNK = 32
KEY = "a-deployment-secret-of-32-bytes!"


def config(url: str, node: Path, key: str | None = KEY) -> LMTierConfig:
    """One node: its own disk under ``node``, the Redis keys of this test's directory."""
    return LMTierConfig(
        chunk_size=CHUNK,
        cpu=CPUTierConfig(capacity_bytes=8 << 20, staging_bytes=1 << 20),
        disk=DiskTierConfig(path=node / "disk", fsync=False),
        redis=RedisTierConfig(url=url, key_prefix=f"{node.parent.name}:"),  # type: ignore[arg-type]
        integrity=IntegrityConfig(key=key),  # type: ignore[arg-type]
    )


def kv_for(num_tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(SPEC.shape(num_tokens), generator=torch.Generator().manual_seed(seed))


def test_only_chunks_of_key_holders_are_served_from_a_shared_tier(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    prompt, kv, forged = list(range(3 * CHUNK)), kv_for(3 * CHUNK, 1), kv_for(3 * CHUNK, 2)
    url = redis_server.url
    with LMTier.open(config(url, tmp_path / "writer"), kv=SPEC, model_id="m") as writer:
        assert writer.store(prompt, kv) == 3
        writer.flush()
    # The attacker can write to Redis and compute the keys, but has no integrity key:
    # it plants well-formed chunks, checksums right, over the real ones.
    planter = config(url, tmp_path / "writer", key=None)
    with LMTier.open(planter, kv=SPEC, model_id="m") as attacker:
        keys = attacker.keys(prompt)
        handles = attacker.acquire_slabs(3)
        encoded = []
        for index, handle in enumerate(handles):
            meta = SPEC.meta(keys[index], CHUNK)
            part = forged[:, :, index * CHUNK : (index + 1) * CHUNK]
            encoded.append((keys[index], handle, encode_kv_into(handle, meta, part)))
        attacker.put_encoded(encoded)
        attacker.flush()
    with LMTier.open(config(url, tmp_path / "victim"), kv=SPEC, model_id="m") as victim:
        assert victim.lookup(prompt).tokens_by_tier(CHUNK) == {"redis": 3 * CHUNK}
        with victim.load(prompt) as hit:
            assert hit.num_tokens == 0  # planted: never served
        stats = victim.stats()["redis"]
        assert stats["corrupt"] == 1
        assert victim.lookup(prompt).num_tokens == 0  # and deleted
        # The victim recomputes and stores; a second key holder is served.
        assert victim.store(prompt, kv) == 3
        victim.flush()
    with (
        LMTier.open(config(url, tmp_path / "reader"), kv=SPEC, model_id="m") as reader,
        reader.load(prompt) as hit,
    ):
        assert hit.tokens_by_tier() == {"redis": 3 * CHUNK}
        assert torch.equal(hit.kv(), kv)
        assert hit.chunks[0].chunk.mac != bytes(32)


def test_local_tiers_are_not_checked(redis_server: RedisServer, tmp_path: Path) -> None:
    prompt, kv = list(range(2 * CHUNK)), kv_for(2 * CHUNK, 3)
    node = tmp_path / "node"
    unsigned = config(redis_server.url, node, key=None)
    with LMTier.open(unsigned, kv=SPEC, model_id="local") as cache:
        assert cache.store(prompt, kv) == 2  # on disk, without a MAC
        cache.flush()
    signed = config(redis_server.url, node).replace(redis=RedisTierConfig())
    with LMTier.open(signed, kv=SPEC, model_id="local") as cache, cache.load(prompt) as hit:
        assert hit.tokens_by_tier() == {"disk": 2 * CHUNK}  # this user's own disk: served


def test_mac_covers_header_and_payload() -> None:
    mac = ChunkMac(KEY.encode())
    pool = HostPool(SPEC.encoded_chunk_bytes(CHUNK), 1)
    with pool.acquire() as handle:  # type: ignore[union-attr]
        meta = SPEC.meta(bytes(range(32)), CHUNK)  # type: ignore[arg-type]
        size = encode_kv_into(handle, meta, kv_for(CHUNK, 4), mac.sign)
        chunk = decode(handle.view[:size])
        assert mac.verify(chunk)
        assert not ChunkMac(b"another key of sixteen+ bytes").verify(chunk)
        handle.view[size - 1] ^= 1  # one payload bit
        assert not mac.verify(decode(handle.view[:size], verify=False))
    pool.close()


def test_key_file_is_read_and_checked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    path.chmod(0o644)
    cfg = LMTierConfig(
        chunk_size=CHUNK,
        disk=DiskTierConfig(enabled=False),
        cpu=CPUTierConfig(capacity_bytes=1 << 20, staging_bytes=1 << 20),
        integrity=IntegrityConfig(key_file=path),
    )
    with caplog.at_level(logging.WARNING), LMTier.open(cfg, kv=SPEC, model_id="m"):
        pass
    assert "can be read by other users" in caplog.text
    assert KEY not in caplog.text
    path.write_text("short")
    with pytest.raises(ConfigError, match="at least 16"):
        LMTier.open(cfg, kv=SPEC, model_id="m")
    path.unlink()
    with pytest.raises(ConfigError, match=r"integrity\.key_file"):
        LMTier.open(cfg, kv=SPEC, model_id="m")
