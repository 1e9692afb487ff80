"""Tests of lmtier.config: layering, parsing, validation, LMCache keys and redaction."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import assume, given
from hypothesis import strategies as st

from lmtier.config import (
    CPUTierConfig,
    DiskTierConfig,
    LMTierConfig,
    RedisTierConfig,
    S3TierConfig,
    config_from_dict,
    default_disk_path,
    load_config,
)
from lmtier.config.secrets import Secret, SecretURL, redact_url
from lmtier.config.sizes import format_size, parse_size
from lmtier.errors import ConfigError

GIB = 1024**3


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    return path


@pytest.fixture
def env(home: Path) -> dict[str, str]:
    """A clean environment: nothing from the machine running the tests leaks in."""
    return {"HOME": str(home), "PATH": "/usr/bin"}


def write_yaml(tmp_path: Path, text: str, name: str = "lmtier.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --- defaults -------------------------------------------------------------------------


def test_defaults_are_the_embedded_default(env: dict[str, str], home: Path) -> None:
    cfg = load_config(env=env)
    assert cfg.chunk_size == 256
    assert cfg.hash_algorithm == "xxh3"
    assert (cfg.model_id, cfg.model_revision) == ("", "")
    assert cfg.log_level == "WARNING"
    assert cfg.cpu == CPUTierConfig(enabled=True, capacity_bytes=4 * GIB)
    assert cfg.disk.enabled
    assert cfg.disk.path == home / ".cache" / "lmtier" / "chunks"
    assert cfg.disk.capacity_bytes == 32 * GIB
    assert (cfg.disk.fsync, cfg.disk.o_direct, cfg.disk.io_threads) == (False, False, 4)
    assert cfg.redis == RedisTierConfig()
    assert cfg.redis.url is None
    assert (cfg.redis.key_prefix, cfg.redis.timeout_s, cfg.redis.max_connections) == (
        "lmtier:",
        0.5,
        16,
    )
    assert cfg.s3.bucket is None
    assert (cfg.s3.prefix, cfg.s3.timeout_s, cfg.s3.max_concurrency) == ("lmtier/", 2.0, 16)


def test_direct_construction_uses_the_same_defaults(env: dict[str, str]) -> None:
    direct = LMTierConfig()
    loaded = load_config(env=env)
    assert direct.replace(disk=loaded.disk) == loaded


def test_xdg_cache_home_sets_the_disk_path(env: dict[str, str], tmp_path: Path) -> None:
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    assert load_config(env=env).disk.path == tmp_path / "xdg" / "lmtier" / "chunks"


def test_relative_xdg_cache_home_is_ignored(home: Path) -> None:
    path = default_disk_path({"HOME": str(home), "XDG_CACHE_HOME": "relative/dir"})
    assert path == home / ".cache" / "lmtier" / "chunks"


def test_every_field_is_documented() -> None:
    for cls in (LMTierConfig, CPUTierConfig, DiskTierConfig, RedisTierConfig, S3TierConfig):
        for name, field in cls.model_fields.items():
            assert len(field.description or "") > 10, f"{cls.__name__}.{name}"


def test_configs_are_frozen() -> None:
    cfg = LMTierConfig()
    with pytest.raises(ValueError, match="frozen"):
        cfg.chunk_size = 512  # type: ignore[misc]
    changed = cfg.replace(chunk_size=512)
    assert (changed.chunk_size, cfg.chunk_size) == (512, 256)
    with pytest.raises(ConfigError, match="chunk_size"):
        cfg.replace(chunk_size=7)


# --- files, environment and overrides ---------------------------------------------------


def test_file_values_are_loaded(tmp_path: Path, env: dict[str, str]) -> None:
    path = write_yaml(
        tmp_path,
        """
chunk_size: 512
model_id: org/model
model_revision: abc123
log_level: debug
cpu: {enabled: false, capacity_bytes: 8GiB}
disk:
  path: /mnt/nvme/kv
  capacity_bytes: 500GB
  fsync: false
  o_direct: true
  io_threads: 8
redis:
  url: redis://cache:6379/0
  ttl_s: 3600
  refresh_ttl_on_hit: true
s3: {bucket: kv-cache, region: eu-west-1, endpoint_url: "http://minio:9000"}
""",
    )
    cfg = load_config(path, env=env)
    assert (cfg.chunk_size, cfg.model_id, cfg.model_revision) == (512, "org/model", "abc123")
    assert cfg.log_level == "DEBUG"
    assert cfg.cpu == CPUTierConfig(enabled=False, capacity_bytes=8 * GIB)
    assert cfg.disk == DiskTierConfig(
        enabled=True,
        path=Path("/mnt/nvme/kv"),
        capacity_bytes=500 * 10**9,
        fsync=False,
        o_direct=True,
        io_threads=8,
    )
    assert cfg.redis.url == SecretURL("redis://cache:6379/0")
    assert cfg.redis.ttl_s == 3600.0
    assert isinstance(cfg.redis.ttl_s, float)
    assert cfg.redis.refresh_ttl_on_hit is True
    assert (cfg.s3.bucket, cfg.s3.region, cfg.s3.endpoint_url) == (
        "kv-cache",
        "eu-west-1",
        "http://minio:9000",
    )


def test_config_env_var_names_the_file(tmp_path: Path, env: dict[str, str]) -> None:
    env["LMTIER_CONFIG"] = str(write_yaml(tmp_path, "chunk_size: 64\n"))
    assert load_config(env=env).chunk_size == 64


def test_explicit_path_wins_over_config_env_var(tmp_path: Path, env: dict[str, str]) -> None:
    env["LMTIER_CONFIG"] = str(write_yaml(tmp_path, "chunk_size: 64\n", "a.yaml"))
    assert load_config(write_yaml(tmp_path, "chunk_size: 32\n", "b.yaml"), env=env).chunk_size == 32


def test_tilde_in_paths_uses_home_from_env(tmp_path: Path, env: dict[str, str], home: Path) -> None:
    write_yaml(home, "disk: {path: ~/kv}\n", "cfg.yaml")
    cfg = load_config("~/cfg.yaml", env=env)
    assert cfg.disk.path == home / "kv"


def test_env_overrides_file(tmp_path: Path, env: dict[str, str]) -> None:
    path = write_yaml(tmp_path, "chunk_size: 512\ncpu: {capacity_bytes: 1GiB, enabled: false}\n")
    env |= {"LMTIER_CHUNK_SIZE": "1024", "LMTIER_CPU__CAPACITY_BYTES": "2GiB"}
    cfg = load_config(path, env=env)
    assert cfg.chunk_size == 1024
    assert cfg.cpu.capacity_bytes == 2 * GIB
    assert cfg.cpu.enabled is False  # layers replace keys, not whole sections


def test_overrides_win_over_env_and_file(tmp_path: Path, env: dict[str, str]) -> None:
    path = write_yaml(tmp_path, "chunk_size: 512\n")
    env["LMTIER_CHUNK_SIZE"] = "1024"
    overrides = {"chunk_size": 2048, "cpu": {"capacity_bytes": "3GiB"}, "disk.io_threads": "2"}
    cfg = load_config(path, env=env, overrides=overrides)
    assert (cfg.chunk_size, cfg.cpu.capacity_bytes, cfg.disk.io_threads) == (2048, 3 * GIB, 2)


def test_nested_env_names_use_double_underscore(env: dict[str, str]) -> None:
    env |= {
        "LMTIER_DISK__PATH": "/data/kv",
        "LMTIER_DISK__IO_THREADS": "16",
        "LMTIER_REDIS__URL": "rediss://cache:6380",
        "LMTIER_REDIS__TTL_S": "1.5",
        "LMTIER_S3__BUCKET": "bucket",
        "LMTIER_S3__MAX_CONCURRENCY": "+4",
        "LMTIER_HASH_ALGORITHM": "VLLM",
        "LMTIER_LOG_LEVEL": "info",
    }
    cfg = load_config(env=env)
    assert cfg.disk.path == Path("/data/kv")
    assert cfg.disk.io_threads == 16
    assert cfg.redis.url is not None
    assert cfg.redis.url.reveal() == "rediss://cache:6380"
    assert cfg.redis.ttl_s == 1.5
    assert (cfg.s3.bucket, cfg.s3.max_concurrency) == ("bucket", 4)
    assert (cfg.hash_algorithm, cfg.log_level) == ("vllm", "INFO")


def test_empty_env_value_unsets_an_optional_field(tmp_path: Path, env: dict[str, str]) -> None:
    path = write_yaml(tmp_path, "redis: {url: 'redis://h', ttl_s: 10}\n")
    env |= {"LMTIER_REDIS__URL": "", "LMTIER_REDIS__TTL_S": " "}
    cfg = load_config(path, env=env)
    assert (cfg.redis.url, cfg.redis.ttl_s) == (None, None)


def test_other_environment_variables_are_ignored(env: dict[str, str]) -> None:
    env |= {"XLMCACHE_CHUNK_SIZE": "16", "lmtier_chunk_size": "16", "XLMTIER_CHUNK_SIZE": "16"}
    assert load_config(env=env).chunk_size == 256


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("true", True),
        ("True", True),
        ("YES", True),
        ("1", True),
        (" yes ", True),
        ("false", False),
        ("FALSE", False),
        ("no", False),
        ("0", False),
    ],
)
def test_bools_parse_from_env(env: dict[str, str], text: str, expected: bool) -> None:
    env["LMTIER_CPU__ENABLED"] = text
    env["LMTIER_DISK__O_DIRECT"] = text
    cfg = load_config(env=env)
    assert cfg.cpu.enabled is expected
    assert cfg.disk.o_direct is expected


@pytest.mark.parametrize("text", ["maybe", "on", "2", "tru"])
def test_bad_bools_from_env_name_the_key_and_variable(env: dict[str, str], text: str) -> None:
    env["LMTIER_CPU__ENABLED"] = text
    with pytest.raises(ConfigError, match=r"^cpu\.enabled: must be true or false") as info:
        load_config(env=env)
    assert "LMTIER_CPU__ENABLED" in str(info.value)
    assert repr(text) in str(info.value)


def test_ints_from_yaml_are_not_bools(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=r"^cpu\.enabled: must be true or false"):
        config_from_dict({"cpu": {"enabled": 1}}, env=env)


# --- file errors ------------------------------------------------------------------------


def test_missing_file_names_the_path(tmp_path: Path, env: dict[str, str]) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="not found") as info:
        load_config(missing, env=env)
    assert str(missing) in str(info.value)


def test_missing_file_from_config_env_var(tmp_path: Path, env: dict[str, str]) -> None:
    env["LMTIER_CONFIG"] = str(tmp_path / "gone.yaml")
    with pytest.raises(ConfigError, match=r"gone\.yaml"):
        load_config(env=env)


def test_invalid_yaml_reports_the_line(tmp_path: Path, env: dict[str, str]) -> None:
    path = write_yaml(tmp_path, "chunk_size: 256\ncpu:\n  enabled: true\n bad: [\n")
    with pytest.raises(ConfigError, match=r"invalid YAML .* line 4") as info:
        load_config(path, env=env)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_top_level_must_be_a_mapping(tmp_path: Path, env: dict[str, str], text: str) -> None:
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write_yaml(tmp_path, text), env=env)


def test_empty_file_means_defaults(tmp_path: Path, env: dict[str, str]) -> None:
    assert load_config(write_yaml(tmp_path, "# nothing\n"), env=env) == load_config(env=env)


def test_section_must_be_a_mapping(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=r"^cpu: must be a mapping"):
        config_from_dict({"cpu": 8}, env=env)


def test_empty_section_is_allowed(tmp_path: Path, env: dict[str, str]) -> None:
    assert load_config(write_yaml(tmp_path, "redis:\ncpu:\n"), env=env).redis.url is None


def test_dotted_keys_are_for_overrides_only(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=r"write it nested, as 'cpu: \{enabled: \.\.\.\}'"):
        config_from_dict({"cpu.enabled": False}, env=env)


def test_the_same_key_twice_in_overrides_is_an_error(env: dict[str, str]) -> None:
    overrides = {"cpu": {"enabled": False}, "cpu.enabled": True}
    with pytest.raises(ConfigError, match=r"'cpu\.enabled' twice both set cpu\.enabled"):
        load_config(env=env, overrides=overrides)


# --- unknown keys -----------------------------------------------------------------------


def test_unknown_key_in_section_suggests_the_closest(tmp_path: Path, env: dict[str, str]) -> None:
    path = write_yaml(tmp_path, "cpu: {capacty_bytes: 8GiB}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env=env)
    message = str(info.value)
    assert message.startswith(
        "unknown config key 'cpu.capacty_bytes' (did you mean 'cpu.capacity_bytes'?)"
    )
    assert str(path) in message


def test_unknown_top_level_key_suggests_the_closest(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=r"'chunksize' \(did you mean 'chunk_size'\?\)"):
        config_from_dict({"chunksize": 256}, env=env)


def test_field_written_outside_its_section_suggests_the_section(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'cpu\.capacity_bytes'"):
        config_from_dict({"capacity_bytes": "8GiB"}, env=env)


def test_misspelt_section_suggests_the_section(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'redus' \(did you mean 'redis'\?\)"):
        config_from_dict({"redus": {"url": "redis://h"}}, env=env)


def test_unknown_key_without_a_close_match_has_no_suggestion(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=r"^unknown config key 'zzzzzz'$"):
        config_from_dict({"zzzzzz": 1}, env=env)


def test_unknown_env_variable_suggests_the_right_name(env: dict[str, str]) -> None:
    env["LMTIER_CPU__CAPACTY_BYTES"] = "8GiB"
    with pytest.raises(ConfigError) as info:
        load_config(env=env)
    assert str(info.value) == (
        "unknown config key 'cpu.capacty_bytes' from environment variable "
        "LMTIER_CPU__CAPACTY_BYTES (did you mean LMTIER_CPU__CAPACITY_BYTES?)"
    )


def test_single_underscore_env_name_suggests_the_double(env: dict[str, str]) -> None:
    env["LMTIER_CPU_CAPACITY_BYTES"] = "8GiB"
    with pytest.raises(ConfigError, match="did you mean LMTIER_CPU__CAPACITY_BYTES"):
        load_config(env=env)


def test_lmcache_keys_are_not_accepted_from_env(env: dict[str, str]) -> None:
    env["LMTIER_MAX_LOCAL_CPU_SIZE"] = "5"
    with pytest.raises(ConfigError, match="unknown config key 'max_local_cpu_size'"):
        load_config(env=env)


# --- validation -------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [0, -16, 8, 100, 257])
def test_chunk_size_must_be_a_positive_multiple_of_16(env: dict[str, str], chunk_size: int) -> None:
    with pytest.raises(ConfigError, match=r"^chunk_size: must be a positive multiple of 16"):
        config_from_dict({"chunk_size": chunk_size}, env=env)


def test_chunk_size_multiple_of_16_accepted(env: dict[str, str]) -> None:
    assert config_from_dict({"chunk_size": 16}, env=env).chunk_size == 16


def test_direct_construction_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"^chunk_size: must be a positive multiple of 16"):
        LMTierConfig(chunk_size=100)
    with pytest.raises(ConfigError, match=r"^cpu\.capacity_bytes: must be >= 0, got -1$"):
        CPUTierConfig(capacity_bytes=-1)
    with pytest.raises(ConfigError, match=r"^disk\.io_threads: must be an integer"):
        DiskTierConfig(path=Path("/x"), io_threads=4.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^s3\.bucket: must not be blank"):
        S3TierConfig(bucket="  ")
    with pytest.raises(ConfigError, match=r"^redis\.url: must be a URL string, got int$"):
        RedisTierConfig(url=6379)  # type: ignore[arg-type]
    # A plain string is wrapped, as loading would: the secret stays hidden.
    direct = RedisTierConfig(url="redis://:pw@h")  # type: ignore[arg-type]
    assert isinstance(direct.url, SecretURL) and "pw" not in repr(direct)


def test_negative_capacity_message(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"cpu": {"capacity_bytes": -1}}, env=env)
    assert str(info.value) == "cpu.capacity_bytes: must be >= 0, got -1"


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({"hash_algorithm": "md5"}, r"^hash_algorithm: must be one of 'xxh3', 'vllm'"),
        ({"log_level": "loud"}, r"^log_level: must be one of DEBUG, .*got 'LOUD'"),
        ({"model_id": 123}, r"^model_id: must be a string \(quote it in YAML\), got 123"),
        ({"chunk_size": 256.0}, r"^chunk_size: must be an integer, got 256\.0"),
        ({"chunk_size": True}, r"^chunk_size: must be an integer, got True"),
        ({"disk": {"io_threads": 0}}, r"^disk\.io_threads: must be >= 1, got 0"),
        ({"disk": {"path": ""}}, r"^disk\.path: must be a non-empty path"),
        ({"disk": {"capacity_bytes": 1.5}}, r"^disk\.capacity_bytes: must be an integer"),
        ({"redis": {"timeout_s": 0}}, r"^redis\.timeout_s: must be > 0, got 0"),
        ({"redis": {"ttl_s": -5}}, r"^redis\.ttl_s: must be > 0"),
        ({"redis": {"ttl_s": "inf"}}, r"^redis\.ttl_s: must be a finite number"),
        ({"redis": {"max_connections": "many"}}, r"^redis\.max_connections: must be an integer"),
        ({"redis": {"url": "http://h"}}, r"^redis\.url: scheme must be one of redis, rediss"),
        ({"redis": {"url": "redis://h:99999"}}, r"^redis\.url: not a valid URL"),
        ({"redis": {"url": "unix://"}}, r"^redis\.url: a unix:// URL needs a socket path"),
        ({"s3": {"endpoint_url": "minio:9000"}}, r"^s3\.endpoint_url: must be an http"),
        ({"s3": {"endpoint_url": "http://[::1"}}, r"^s3\.endpoint_url: must be an http"),
        ({"s3": {"endpoint_url": "http://h:port"}}, r"^s3\.endpoint_url: must be an http"),
        ({"s3": {"region": 5}}, r"^s3\.region: must be a string"),
        ({"s3": {"max_concurrency": 0}}, r"^s3\.max_concurrency: must be >= 1"),
        ({"s3": {"access_key_id": "AK"}}, r"set both or neither"),
    ],
)
def test_bad_values_name_the_dotted_key(
    env: dict[str, str], data: dict[str, Any], pattern: str
) -> None:
    with pytest.raises(ConfigError, match=pattern):
        config_from_dict(data, env=env)


def test_value_error_from_env_names_the_variable(env: dict[str, str]) -> None:
    env["LMTIER_REDIS__TIMEOUT_S"] = "-1"
    with pytest.raises(ConfigError, match=r"^redis\.timeout_s: must be > 0, got -1\.0 \(from "):
        load_config(env=env)


def test_redis_url_schemes_accepted(env: dict[str, str]) -> None:
    for url in ("redis://h:6379/0", "rediss://u:p@h:6380", "unix:///run/redis.sock"):
        cfg = config_from_dict({"redis": {"url": url}}, env=env)
        assert cfg.redis.url == SecretURL(url)


def test_config_error_is_a_value_error(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        config_from_dict({"chunk_size": 1}, env=env)


# --- sizes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        (4096, 4096),
        ("0", 0),
        ("5GB", 5 * 10**9),
        ("5gb", 5 * 10**9),
        ("100 KB", 100_000),
        ("3MB", 3 * 10**6),
        ("2TB", 2 * 10**12),
        ("512MiB", 512 * 1024**2),
        ("1.5 GiB", 1536 * 1024**2),
        ("2TiB", 2 * 1024**4),
        ("8kib", 8 * 1024),
        ("8K", 8 * 1024),
        ("8M", 8 * 1024**2),
        ("8G", 8 * GIB),
        ("1T", 1024**4),
        ("10B", 10),
        (" 7 b ", 7),
        (".5K", 512),
        ("1.1KiB", 1126),
        ("0.001GB", 10**6),
    ],
)
def test_parse_size_valid(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", "GB", "5XB", "5 GiBs", "-1", "-1GB", -1, "4096.5", "1e9", "1,000", "five", "5 5GB"],
)
def test_parse_size_invalid(text: str | int) -> None:
    with pytest.raises(ConfigError, match="invalid size"):
        parse_size(text)


@pytest.mark.parametrize("value", [1.5, None, True, [1]])
def test_parse_size_rejects_non_sizes(value: Any) -> None:
    with pytest.raises(ConfigError, match="invalid size"):
        parse_size(value)


def test_bad_size_in_config_names_key_and_value(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"disk": {"capacity_bytes": "12 parsecs"}}, env=env)
    assert str(info.value).startswith("disk.capacity_bytes: invalid size '12 parsecs'")


def test_bad_size_from_env_names_the_variable(env: dict[str, str]) -> None:
    env["LMTIER_CPU__CAPACITY_BYTES"] = "lots"
    with pytest.raises(ConfigError, match=r"^cpu\.capacity_bytes: invalid size 'lots'.*LMTIER_CPU"):
        load_config(env=env)


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (4 * GIB, "4 GiB"),
        (4 * 10**9, "3.73 GiB"),
        (1024**2 - 1, "1 MiB"),
        (3 * 1024**4, "3 TiB"),
        (5 * 1024**5, "5120 TiB"),
    ],
)
def test_format_size(num_bytes: int, text: str) -> None:
    assert format_size(num_bytes) == text


def test_format_size_rejects_negative() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        format_size(-1)


@given(st.integers(min_value=0, max_value=2**70))
def test_format_size_round_trips_within_rounding(num_bytes: int) -> None:
    back = parse_size(format_size(num_bytes))
    # Two decimals of the chosen unit: off by at most half a hundredth of it (< 0.5%).
    assert abs(back - num_bytes) * 200 <= max(num_bytes, 1)


@given(
    st.integers(min_value=4, max_value=4 * 1023 + 3),
    st.sampled_from([1024, 1024**2, 1024**3, 1024**4]),
)
def test_format_size_is_exact_on_quarter_units(quarters: int, unit: int) -> None:
    num_bytes = quarters * unit // 4  # 1 to 1023.75 units: two decimals say it exactly
    assert parse_size(format_size(num_bytes)) == num_bytes


# --- LMCache keys -----------------------------------------------------------------------


def test_lmcache_keys_map_to_ours(tmp_path: Path, env: dict[str, str]) -> None:
    path = write_yaml(
        tmp_path,
        """
chunk_size: 512
local_cpu: false
max_local_cpu_size: 5
local_disk: "file:///mnt/lmcache/"
max_local_disk_size: 1.5
remote_url: "redis://cache:6379"
""",
    )
    cfg = load_config(path, env=env)
    assert cfg.chunk_size == 512
    assert cfg.cpu == CPUTierConfig(enabled=False, capacity_bytes=5 * GIB)
    assert cfg.disk.enabled
    assert cfg.disk.path == Path("/mnt/lmcache")
    assert cfg.disk.capacity_bytes == 1536 * 1024**2
    assert cfg.redis.url == SecretURL("redis://cache:6379")
    assert cfg.s3.bucket is None


def test_lmcache_mapping_is_logged_at_debug(
    env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="lmtier")
    config_from_dict({"max_local_cpu_size": 2}, env=env)
    assert "LMCache key 'max_local_cpu_size' mapped to ['cpu.capacity_bytes']" in caplog.text


@pytest.mark.parametrize("value", [None, False])
def test_lmcache_local_disk_null_disables_disk(env: dict[str, str], value: Any) -> None:
    cfg = config_from_dict({"local_disk": value}, env=env)
    assert cfg.disk.enabled is False


def test_lmcache_local_disk_plain_path(env: dict[str, str]) -> None:
    cfg = config_from_dict({"local_disk": "/var/cache/kv/"}, env=env)
    assert (cfg.disk.enabled, cfg.disk.path) == (True, Path("/var/cache/kv"))


@pytest.mark.parametrize("value", [True, 5, "file://otherhost/x", ""])
def test_lmcache_local_disk_bad_values(env: dict[str, str], value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^local_disk: must be"):
        config_from_dict({"local_disk": value}, env=env)


@pytest.mark.parametrize("value", ["lots", True, -1, float("nan"), 1e308, "1e12"])
def test_lmcache_sizes_bad_values(env: dict[str, str], value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^max_local_cpu_size: must be a"):
        config_from_dict({"max_local_cpu_size": value}, env=env)


@pytest.mark.parametrize(
    "url", ["redis://h:6379/0", "rediss://:pw@h:6380", "unix:///run/redis.sock"]
)
def test_lmcache_remote_url_redis(env: dict[str, str], url: str) -> None:
    cfg = config_from_dict({"remote_url": url}, env=env)
    assert cfg.redis.url is not None
    assert cfg.redis.url.reveal() == url
    assert cfg.s3.bucket is None


def test_lmcache_remote_url_s3(env: dict[str, str]) -> None:
    cfg = config_from_dict({"remote_url": "s3://kv-bucket/team/cache"}, env=env)
    assert (cfg.s3.bucket, cfg.s3.prefix) == ("kv-bucket", "team/cache/")
    assert cfg.redis.url is None


def test_lmcache_remote_url_s3_without_prefix_keeps_ours(env: dict[str, str]) -> None:
    cfg = config_from_dict({"remote_url": "s3://kv-bucket"}, env=env)
    assert (cfg.s3.bucket, cfg.s3.prefix) == ("kv-bucket", "lmtier/")


def test_lmcache_remote_url_null_sets_nothing(env: dict[str, str]) -> None:
    assert config_from_dict({"remote_url": None}, env=env).redis.url is None


@pytest.mark.parametrize(
    ("url", "scheme"),
    [("lm://localhost:65432", "lm"), ("mooncakestore://x", "mooncakestore"), ("cache", "")],
)
def test_lmcache_remote_url_bad_scheme(env: dict[str, str], url: str, scheme: str) -> None:
    with pytest.raises(ConfigError, match=rf"^remote_url: scheme '{scheme}' is not supported"):
        config_from_dict({"remote_url": url}, env=env)


def test_lmcache_remote_url_bad_scheme_does_not_leak_password(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"remote_url": "lm://user:hunter2secret@h"}, env=env)
    assert "hunter2secret" not in str(info.value)


@pytest.mark.parametrize(
    ("data", "first", "second"),
    [
        ({"max_local_cpu_size": 5, "cpu": {"capacity_bytes": "5GiB"}}, "max_local_cpu_size", "cpu"),
        ({"local_cpu": True, "cpu": {"enabled": True}}, "local_cpu", "cpu.enabled"),
        ({"local_disk": "/x", "disk": {"path": "/y"}}, "local_disk", "disk.path"),
        ({"disk": {"enabled": False}, "local_disk": None}, "disk.enabled", "local_disk"),
        ({"max_local_disk_size": 1, "disk": {"capacity_bytes": 1}}, "max_local_disk_size", "disk"),
        ({"remote_url": "redis://h", "redis": {"url": "redis://g"}}, "remote_url", "redis.url"),
        ({"remote_url": "s3://b/p", "s3": {"prefix": "q/"}}, "remote_url", "s3.prefix"),
    ],
)
def test_lmcache_and_our_key_for_one_field_conflict(
    env: dict[str, str], data: dict[str, Any], first: str, second: str
) -> None:
    with pytest.raises(ConfigError, match=r"both set .*; keep one") as info:
        config_from_dict(data, env=env)
    message = str(info.value)
    assert f"'{first}" in message
    assert f"'{second}" in message


def test_lmcache_keys_in_overrides(env: dict[str, str]) -> None:
    cfg = load_config(env=env, overrides={"max_local_cpu_size": 1})
    assert cfg.cpu.capacity_bytes == GIB


def test_lmcache_key_in_file_and_ours_in_env_do_not_conflict(
    tmp_path: Path, env: dict[str, str]
) -> None:
    path = write_yaml(tmp_path, "max_local_cpu_size: 5\n")
    env["LMTIER_CPU__CAPACITY_BYTES"] = "1GiB"
    assert load_config(path, env=env).cpu.capacity_bytes == GIB


# --- secrets and redaction ---------------------------------------------------------------

REDIS_PASSWORD = "r3dis-Pa55word"
QUERY_TOKEN = "q-T0ken-value"
AWS_KEY_ID = "AKIAEXAMPLEKEYID0001"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
SECRETS = (REDIS_PASSWORD, QUERY_TOKEN, AWS_KEY_ID, AWS_SECRET)


def secret_config_yaml() -> str:
    return f"""
redis:
  url: "rediss://default:{REDIS_PASSWORD}@cache:6380/0?password={QUERY_TOKEN}&db=1"
s3:
  bucket: kv-cache
  access_key_id: {AWS_KEY_ID}
  secret_access_key: {AWS_SECRET}
"""


def test_secrets_never_appear_in_repr_str_dict_or_logs(
    tmp_path: Path, env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    cfg = load_config(write_yaml(tmp_path, secret_config_yaml()), env=env)
    records = " ".join(record.getMessage() for record in caplog.records)
    assert "loaded config" in caplog.text  # the loader did log the config
    for text in (
        repr(cfg),
        str(cfg),
        repr(cfg.to_dict()),
        str(cfg.to_dict()),
        caplog.text,
        records,
    ):
        for secret in SECRETS:
            assert secret not in text
    assert cfg.to_dict()["redis"]["url"] == "rediss://default:***@cache:6380/0?password=***"
    assert cfg.to_dict()["s3"]["secret_access_key"] == "**********"


def test_lmcache_remote_url_password_stays_out_of_logs(
    env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    cfg = load_config(env=env, overrides={"remote_url": f"redis://:{REDIS_PASSWORD}@h:6379"})
    assert "LMCache key 'remote_url' mapped to ['redis.url']" in caplog.text
    assert REDIS_PASSWORD not in caplog.text
    assert REDIS_PASSWORD not in repr(cfg)


def test_secrets_from_env_are_wrapped_too(env: dict[str, str]) -> None:
    env |= {
        "LMTIER_REDIS__URL": f"redis://:{REDIS_PASSWORD}@h",
        "LMTIER_S3__BUCKET": "kv-cache",
        "LMTIER_S3__ACCESS_KEY_ID": AWS_KEY_ID,
        "LMTIER_S3__SECRET_ACCESS_KEY": AWS_SECRET,
    }
    cfg = load_config(env=env)
    for secret in SECRETS:
        assert secret not in repr(cfg)
    assert cfg.s3.secret_access_key is not None
    assert cfg.s3.secret_access_key.reveal() == AWS_SECRET


def test_reveal_returns_the_secrets(tmp_path: Path, env: dict[str, str]) -> None:
    cfg = load_config(write_yaml(tmp_path, secret_config_yaml()), env=env)
    assert cfg.redis.url is not None
    assert cfg.redis.url.reveal() == (
        f"rediss://default:{REDIS_PASSWORD}@cache:6380/0?password={QUERY_TOKEN}&db=1"
    )
    assert cfg.s3.access_key_id == Secret(AWS_KEY_ID)
    assert cfg.s3.access_key_id is not None
    assert cfg.s3.access_key_id.reveal() == AWS_KEY_ID
    assert cfg.s3.secret_access_key is not None
    assert cfg.s3.secret_access_key.reveal() == AWS_SECRET


def test_unredacted_dict_round_trips(tmp_path: Path, env: dict[str, str]) -> None:
    cfg = load_config(write_yaml(tmp_path, secret_config_yaml()), env=env)
    plain = cfg.to_dict(redact=False)
    assert plain["s3"]["secret_access_key"] == AWS_SECRET
    assert config_from_dict(plain, env=env) == cfg


def test_bad_secret_value_error_does_not_quote_it(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=r"^s3\.access_key_id: must be a string, got int$"):
        config_from_dict({"s3": {"access_key_id": 12345678, "secret_access_key": "x"}}, env=env)


def test_bad_redis_url_error_is_redacted(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"redis": {"url": f"http://u:{REDIS_PASSWORD}@h"}}, env=env)
    assert REDIS_PASSWORD not in str(info.value)
    assert "http://u:***@h" in str(info.value)


def test_secret_repr_equality_and_hash() -> None:
    secret = Secret("s3cr3t")
    assert repr(secret) == str(secret) == f"{secret}" == "Secret('**********')"
    assert secret == Secret("s3cr3t")
    assert secret != Secret("other")
    assert secret != "s3cr3t"
    assert hash(secret) == hash(Secret("something else entirely"))
    assert len({secret, Secret("s3cr3t")}) == 1


def test_secret_url_repr_equality_and_scheme() -> None:
    url = SecretURL("Redis://user:pw1234@h:1/0")
    assert repr(url) == "SecretURL('Redis://user:***@h:1/0')"
    assert str(url) == "Redis://user:***@h:1/0"
    assert url.scheme == "redis"
    assert url == SecretURL("Redis://user:pw1234@h:1/0")
    assert url != SecretURL("Redis://user:other@h:1/0")
    assert hash(url) == hash(SecretURL("Redis://user:other@h:1/0"))


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("redis://:pw@h:6379", "redis://:***@h:6379"),
        ("redis://user:pw@h", "redis://user:***@h"),
        ("redis://user@h", "redis://user@h"),
        # A secret value runs to the end: an unencoded & or # in it would leak the rest.
        ("redis://h/0?password=pw&db=1", "redis://h/0?password=***"),
        ("redis://h/0?db=1&TOKEN=t", "redis://h/0?db=1&TOKEN=***"),
        ("https://h/?X-Amz-Signature=abc&x=1", "https://h/?X-Amz-Signature=***"),
        ("redis://u:p/w@rd@h:1/0", "redis://u:***@h:1/0"),
        ("redis://:pa#ss@h:1/0", "redis://:***@h:1/0"),
        ("redis://u:a?b/c#d@h:1/0?db=2", "redis://u:***@h:1/0?db=2"),
        ("unix:///run/redis.sock?password=pw", "unix:///run/redis.sock?password=***"),
        ("redis://h/0?password=pw#frag", "redis://h/0?password=***"),
        ("redis://h/0#frag", "redis://h/0#frag"),
        ("not a url", "not a url"),
        ("", ""),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


_PASSWORD_CHARS = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="@?#&=:%+/\\"),
    min_size=6,
    max_size=30,
)


_ANY_PASSWORD = st.text(min_size=1, max_size=40).filter(lambda p: p.strip() != "")
"""Any text at all, every URL delimiter included (@ ? # & = : / % + space), unencoded."""


@given(
    scheme=st.sampled_from(["redis", "rediss", "unix", "http"]),
    user=st.sampled_from(["", "default", "u"]),
    password=_ANY_PASSWORD,
    after=st.sampled_from(["cache:6380/0", "cache/0?db=1", "h:1/0#f", "/run/r.sock"]),
)
def test_redaction_holds_for_any_password(
    scheme: str, user: str, password: str, after: str
) -> None:
    query = "&" if "?" in after else "?"
    public = f"SecretURL('{scheme}://{user}:***@{after}{query}db=1&password=&token=')"
    assume(len(password) >= 3 and password not in public)  # none of the rest spells it
    for url in (
        f"{scheme}://{user}:{password}@{after}",
        f"{scheme}://{after}{query}db=1&password={password}",
        f"{scheme}://{user}:{password}@{after}{query}token={password}",
    ):
        for shown in (redact_url(url), repr(SecretURL(url)), str(SecretURL(url))):
            assert password not in shown


@given(password=_ANY_PASSWORD)
def test_config_errors_and_reprs_never_show_any_password(password: str) -> None:
    secret = f"Zq9{password}"  # a prefix no repr or message holds by chance
    url = f"redis://default:{secret}@cache:6379/0"
    env = {"HOME": "/nonexistent", "LMTIER_REDIS__URL": url}
    try:
        shown = repr(load_config(env=env))
    except ConfigError as exc:
        shown = str(exc)
    assert secret not in shown


@given(user=st.sampled_from(["", "default", "u"]), password=_PASSWORD_CHARS, token=_PASSWORD_CHARS)
def test_redact_url_never_shows_password_or_token(user: str, password: str, token: str) -> None:
    url = f"rediss://{user}:{password}@cache.example:6380/0?token={token}"
    shown = f"rediss://{user}:***@cache.example:6380/0?token=***"
    wrapped = f"SecretURL({shown!r})"  # what repr shows: the class name is not a leak
    assume(password not in wrapped and token not in wrapped)
    assert redact_url(url) == shown
    assert repr(SecretURL(url)) == wrapped
    assert password not in repr(SecretURL(url))


@pytest.mark.parametrize("url", ["redis://u:p#w@h:1/0", "redis://:a/b@h", "rediss://d:x?y@h:6380"])
def test_unencoded_delimiters_in_a_password_are_a_clear_error(
    url: str, env: dict[str, str]
) -> None:
    with pytest.raises(ConfigError, match=r"^redis\.url: .*percent-encode") as info:
        config_from_dict({"redis": {"url": url}}, env=env)
    secret = url.partition("://")[2].rpartition("@")[0].partition(":")[2]
    assert secret not in str(info.value)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"chunk_size": 2**40}, "at most 65536"),
        ({"cpu": {"capacity_bytes": 10**30}}, "at most 2\\*\\*60 bytes"),
        ({"disk": {"capacity_bytes": "10000000EiB"}}, "unknown unit|at most"),
        ({"disk": {"file_mode": "0644x"}}, "octal mode"),
        ({"disk": {"file_mode": "0400"}}, "owner can read and write"),
        ({"integrity": {"key": "k", "key_file": "/k"}}, "set one, not both"),
    ],
)
def test_out_of_range_values_fail_at_load(
    data: dict[str, object], message: str, env: dict[str, str]
) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_dict(data, env=env)


def test_a_yaml_alias_bomb_is_quoted_briefly(tmp_path: Path, env: dict[str, str]) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 30)]
    lines.append("chunk_size: *a29")  # 3**29 leaves if expanded
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env=env)
    assert len(str(info.value)) < 400


def test_an_lmcache_config_file_is_read_when_lmtier_has_none(
    tmp_path: Path, env: dict[str, str]
) -> None:
    path = write_yaml(
        tmp_path,
        "chunk_size: 512\nlocal_cpu: true\nmax_local_cpu_size: 2\n"
        "local_disk: 'file:///var/kv/'\nmax_local_disk_size: 10\n"
        "remote_url: 'redis://cache:6379/0'\n",
        name="lmcache.yaml",
    )
    env["LMCACHE_CONFIG_FILE"] = str(path)
    cfg = load_config(env=env)
    assert (cfg.chunk_size, cfg.cpu.capacity_bytes, cfg.disk.path) == (
        512,
        2 * GIB,
        Path("/var/kv"),
    )
    assert cfg.redis.url == SecretURL("redis://cache:6379/0")
    env["LMTIER_CONFIG"] = str(write_yaml(tmp_path, "chunk_size: 64\n"))
    assert load_config(env=env).chunk_size == 64  # lmtier's own file wins


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("remote_serde: naive\n", "not supported by lmtier: lmtier stores one chunk format"),
        ("enable_blending: true\n", "CacheBlend"),
        ("save_decode_cache: true\n", "save_decode_tokens"),
        ("enable_p2p: true\n", "its own peer tier.*set peer.enabled"),  # "not supported yet"
        ("chunk_sizes: 256\n", r"unknown LMCache config key 'chunk_sizes' \(did you mean"),
    ],
)
def test_lmcache_keys_without_a_counterpart_say_so(
    tmp_path: Path, env: dict[str, str], text: str, words: str
) -> None:
    env["LMCACHE_CONFIG_FILE"] = str(write_yaml(tmp_path, text, name="lmcache.yaml"))
    with pytest.raises(ConfigError, match=words) as info:
        load_config(env=env)
    assert "lmcache.yaml" in str(info.value)
    if "chunk_sizes" not in text:  # pasted into an lmtier file: the same answer
        with pytest.raises(ConfigError, match="not supported by lmtier"):
            config_from_dict(yaml.safe_load(text), env=env)


def test_queue_depth_and_write_policy_reach_the_tier(env: dict[str, str]) -> None:
    cfg = config_from_dict({"disk": {"write_policy": "write_back", "queue_depth": 8}}, env=env)
    assert (cfg.disk.write_policy, cfg.disk.queue_depth) == ("write_back", 8)
    with pytest.raises(ConfigError, match=r"^redis\.write_policy: "):
        config_from_dict({"redis": {"write_policy": "sometimes"}}, env=env)


def test_connection_timers_are_settings_from_file_and_env(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """sidecar.keepalive_s and sidecar.handshake_timeout_s: 10 s unless set (the
    constants they replaced), from a file or the environment, and bounded."""
    defaults = load_config(env=env).sidecar
    assert (defaults.keepalive_s, defaults.handshake_timeout_s) == (10.0, 10.0)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"sidecar": {"keepalive_s": 0.5}}))
    env |= {"LMTIER_SIDECAR__HANDSHAKE_TIMEOUT_S": "0.25"}
    side = load_config(path, env=env).sidecar
    assert (side.keepalive_s, side.handshake_timeout_s) == (0.5, 0.25)
    for key, bad in (("keepalive_s", 0.01), ("handshake_timeout_s", 7200)):
        with pytest.raises(ConfigError, match=f"sidecar.{key}"):
            config_from_dict({"sidecar": {key: bad}}, env=env)
