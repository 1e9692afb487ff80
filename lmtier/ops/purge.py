"""``lmtier purge``: delete one model's KV from every tier, e.g. after a weight update.

Old KV must go, not just miss: a new revision's keys never match the old chunks, but
they would fill the disk, Redis and S3 until evicted or expired. A purge deletes every
chunk of the namespaces the flags name: one per tensor-parallel rank (``--tp-size``),
under one cache salt (``--cache-salt``: one tenant), from the CPU tier (of a sidecar;
an embedded purge's own is empty), the disk directory, Redis (SCAN + UNLINK a page at
a time) and S3 (list + DeleteObjects by prefix).

It counts first (a dry run, printed), then asks for confirmation on a terminal unless
``--yes`` (any answer but yes deletes nothing, says so, and exits 2); without a
terminal it refuses without ``--yes``. ``--dry-run`` only counts.
Through ``--sidecar`` the sidecar purges its own tiers (a token scoped to other
namespaces is refused). Tiers that fail or cannot list their chunks are reported, and
the exit status is 1 then: the KV there may remain.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lmtier.cli import add_namespace_arguments
from lmtier.config import LMTierConfig
from lmtier.ops import render
from lmtier.ops.model_args import resolve_model
from lmtier.storage.purging import PURGE_FAILED, PURGE_UNSUPPORTED

__all__ = ["cmd_purge", "register"]

EXIT_REFUSED = 2


def register(commands: Any) -> None:
    """Add ``lmtier purge`` to the CLI."""
    purge = commands.add_parser(
        "purge",
        help="delete a model's (or one tenant's) KV from every tier",
        description=(
            "Delete every chunk of a model's namespace from every tier (CPU of a sidecar, "
            "disk, Redis, S3): counts first, then asks (or --yes). Name the model as its "
            "engine does: --model DIR, or --model-id with the KV geometry."
        ),
        epilog=(
            "example: lmtier purge --model ~/models/llama-3-8b --model-revision old --yes\n"
            "         lmtier purge --model-id m --num-layers 32 --num-kv-heads 8 "
            "--head-dim 128 --dry-run"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    purge.add_argument(
        "--model", metavar="DIR", help="a local model directory: geometry, id and revision"
    )
    add_namespace_arguments(purge)
    purge.set_defaults(kv_dtype=None, kv_layout=None)
    purge.add_argument(
        "--tp-size", type=int, default=1, help="tensor-parallel size: purge every rank's KV"
    )
    purge.add_argument("--sidecar", metavar="URL", help="purge through this `lmtier serve`")
    purge.add_argument("--sidecar-token-file", metavar="FILE", help="the sidecar's token")
    purge.add_argument("--dry-run", action="store_true", help="count only, delete nothing")
    purge.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    purge.add_argument("--json", action="store_true", help="print one JSON object")
    purge.set_defaults(handler=cmd_purge)


def cmd_purge(args: argparse.Namespace, config: LMTierConfig) -> int:
    """``lmtier purge`` (module docstring); the exit status."""
    from lmtier.ops.caches import open_cache  # noqa: PLC0415 - torch, the tiers

    if args.tp_size < 1:
        print("lmtier purge: error: --tp-size must be >= 1", file=sys.stderr)
        return EXIT_REFUSED
    model = resolve_model(args, config)
    salt = args.cache_salt or ""
    report: dict[str, Any] = {"model_id": model.model_id, "revision": model.revision}
    namespaces: list[dict[str, Any]] = []
    caches = [
        open_cache(
            model.config,
            model.spec,
            sidecar=args.sidecar,
            token_file=args.sidecar_token_file,
            cache_salt=salt,
            tp_size=args.tp_size,
            tp_rank=rank,
            **model.cache_kwargs(),
        )
        for rank in range(args.tp_size)
    ]
    try:
        for rank, cache in enumerate(caches):
            found = cache.purge(salt, dry_run=True)
            namespaces.append(
                {"tp_rank": rank, "namespace": cache.namespace(salt).digest.hex(), "found": found}
            )
        total = sum(n for entry in namespaces for n in entry["found"].values() if n > 0)
        report.update(namespaces=namespaces, chunks=total, deleted=False)
        if not args.json:
            _print_counts(report, "found")
        if args.dry_run or total == 0:
            return _finish(report, args, total)
        if not args.yes and not _confirmed(report, total):
            return EXIT_REFUSED
        for entry, cache in zip(namespaces, caches, strict=True):
            entry["purged"] = cache.purge(salt)
        report["deleted"] = True
        if not args.json:
            _print_counts(report, "purged")
    finally:
        for cache in caches:
            cache.close()
    return _finish(report, args, total)


def _finish(report: dict[str, Any], args: argparse.Namespace, total: int) -> int:
    key = "purged" if report["deleted"] else "found"
    bad = {
        tier
        for entry in report["namespaces"]
        for tier, n in entry.get(key, {}).items()
        if n in (PURGE_FAILED, PURGE_UNSUPPORTED)
    }
    report["incomplete_tiers"] = sorted(bad)
    if args.json:
        print(json.dumps(report))
    elif total == 0:
        print("nothing to purge")
    return 1 if bad else 0


def _print_counts(report: dict[str, Any], key: str) -> None:
    rows = []
    for entry in report["namespaces"]:
        for tier, count in entry[key].items():
            shown = {PURGE_FAILED: "failed", PURGE_UNSUPPORTED: "cannot list"}.get(
                count, render.format_count(count)
            )
            rows.append([str(entry["tp_rank"]), entry["namespace"], tier, shown])
    title = f"{report['model_id']} (revision {report['revision'] or '-'}): chunks {key}"
    print(title)
    render.print_table(["rank", "namespace", "tier", key], rows)


def _confirmed(report: dict[str, Any], total: int) -> bool:
    if not sys.stdin.isatty():
        print(
            "lmtier purge: error: not a terminal, so not asking: pass --yes to delete "
            f"{total} chunks (or --dry-run to count only)",
            file=sys.stderr,
        )
        return False
    try:
        answer = input(f"Delete {total} chunks of {report['model_id']}? [y/N] ")
    except EOFError:  # Ctrl-D: no answer is no
        answer = ""
    if answer.strip().lower() in ("y", "yes"):
        return True
    print("lmtier purge: not confirmed: nothing deleted", file=sys.stderr)
    return False
