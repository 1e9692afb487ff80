"""LMCache's ``LMCACHE_*`` environment variables: the ones with an lmtier meaning are
read through the same translation as LMCache's file keys, the others are refused with
one message naming them all (before, every one but LMCACHE_CONFIG_FILE was silently
ignored)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmtier.config import load_config
from lmtier.errors import ConfigError


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A clean environment: nothing from the machine running the tests leaks in."""
    return {"HOME": str(tmp_path / "home"), "PATH": "/usr/bin"}


def test_lmcache_variables_map_like_its_file_keys(env: dict[str, str], tmp_path: Path) -> None:
    env |= {
        "LMCACHE_CHUNK_SIZE": "128",
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5",
        "LMCACHE_LOCAL_DISK": f"file://{tmp_path}/kv/",
        "LMCACHE_MAX_LOCAL_DISK_SIZE": "2",
        "LMCACHE_REMOTE_URL": "s3://bucket/team",
    }
    cfg = load_config(env=env)
    assert cfg.chunk_size == 128
    assert (cfg.cpu.enabled, cfg.cpu.capacity_bytes) == (True, 2**29)
    assert (cfg.disk.enabled, cfg.disk.path) == (True, tmp_path / "kv")
    assert cfg.disk.capacity_bytes == 2 * 2**30
    assert (cfg.s3.bucket, cfg.s3.prefix) == ("bucket", "team/")


def test_lmcache_none_unsets_and_lmtier_variables_win(env: dict[str, str], tmp_path: Path) -> None:
    env |= {"LMCACHE_LOCAL_DISK": "None", "LMCACHE_LOCAL_CPU": "false"}
    cfg = load_config(env=env)
    assert (cfg.disk.enabled, cfg.cpu.enabled) == (False, False)
    env |= {"LMCACHE_CHUNK_SIZE": "128", "LMTIER_CHUNK_SIZE": "64"}
    assert load_config(env=env).chunk_size == 64
    path = tmp_path / "lmtier.yaml"
    path.write_text("chunk_size: 32\n")
    del env["LMTIER_CHUNK_SIZE"]
    assert load_config(path, env=env).chunk_size == 128, "the environment is above the file"


def test_other_lmcache_variables_are_refused_in_one_message(env: dict[str, str]) -> None:
    env |= {
        "LMCACHE_USE_EXPERIMENTAL": "True",
        "LMCACHE_REMOTE_SERDE": "naive",
        "LMCACHE_CHUNK_SIZE": "64",
    }
    with pytest.raises(ConfigError) as raised:
        load_config(env=env)
    message = str(raised.value)
    assert "\n" not in message
    assert "LMCACHE_USE_EXPERIMENTAL" in message and "LMCACHE_REMOTE_SERDE (" in message
    assert "LMCACHE_CHUNK_SIZE," in message, "and it says which ones are read"


def test_a_bad_lmcache_value_names_its_variable(env: dict[str, str]) -> None:
    env["LMCACHE_MAX_LOCAL_CPU_SIZE"] = "lots"
    with pytest.raises(ConfigError, match="from environment variable LMCACHE_MAX_LOCAL_CPU_SIZE"):
        load_config(env=env)


def test_lmcache_config_file_is_still_a_file_not_a_setting(
    env: dict[str, str], tmp_path: Path
) -> None:
    path = tmp_path / "lmcache.yaml"
    path.write_text("chunk_size: 512\n")
    env |= {"LMCACHE_CONFIG_FILE": str(path), "LMCACHE_MAX_LOCAL_DISK_SIZE": "1"}
    cfg = load_config(env=env)
    assert (cfg.chunk_size, cfg.disk.capacity_bytes) == (512, 2**30)
