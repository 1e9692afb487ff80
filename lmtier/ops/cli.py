"""The operations commands' parsers, registered through ``lmtier.commands`` entry points
(``stats``, ``lookup``, ``inspect``, ``purge``).

Building the ``lmtier`` parser registers every command, so this module imports
nothing heavy: each command's module (torch, the tiers, grpc) is imported when that
command runs.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

from lmtier.cli import add_namespace_arguments
from lmtier.config import LMTierConfig

__all__ = [
    "register_inspect",
    "register_lookup",
    "register_purge",
    "register_stats",
]

Handler = Callable[[argparse.Namespace, LMTierConfig], int]
DEFAULT_WATCH_S = 2.0


def _lazy(module: str, function: str) -> Handler:
    """A handler that imports ``module`` only when the command runs."""

    def run(args: argparse.Namespace, config: LMTierConfig) -> int:
        command: Handler = getattr(importlib.import_module(module), function)
        return command(args, config)

    return run


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _add_sidecar_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sidecar",
        metavar="URL",
        help="ask the `lmtier serve` at URL (unix:///path.sock or host:port) instead of "
        "opening the config's tiers here",
    )
    parser.add_argument(
        "--sidecar-token-file",
        metavar="FILE",
        help="a file whose first line is the sidecar's bearer token (default: the "
        "config's sidecar.auth_token or auth_token_file)",
    )


def register_stats(commands: Any) -> None:
    """Add ``lmtier stats`` (entry point ``lmtier.commands``)."""
    stats = commands.add_parser(
        "stats",
        help="per-tier capacity, use, hit ratio, latency and failures",
        description=(
            "Print each tier's capacity, bytes used, chunks, pinned bytes, hit ratio, "
            "p50/p99 latencies, errors, breaker state, queue depth and evictions: of the "
            "config's tiers opened here (counters start at zero; the disk directory's "
            "state is shared with every process), or of a sidecar (--sidecar)."
        ),
        epilog="example: lmtier --config node.yaml stats --sidecar unix:///run/lmtier/s.sock",
    )
    _add_sidecar_arguments(stats)
    stats.add_argument(
        "--model-id",
        help="model id of the session that asks a sidecar (a scoped token must allow "
        "it; default: the config's model_id, else lmtier-ops)",
    )
    stats.add_argument(
        "--cache-salt",
        help="cache salt of that session (for a token scoped to salts: one it allows; "
        "default: none)",
    )
    stats.add_argument(
        "--json", action="store_true", help="one JSON object (schema lmtier.stats/1)"
    )
    stats.add_argument(
        "--watch",
        nargs="?",
        type=_seconds,
        const=DEFAULT_WATCH_S,
        metavar="SECONDS",
        help=f"print again every SECONDS (default {DEFAULT_WATCH_S:g}) until Ctrl-C",
    )
    stats.set_defaults(handler=_lazy("lmtier.ops.stats", "cmd_stats"))


def register_lookup(commands: Any) -> None:
    """Add ``lmtier lookup`` (entry point ``lmtier.commands``)."""
    lookup = commands.add_parser(
        "lookup",
        help="how many tokens of a prompt are cached, per tier",
        description=(
            "Compute a prompt's chunk keys as an engine does and ask the tiers (the "
            "config's, or a sidecar's) how many leading tokens they hold, and which "
            "tier holds which. The prompt is token ids (FILE, stdin, --tokens) or text "
            "(--text, --text-file) tokenized by --model DIR."
        ),
        epilog="example: lmtier lookup --model ~/models/llama-3-8b --text 'You are ...'",
    )
    source = lookup.add_mutually_exclusive_group()
    source.add_argument("file", nargs="?", help="file of token ids (default: stdin; '-' = stdin)")
    source.add_argument("--tokens", metavar="IDS", help='token ids, e.g. "1 2 3"')
    source.add_argument("--text", help="the prompt as text (with --model)")
    source.add_argument(
        "--text-file", metavar="FILE", help="a file of prompt text ('-' = stdin; with --model)"
    )
    lookup.add_argument(
        "--model",
        metavar="DIR",
        help="a local transformers model directory: its config.json gives the KV "
        "geometry and dtype, DIR and its weights the model id and revision (as `lmtier "
        "warm --model` names it), tokenizer.json the tokens of --text",
    )
    add_namespace_arguments(lookup)
    lookup.set_defaults(kv_dtype=None, kv_layout=None)  # --model's, else float32, LKTHD
    lookup.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="tensor-parallel size of the engine (each rank stores its own KV; rank 0's "
        "is looked up)",
    )
    _add_sidecar_arguments(lookup)
    lookup.add_argument("--json", action="store_true", help="print one JSON object")
    lookup.set_defaults(handler=_lazy("lmtier.ops.lookup", "cmd_lookup"))


def register_inspect(commands: Any) -> None:
    """Add ``lmtier inspect`` (entry point ``lmtier.commands``)."""
    inspect = commands.add_parser(
        "inspect",
        help="a chunk's header and checksum state",
        description=(
            "Print a chunk's header (key, namespace, dtype, shape, layout, tokens, "
            "creation time, flags) and check it: header and payload checksums, MAC, and "
            "that it holds the key it is filed under. FILE is a chunk file; KEY (64 hex "
            "digits) is read from the config's disk, Redis and S3 tiers. Nothing is "
            "changed, not even a corrupt chunk. Exit 2 when the chunk is bad."
        ),
        epilog="example: lmtier inspect ~/.cache/lmtier/chunks/v1/3f/<key>.lmtc",
    )
    inspect.add_argument("target", metavar="KEY|FILE", help="a chunk key or a chunk file")
    inspect.add_argument("--tier", metavar="NAME", help="read KEY from this tier only")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(handler=_lazy("lmtier.ops.inspect_chunk", "cmd_inspect"))


def register_purge(commands: Any) -> None:
    """Add ``lmtier purge`` (entry point ``lmtier.commands``): :mod:`lmtier.ops.purge`."""
    from lmtier.ops.purge import register  # noqa: PLC0415 - its own module

    register(commands)
