"""``lmtier inspect`` as a process: a good chunk file in JSON, and a truncated one is a
one-line error (exit 2) with no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmtier.chunks.format import PREFIX_LEN
from lmtier.chunks.keys import ChunkKey
from support.ops_helpers import CHUNK, SPEC, chunk_file, run_process, store_signed

pytestmark = pytest.mark.integration


@pytest.fixture
def stored(tmp_path: Path) -> tuple[Path, list[ChunkKey]]:
    return store_signed(tmp_path)


def test_a_good_chunk_file(stored: tuple[Path, list[ChunkKey]]) -> None:
    config_path, keys = stored
    path = chunk_file(config_path, keys[1])
    done = run_process("--config", str(config_path), "inspect", str(path), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["key"] == keys[1].hex() and report["namespace"] == keys[1][:16].hex()
    assert (report["dtype"], report["layout"], report["tokens"]) == ("float32", "LKTHD", CHUNK)
    assert report["shape"] == list(SPEC.shape(CHUNK))
    assert report["nbytes"] == SPEC.bytes_per_token * CHUNK
    assert report["size"] == path.stat().st_size and report["trailing_bytes"] == 0
    assert report["ctime"].endswith("+00:00") and report["flags"] == []
    assert (report["header_checksum"], report["payload_checksum"]) == ("ok", "ok")
    assert report["mac"] == "valid" and report["key_matches"] is True
    assert report["problems"] == []


def test_a_truncated_file_in_a_process_has_no_traceback(
    stored: tuple[Path, list[ChunkKey]], tmp_path: Path
) -> None:
    config_path, keys = stored
    bad = tmp_path / "cut.lmtc"
    bad.write_bytes(chunk_file(config_path, keys[0]).read_bytes()[: PREFIX_LEN + 10])
    done = run_process("--config", str(config_path), "inspect", str(bad))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"lmtier inspect: error: {bad}: truncated: 34 bytes, the")
    assert len(done.stderr.splitlines()) == 1  # no traceback, no log lines
