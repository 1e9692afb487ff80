"""``lmtier inspect``: a chunk's header and checks, from a file or by key; bad bytes
are one-line errors (exit 2), never a traceback, and nothing is changed."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from lmtier.chunks.format import FLAG_UNSEALED, PREFIX, decode
from lmtier.chunks.keys import ChunkKey
from support.ops_helpers import chunk_file, run_here, store_signed, write_config


@pytest.fixture
def stored(tmp_path: Path) -> tuple[Path, list[ChunkKey]]:
    return store_signed(tmp_path)


def inspect(monkeypatch: pytest.MonkeyPatch, config: Path, *args: str) -> tuple[int, str, str]:
    return run_here(monkeypatch, "--config", str(config), "inspect", *args)


def test_human_output_by_key_from_the_disk_tier(
    stored: tuple[Path, list[ChunkKey]], monkeypatch: pytest.MonkeyPatch
) -> None:
    config_path, keys = stored
    code, out, err = inspect(monkeypatch, config_path, keys[0].hex())
    assert code == 0, err
    fields = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.splitlines())
    assert fields["chunk"] == f"disk {chunk_file(config_path, keys[0])}"
    assert fields["key"] == keys[0].hex()
    assert fields["shape"] == "2x2x16x2x8 (LKTHD)"
    assert fields["header checksum"] == fields["payload checksum"] == "ok"
    assert fields["mac"] == "valid" and fields["key matches"] == "yes"


def test_corrupt_payload_is_reported_and_left_in_place(
    stored: tuple[Path, list[ChunkKey]], monkeypatch: pytest.MonkeyPatch
) -> None:
    config_path, keys = stored
    path = chunk_file(config_path, keys[2])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last payload byte
    path.write_bytes(bytes(data))
    code, out, err = inspect(monkeypatch, config_path, keys[2].hex(), "--json")
    assert code == 2
    report = json.loads(out)
    assert report["payload_checksum"] == "bad" and report["mac"] == "invalid"
    assert err.splitlines() == [
        "lmtier inspect: error: payload checksum mismatch: the KV bytes changed after "
        "sealing; MAC invalid: not signed with the configured integrity key"
    ]
    assert path.read_bytes() == bytes(data)  # inspecting deleted nothing


def test_an_unsealed_chunk_is_reported(
    stored: tuple[Path, list[ChunkKey]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config_path, keys = stored
    data = bytearray(chunk_file(config_path, keys[0]).read_bytes())
    # The flags live in the prefix, outside the header's checksum: set UNSEALED there.
    magic, version, _, header_len, reserved, header_xxh = PREFIX.unpack_from(data)
    PREFIX.pack_into(data, 0, magic, version, FLAG_UNSEALED, header_len, reserved, header_xxh)
    unsealed = tmp_path / f"{keys[0].hex()}.lmtc"
    unsealed.write_bytes(bytes(data))
    code, out, err = inspect(monkeypatch, config_path, str(unsealed), "--json")
    assert code == 2
    report = json.loads(out)
    assert report["flags"] == ["unsealed"] and report["payload_checksum"] == "unsealed"
    assert "unsealed: never checksummed" in err


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda data: data[:100], "truncated: 100 bytes, the header ends at"),
        (lambda data: data[:-7], "truncated:"),
        (lambda data: b"", "truncated: 0 bytes"),
        (lambda data: b"#!/bin/sh\necho not a chunk\n", "not a chunk: chunk starts with"),
        (lambda data: data[:30] + bytes([data[30] ^ 1]) + data[31:], "corrupt header:"),
    ],
    ids=["header-cut", "payload-cut", "empty", "foreign", "header-bit"],
)
def test_unreadable_bytes_are_a_one_line_error(
    stored: tuple[Path, list[ChunkKey]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    damage: Callable[[bytes], bytes],
    message: str,
) -> None:
    config_path, keys = stored
    bad = tmp_path / "bad.lmtc"
    bad.write_bytes(damage(chunk_file(config_path, keys[0]).read_bytes()))
    code, out, err = inspect(monkeypatch, config_path, str(bad))
    assert code == 2 and out == ""
    assert err.startswith(f"lmtier inspect: error: {bad}: {message}")
    assert len(err.splitlines()) == 1


def test_a_chunk_under_another_name_or_key(
    stored: tuple[Path, list[ChunkKey]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config_path, keys = stored
    misplaced = tmp_path / f"{keys[1].hex()}.lmtc"
    shutil.copyfile(chunk_file(config_path, keys[0]), misplaced)
    code, out, err = inspect(monkeypatch, config_path, str(misplaced), "--json")
    assert code == 2 and json.loads(out)["key_matches"] is False
    assert f"holds key {keys[0].hex()}, not {keys[1].hex()}: misplaced" in err
    renamed = tmp_path / "some-copy"
    shutil.copyfile(chunk_file(config_path, keys[0]), renamed)
    code, out, _ = inspect(monkeypatch, config_path, str(renamed), "--json")
    assert code == 0 and json.loads(out)["key_matches"] is None  # not a chunk file name


def test_mac_states_follow_the_configured_key(
    stored: tuple[Path, list[ChunkKey]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config_path, keys = stored
    path = str(chunk_file(config_path, keys[0]))
    assert decode(Path(path).read_bytes()).mac != bytes(32)  # signed when stored
    no_key = write_config(tmp_path / "plain")
    other_key = write_config(tmp_path / "other", integrity={"key": "o" * 32})
    code, out, _ = inspect(monkeypatch, no_key, path, "--json")
    assert code == 0 and json.loads(out)["mac"] == "present"
    code, out, err = inspect(monkeypatch, other_key, path, "--json")
    assert code == 2 and json.loads(out)["mac"] == "invalid" and "MAC invalid" in err


def test_keys_no_tier_holds_and_targets_that_are_neither(
    stored: tuple[Path, list[ChunkKey]], monkeypatch: pytest.MonkeyPatch
) -> None:
    config_path, keys = stored
    absent = bytes(reversed(keys[0])).hex()
    code, out, err = inspect(monkeypatch, config_path, absent)
    assert code == 1 and out == ""
    assert err.strip() == f"lmtier inspect: chunk {absent} is not in any configured tier"
    code, _, err = inspect(monkeypatch, config_path, "--tier", "redis", keys[0].hex())
    assert code == 2 and "--tier redis: no such tier in the config (configured: disk)" in err
    path = str(chunk_file(config_path, keys[0]))
    code, _, err = inspect(monkeypatch, config_path, "--tier", "disk", path)
    assert code == 2 and "--tier says where to read a KEY" in err
    code, _, err = inspect(monkeypatch, config_path, "not-a-key")
    assert code == 2
    assert err.strip() == (
        "lmtier inspect: error: 'not-a-key' is neither a file nor a chunk key (64 hex digits)"
    )
