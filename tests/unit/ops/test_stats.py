"""``lmtier stats``: the embedded tiers' state, the JSON schema, the table, --watch."""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

import pytest

from lmtier import LMTier
from lmtier.config import load_config
from lmtier.ops import render, stats
from lmtier.ops.stats import TIER_FIELDS, schema_problems, snapshot
from support.ops_helpers import (
    CHUNK,
    SPEC,
    kv_of,
    run_here,
    store,
    write_config,
)

# What the sidecar's Stats call carries: numbers only, as floats, nested names flattened.
SIDECAR_STATS: dict[str, dict[str, object]] = {
    "s3": {"hits": 1.0, "misses": 3.0, "errors": 2.0, "read_latency.n": 4.0},
    "memo": {"hits": 0.0, "misses": 0.0},
    "disk": {
        "capacity_bytes": 1024.0**3,
        "used_bytes": 3.0 * 1024**2,
        "chunks": 12.0,
        "pinned_bytes": 0.0,
        "hits": 9.0,
        "misses": 1.0,
        "read_latency.n": 10.0,
        "read_latency.p50_s": 0.000256,
        "read_latency.p99_s": 0.004096,
        "lookup_latency.n": 0.0,
        "lookup_latency.p50_s": 0.0,
        "queue_depth": 3.0,
        "breaker_opens": 1.0,
    },
    "cpu": {"capacity_bytes": 2.0 * 1024**2, "used_bytes": 0.0, "chunks": 0.0, "hits": 0.0},
    "sidecar": {
        "sessions": 2.0,
        "clients": 1.0,
        "leases": 0.0,
        "leases_expired": 0.0,
        "slabs_total": 64.0,
        "slabs_in_use": 5.0,
    },
}


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    path = write_config(tmp_path)
    store(path, list(range(5 * CHUNK + 3)))  # five chunks on disk
    return path


@pytest.mark.parametrize("rich", [True, False], ids=["rich", "plain"])
def test_table_has_a_column_per_tier_and_readable_sizes(
    config_path: Path, monkeypatch: pytest.MonkeyPatch, rich: bool
) -> None:
    monkeypatch.setattr(render, "have_rich", lambda: rich)
    code, out, err = run_here(monkeypatch, "--config", str(config_path), "stats")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("lmtier stats: embedded")
    assert lines[1].split() == ["cpu", "disk"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[3:] if line.strip()}
    assert rows["capacity"] == ["1", "MiB", "64", "MiB"]
    assert rows["chunks"] == ["-", "5"]
    assert rows["breaker"] == ["-", "closed"]


def test_sidecar_numbers_become_the_schema_in_waterfall_order() -> None:
    report = snapshot(SIDECAR_STATS, "sidecar", now=1.5)
    assert schema_problems(report) == []
    assert [row["name"] for row in report["tiers"]] == ["cpu", "disk", "s3", "memo"]
    disk = report["tiers"][1]
    assert disk["chunks"] == 12 and isinstance(disk["chunks"], int)
    assert disk["hit_ratio"] == pytest.approx(0.9)
    assert (disk["read_p50_s"], disk["read_p99_s"]) == (0.000256, 0.004096)
    assert disk["lookup_p50_s"] is None  # no lookup measured: null, not 0
    assert disk["queue_depth"] == 3 and disk["breaker"] is None  # states do not travel
    s3 = report["tiers"][2]
    assert s3["capacity_bytes"] is None and s3["errors"] == 2 and s3["hit_ratio"] == 0.25
    assert s3["read_p50_s"] is None  # counted but its quantiles absent: null
    assert report["sidecar"] == {
        "sessions": 2,
        "clients": 1,
        "leases": 0,
        "leases_expired": 0,
        "slabs_total": 64,
        "slabs_in_use": 5,
    }


def test_every_field_is_present_when_a_tier_reports_nothing() -> None:
    report = snapshot({"mystery": {}}, "embedded", now=0.0)
    assert schema_problems(report) == []
    row = report["tiers"][0]
    assert list(row) == list(TIER_FIELDS)
    assert all(row[field] is None for field in TIER_FIELDS if field != "name")
    headers, rows = stats._table(report)
    assert headers == ["", "mystery"]
    assert {cells[1] for cells in rows} == {"-"}


def test_schema_problems_name_what_is_wrong() -> None:
    good = snapshot(SIDECAR_STATS, "sidecar", now=1.0)
    assert schema_problems([]) == ["not a JSON object: list"]
    assert schema_problems({**good, "sidecar": {"sessions": 1}})[0].startswith("sidecar")
    broken = json.loads(json.dumps(good))
    broken["tiers"][0]["chunks"] = "many"
    assert schema_problems(broken) == ["tiers[0].chunks is 'many', not int|null"]
    del broken["tiers"][1]["evictions"]
    assert "tiers[1] does not have exactly the fields" in schema_problems(broken)[1]


def test_watch_on_a_terminal_draws_in_place(
    config_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(time, "sleep", sleep)
    monkeypatch.setattr(sys, "stdout", screen)
    args = argparse.Namespace(
        sidecar=None,
        sidecar_token_file=None,
        model_id=None,
        cache_salt=None,
        json=False,
        watch=0.5,
    )
    assert stats.cmd_stats(args, load_config(config_path)) == 0
    assert sleeps == [0.5, 0.5]
    assert "capacity" in screen.getvalue() and "disk" in screen.getvalue()


def test_a_sidecar_that_does_not_answer_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_path = write_config(tmp_path)
    target = f"unix://{tmp_path}/nobody.sock"
    code, out, err = run_here(
        monkeypatch, "--config", str(config_path), "stats", "--sidecar", target
    )
    assert code == 2 and out == ""
    assert f"lmtier stats: error: the sidecar at {target} did not answer" in err
    assert "Traceback" not in err


def test_a_remote_tier_that_does_not_answer_shows_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing listens on this socket: the Redis tier is down from the start.
    config_path = write_config(tmp_path, redis={"url": f"unix://{tmp_path}/no-redis.sock"})
    code, out, err = run_here(monkeypatch, "--config", str(config_path), "stats", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert schema_problems(report) == []
    redis = report["tiers"][-1]
    assert redis["name"] == "redis" and redis["errors"] >= 1
    assert redis["capacity_bytes"] is None  # Redis does not say how much it holds


def test_pins_refused_is_shown_in_json_and_the_table() -> None:
    entries = {
        "disk": {**SIDECAR_STATS["disk"], "pinned_bytes": 4096.0, "pins_refused": 3.0},
        "s3": {"hits": 0.0, "pins_refused": 0.0},  # every tier counts; s3 cannot pin
    }
    report = snapshot(entries, "sidecar", now=1.0)
    assert schema_problems(report) == []
    disk, s3 = report["tiers"]
    assert (disk["pins_refused"], s3["pins_refused"]) == (3, None)
    _, rows = stats._table(report)
    assert ["pins refused", "3", "-"] in rows


def test_embedded_json_counts_the_pins_a_tier_refused(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        disk={
            "path": str(tmp_path / "chunks"),
            "capacity_bytes": "64MiB",
            "max_pinned_fraction": 0.0,
        },
    )
    tokens = list(range(2 * CHUNK))
    with LMTier.open(load_config(path), kv=SPEC, model_id="m") as cache:
        cache.store(tokens, kv_of(tokens))
        cache.flush()
        assert cache.pin_keys(cache.keys(tokens))["disk"] == 0, "a cap of 0 refuses every pin"
        report = snapshot(cache.stats(), "embedded")
    disk = next(row for row in report["tiers"] if row["name"] == "disk")
    assert disk["pins_refused"] == 2
