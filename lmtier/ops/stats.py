"""``lmtier stats``: what each tier holds and how it is doing.

Per tier, in waterfall order: capacity, bytes used, chunks, pinned bytes and pins
refused by the tier's cap (``max_pinned_fraction``), hits and
hit ratio, p50/p99 latency of reads, lookups and writes, failures (errors, corrupt
and unservable chunks, calls skipped by an open breaker, writes dropped by a full
queue), the breaker's state, the write queue's depth and evictions.

Two sources:

* **embedded** (the default): the config's tiers, opened in this process
  (:mod:`.caches`). Counters count since this process opened them, so they are
  mostly zeros; what is worth reading is the tiers' state: the disk directory's
  capacity, bytes and chunks (shared by every process using it), and whether a
  remote tier answers (each snapshot first looks up one key no model has, so one
  that does not answer shows errors, then an open breaker). This process's host
  memory is not an engine's: the CPU row shows the configured capacity, and ``-``
  (null) for the rest, which no other process can see.
* **sidecar** (``--sidecar URL``): the sidecar's own tiers and counters since it
  started, and its gauges (sessions, clients, leases, slabs). Its breaker states do
  not travel (the Stats call carries numbers only): ``breaker`` is null there.

``--json`` prints one object per snapshot (``--watch``: one per line), schema
``lmtier.stats/1``; a new field may be added, none is renamed or removed without a
new schema name::

    {"schema": "lmtier.stats/1",
     "source": "embedded" | "sidecar",
     "time": <unix seconds, float>,
     "tiers": [                            # waterfall order: cpu, disk, redis, s3, extras
       {"name": str,
        "capacity_bytes": int|null, "used_bytes": int|null, "chunks": int|null,
        "pinned_bytes": int|null,          # null: the tier cannot tell (Redis, S3)
        "pins_refused": int|null,          # past the pin cap; null: the tier does not pin
        "hits": int|null, "misses": int|null,
        "hit_ratio": float|null,           # hits / (hits + misses); null before any read
        "read_p50_s": float|null, "read_p99_s": float|null,    # null: nothing measured
        "lookup_p50_s": float|null, "lookup_p99_s": float|null,
        "write_p50_s": float|null, "write_p99_s": float|null,
        "errors": int|null, "corrupt": int|null, "unservable": int|null,
        "skipped": int|null, "queue_drops": int|null,
        "queue_waits": int|null,           # stores that waited for room (back-pressure)
        "queue_depth": int|null,           # writes waiting; null: no write queue (cpu)
        "breaker": "closed"|"open"|"half_open"|null,
        "evictions": int|null}],
     "sidecar": {"sessions": int, "clients": int, "leases": int, "leases_expired": int,
                 "slabs_total": int, "slabs_in_use": int} | null}   # null: embedded

Latencies are the upper bounds of power-of-two microsecond buckets
(:class:`~lmtier.storage.stats.LatencyHistogram`), so they are within 2x.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from lmtier.chunks.keys import ChunkKey
from lmtier.config import LMTierConfig
from lmtier.ops import render

__all__ = ["SCHEMA", "SIDECAR_FIELDS", "TIER_FIELDS", "cmd_stats", "schema_problems", "snapshot"]

SCHEMA = "lmtier.stats/1"
"""The ``schema`` value of ``--json`` output (module docstring)."""

_COUNTS = (
    "errors",
    "corrupt",
    "unservable",
    "skipped",
    "queue_drops",
    "queue_waits",
    "queue_depth",
)
"""The tier fields that are plain counts, in output order (the JSON and the table)."""

TIER_FIELDS: Mapping[str, str] = MappingProxyType(
    {
        "name": "str",
        **dict.fromkeys(("capacity_bytes", "used_bytes", "chunks", "pinned_bytes"), "int|null"),
        "pins_refused": "int|null",
        **dict.fromkeys(("hits", "misses"), "int|null"),
        "hit_ratio": "float|null",
        **{
            f"{op}_{q}_s": "float|null"
            for op in ("read", "lookup", "write")
            for q in ("p50", "p99")
        },
        **dict.fromkeys(_COUNTS, "int|null"),
        "breaker": "str|null",
        "evictions": "int|null",
    }
)
"""Every field of a ``tiers`` entry and its JSON type, in output order."""
SIDECAR_FIELDS = ("sessions", "clients", "leases", "leases_expired", "slabs_total", "slabs_in_use")
"""The sidecar's gauges (ints) in the ``sidecar`` entry."""
WATERFALL = ("cpu", "disk", "redis", "s3")
"""The built-in tiers in the order a lookup walks them; other tiers come after."""
_TOP = ("schema", "source", "time", "tiers", "sidecar")


def _number(value: object) -> float | None:
    """A stats value as a number (the sidecar sends floats), or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _int(value: object) -> int | None:
    number = _number(value)
    return None if number is None else round(number)


def _summary(entry: Mapping[str, object], name: str, field: str) -> float | None:
    """A latency summary's field: nested (``{"read_latency": {"p50_s": ..}}``, embedded)
    or flattened (``"read_latency.p50_s"``, from the sidecar)."""
    nested = entry.get(name)
    if isinstance(nested, Mapping):
        return _number(nested.get(field))
    return _number(entry.get(f"{name}.{field}"))


def tier_row(name: str, entry: Mapping[str, object]) -> dict[str, Any]:
    """One ``tiers`` entry of the schema from one tier's stats (``LMTier.stats()``)."""
    row: dict[str, Any] = {"name": name}
    for field, kind in TIER_FIELDS.items():
        if kind == "int|null":  # counters and sizes, under their own names
            row[field] = _int(entry.get(field))
    reads = (row["hits"] or 0) + (row["misses"] or 0)
    row["hit_ratio"] = (row["hits"] or 0) / reads if reads else None
    for op in ("read", "lookup", "write"):
        measured = _summary(entry, f"{op}_latency", "n")
        for q in ("p50", "p99"):
            value = _summary(entry, f"{op}_latency", f"{q}_s") if measured else None
            row[f"{op}_{q}_s"] = value
    breaker = entry.get("breaker")
    row["breaker"] = breaker if isinstance(breaker, str) else None
    if row["pinned_bytes"] is None:  # every tier counts refusals; only a pinning one has any
        row["pins_refused"] = None
    return {field: row[field] for field in TIER_FIELDS}


def snapshot(
    stats: Mapping[str, Mapping[str, object]],
    source: str,
    *,
    config: LMTierConfig | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The ``lmtier.stats/1`` object of ``LMTier.stats()``'s answer.

    ``config`` (embedded source): the CPU row shows its configured capacity and
    nothing of this process's own, empty, host memory (module docstring).
    """
    order = {name: index for index, name in enumerate(WATERFALL)}
    names = [name for name in stats if name != "sidecar"]
    names.sort(key=lambda name: order.get(name, len(WATERFALL)))  # stable: extras keep order
    tiers = [tier_row(name, stats[name]) for name in names]
    if config is not None:
        for row in tiers:
            if row["name"] == "cpu":
                row["capacity_bytes"] = config.cpu.capacity_bytes if config.cpu.enabled else 0
                row.update(dict.fromkeys(set(TIER_FIELDS) - {"name", "capacity_bytes"}))
    gauges = stats.get("sidecar")
    sidecar = None
    if gauges is not None:
        sidecar = {name: _int(gauges.get(name)) or 0 for name in SIDECAR_FIELDS}
    return {
        "schema": SCHEMA,
        "source": source,
        "time": time.time() if now is None else now,
        "tiers": tiers,
        "sidecar": sidecar,
    }


_JSON_TYPES: Mapping[str, Callable[[object], bool]] = MappingProxyType(
    {
        "null": lambda value: value is None,
        "str": lambda value: isinstance(value, str),
        "int": lambda value: isinstance(value, int) and not isinstance(value, bool),
        "float": lambda value: isinstance(value, float),
    }
)


def _has_type(value: object, kind: str) -> bool:
    """Whether ``value`` (parsed JSON) is of the schema type ``kind`` (``int|null``)."""
    return any(_JSON_TYPES[name](value) for name in kind.split("|"))


def schema_problems(report: object) -> list[str]:
    """What makes ``report`` (``--json`` output, parsed) not an ``lmtier.stats/1``
    object; empty when it is one. For consumers that check before they trust it."""
    if not isinstance(report, dict):
        return [f"not a JSON object: {type(report).__name__}"]
    problems = [f"missing {key!r}" for key in _TOP if key not in report]
    if problems:
        return problems
    if report["schema"] != SCHEMA:
        problems.append(f"schema is {report['schema']!r}, not {SCHEMA!r}")
    if report["source"] not in ("embedded", "sidecar"):
        problems.append(f"source is {report['source']!r}")
    if not _has_type(report["time"], "float"):
        problems.append("time is not a float")
    tiers = report["tiers"]
    for index, row in enumerate(tiers if isinstance(tiers, list) else [None]):
        if not isinstance(row, dict) or list(row) != list(TIER_FIELDS):
            problems.append(f"tiers[{index}] does not have exactly the fields {list(TIER_FIELDS)}")
            continue
        problems += [
            f"tiers[{index}].{field} is {row[field]!r}, not {kind}"
            for field, kind in TIER_FIELDS.items()
            if not _has_type(row[field], kind)
        ]
    sidecar = report["sidecar"]
    if sidecar is not None and (
        not isinstance(sidecar, dict)
        or sorted(sidecar) != sorted(SIDECAR_FIELDS)
        or not all(_has_type(v, "int") for v in sidecar.values())
    ):
        problems.append(f"sidecar is not null or ints named {list(SIDECAR_FIELDS)}")
    return problems


def _table(report: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of the human table: one column per tier, one row per field
    (tiers are few and fields many, so it fits a terminal however many tiers)."""
    tiers: list[dict[str, Any]] = report["tiers"]
    rows = [
        ["capacity", *(render.format_bytes(t["capacity_bytes"]) for t in tiers)],
        ["used", *(render.format_bytes(t["used_bytes"]) for t in tiers)],
        ["chunks", *(render.format_count(t["chunks"]) for t in tiers)],
        ["pinned", *(render.format_bytes(t["pinned_bytes"]) for t in tiers)],
        ["pins refused", *(render.format_count(t["pins_refused"]) for t in tiers)],
        ["hits", *(render.format_count(t["hits"]) for t in tiers)],
        ["hit ratio", *(render.format_ratio(t["hit_ratio"]) for t in tiers)],
    ]
    for op in ("read", "lookup", "write"):
        latencies = (render.format_latency(t[f"{op}_p50_s"], t[f"{op}_p99_s"]) for t in tiers)
        rows.append([f"{op} p50/p99", *latencies])
    for field in _COUNTS:
        rows.append([field.replace("_", " "), *(render.format_count(t[field]) for t in tiers)])
    rows.append(["breaker", *(t["breaker"] or render.MISSING for t in tiers)])
    rows.append(["evictions", *(render.format_count(t["evictions"]) for t in tiers)])
    return ["", *(t["name"] for t in tiers)], rows


def _title(report: Mapping[str, Any], where: str) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report["time"]))
    title = f"lmtier stats: {where}, {stamp}"
    gauges = report["sidecar"]
    if gauges is not None:
        title += (
            f"\nsidecar: sessions {gauges['sessions']}, clients {gauges['clients']}, "
            f"leases {gauges['leases']}, slabs in use {gauges['slabs_in_use']} of "
            f"{gauges['slabs_total']}"
        )
    return title


def _print(report: Mapping[str, Any], where: str, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report), flush=True)
        return
    headers, rows = _table(report)
    render.print_table(headers, rows, title=_title(report, where))
    sys.stdout.flush()


def _watch(collect: Callable[[], dict[str, Any]], where: str, args: argparse.Namespace) -> None:
    """Print a snapshot every ``args.watch`` seconds until interrupted; redrawn in place
    (``rich.live``) on a terminal, appended otherwise (JSON: one object per line)."""
    if not args.json and sys.stdout.isatty() and render.have_rich():
        from rich.console import Group  # noqa: PLC0415 - optional
        from rich.live import Live  # noqa: PLC0415
        from rich.text import Text  # noqa: PLC0415

        def view() -> Group:
            report = collect()
            return Group(Text(_title(report, where)), render.rich_table(*_table(report)))

        with Live(view(), auto_refresh=False) as live:
            while True:
                time.sleep(args.watch)
                live.update(view(), refresh=True)
    else:
        while True:
            _print(collect(), where, as_json=args.json)
            time.sleep(args.watch)
            if not args.json:
                print()


def cmd_stats(args: argparse.Namespace, config: LMTierConfig) -> int:
    """``lmtier stats`` (module docstring)."""
    from lmtier.kv_spec import KVSpec  # noqa: PLC0415 - torch
    from lmtier.ops.caches import OPS_MODEL_ID, open_cache  # noqa: PLC0415

    # Any namespace can ask for stats: the smallest geometry (2 bytes a token) keeps
    # this process's memory small and fits any sidecar's slabs.
    kv = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8")
    model_id = args.model_id or config.model_id or OPS_MODEL_ID
    source = "sidecar" if args.sidecar else "embedded"
    where = f"sidecar {args.sidecar}" if args.sidecar else "embedded tiers of the config"
    with open_cache(
        config,
        kv,
        sidecar=args.sidecar,
        token_file=args.sidecar_token_file,
        cache_salt=args.cache_salt or "",
        model_id=model_id,
    ) as cache:
        # Embedded, a remote tier is asked nothing until a lookup: one for a key no
        # model has makes one that does not answer show as errors (and its breaker).
        probe = [ChunkKey(cache.namespace().digest + bytes(16))]

        def collect() -> dict[str, Any]:
            if args.sidecar:
                return snapshot(cache.stats(), source)
            cache.lookup_keys(probe)
            return snapshot(cache.stats(), source, config=config)

        if args.watch is None:
            _print(collect(), where, as_json=args.json)
            return 0
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a watch ends
            _watch(collect, where, args)
    return 0
