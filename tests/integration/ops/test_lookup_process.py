"""``lmtier lookup`` as a process: token ids from stdin, the disk tier's share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.ops_helpers import (
    CHUNK,
    GEOMETRY,
    MODEL_ID,
    run_process,
    store,
    write_config,
)

pytestmark = pytest.mark.integration

PROMPT = list(range(100, 100 + 6 * CHUNK + 5))  # six full chunks and a tail


def test_token_ids_from_stdin_report_the_disk_tier(tmp_path: Path) -> None:
    config_path = write_config(tmp_path)
    store(config_path, PROMPT[: 4 * CHUNK])  # the first four chunks only
    done = run_process(
        "--config",
        str(config_path),
        "lookup",
        *GEOMETRY,
        "--json",
        stdin=" ".join(map(str, PROMPT)),
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["source"] == "embedded" and report["model_id"] == MODEL_ID
    assert (report["tokens"], report["full_chunks"]) == (len(PROMPT), 6)
    assert (report["cached_tokens"], report["cached_chunks"]) == (4 * CHUNK, 4)
    assert report["tokens_by_tier"] == {"disk": 4 * CHUNK}
