"""``lmtier serve``'s command line, registered through the ``lmtier.commands`` entry
point. It imports nothing of the sidecar (grpc, prometheus_client) until it runs, so
that the ``lmtier`` parser builds without the ``grpc`` extra."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import resource
from typing import Any

from lmtier.config import LMTierConfig

__all__ = ["register"]


def _raise_open_files_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit, as servers do:
    every engine connection, lane socket and scrape holds a descriptor, and the usual
    soft default (1024) runs out long before memory does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft == resource.RLIM_INFINITY or want <= soft:
        return
    with contextlib.suppress(ValueError, OSError):  # not allowed here: keep the soft one
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _run(args: argparse.Namespace, config: LMTierConfig) -> int:
    from lmtier.remote.heap import keep_freed_memory  # noqa: PLC0415
    from lmtier.sidecar.logs import setup_logging  # noqa: PLC0415 - the grpc extra
    from lmtier.sidecar.server import serve  # noqa: PLC0415

    changes: dict[str, Any] = {}
    if args.metrics_listen is not None:
        changes["metrics_listen"] = args.metrics_listen
    if changes:
        config = config.replace(sidecar=config.sidecar.replace(**changes))
    root = logging.getLogger()
    for handler in list(root.handlers):  # the CLI's plain handler: one line per record
        root.removeHandler(handler)
    setup_logging(args.log_level, json=not args.plain_logs)
    keep_freed_memory()  # streamed chunks reuse freed buffers instead of faulting pages in
    _raise_open_files_limit()
    return asyncio.run(serve(config, args.listen))


def register(commands: Any) -> None:
    """Add ``lmtier serve`` to the CLI (entry point ``lmtier.commands``)."""
    serve = commands.add_parser(
        "serve",
        help="run the sidecar: one node's KV cache, shared by its engines over gRPC",
        description=(
            "Serve the configured tiers to every engine process on this node over gRPC "
            "(lmtier.v1.Sidecar), with the KV bytes in shared memory for local clients. "
            "SIGTERM drains: in-flight calls finish, write queues flush, exit 0."
        ),
        epilog="example: lmtier --config node.yaml serve --listen unix:///run/lmtier/sidecar.sock",
    )
    serve.add_argument(
        "--listen",
        metavar="ADDRESS",
        help="unix:///path.sock or host:port (default: sidecar.listen, else a socket in "
        "$XDG_RUNTIME_DIR/lmtier, else in $XDG_CACHE_HOME/lmtier/run)",
    )
    serve.add_argument(
        "--metrics-listen", metavar="HOST:PORT", help="Prometheus /metrics (default: off)"
    )
    serve.add_argument("--log-level", default="INFO", help="DEBUG, INFO (default), WARNING, ERROR")
    serve.add_argument("--plain-logs", action="store_true", help="text logs instead of JSON")
    serve.set_defaults(handler=_run)
