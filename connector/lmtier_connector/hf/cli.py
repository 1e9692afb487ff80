"""``lmtier demo``'s command line, registered through the ``lmtier.commands`` entry
point. Kept apart from :mod:`.demo` so that building the ``lmtier`` parser (for any
subcommand, ``--help`` included) loads neither torch nor transformers: the demo's
modules are imported only when the demo runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from lmtier.config import LMTierConfig

__all__ = ["register"]


def _run(args: argparse.Namespace, config: LMTierConfig) -> int:
    from lmtier_connector.hf.demo import cmd_demo  # noqa: PLC0415 - torch, transformers

    return cmd_demo(args, config)


def register(commands: Any) -> None:
    """Add ``lmtier demo`` to the CLI (entry point ``lmtier.commands``)."""
    demo = commands.add_parser(
        "demo",
        help="run a small transformer over a shared-prefix workload, with and without lmtier",
        description=(
            "Build a small random Llama (or load --model DIR), run requests that share "
            "prefixes (system prompt, chat history, a RAG document) through lmtier and "
            "without it, and print cached tokens, serving tier, TTFT and logit differences. "
            "Run it twice: the second process is served from the disk tier (or, with "
            "--sidecar, from the sidecar's tiers)."
        ),
    )
    demo.add_argument(
        "--model", metavar="DIR", help="local model directory (default: random Llama)"
    )
    demo.add_argument("--seed", type=int, default=0, help="weights and workload seed (default 0)")
    demo.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a table"
    )
    demo.add_argument("--cache-dir", metavar="DIR", help="disk tier directory (default: config)")
    demo.add_argument("--no-disk", action="store_true", help="CPU tier only")
    demo.add_argument("--cpu-capacity", default="1GiB", help="CPU tier size (default 1GiB)")
    demo.add_argument(
        "--sidecar",
        metavar="URL",
        help=(
            "use the `lmtier serve` at URL (unix:///path.sock or host:port) instead of an "
            "embedded cache; its config sets the tiers (--cache-dir, --no-disk and "
            "--cpu-capacity do not apply), the device tier stays in this process"
        ),
    )
    demo.add_argument(
        "--sidecar-token-file",
        metavar="FILE",
        help="a file whose first line is the sidecar's bearer token",
    )
    demo.add_argument(
        "--device-blocks",
        type=int,
        default=256,
        help="device prefix-cache blocks of 16 tokens (default 256; 0: no device tier)",
    )
    demo.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="scale every prompt length (e.g. 0.25 for a quick run)",
    )
    demo.set_defaults(handler=_run)
