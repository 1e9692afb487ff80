"""The command line of ``lmtier demo`` and ``lmtier demo serve``, registered through the
``lmtier.commands`` entry point. Kept apart from :mod:`.demo` and :mod:`.serve` so that
building the ``lmtier`` parser (for any subcommand, ``--help`` included) loads neither
torch, transformers nor fastapi: those modules are imported only when a command runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from lmtier.config import LMTierConfig

__all__ = ["register"]


def _run(args: argparse.Namespace, config: LMTierConfig) -> int:
    from lmtier_apps.demo.demo import cmd_demo  # noqa: PLC0415 - torch, transformers

    return cmd_demo(args, config)


def _serve(args: argparse.Namespace, config: LMTierConfig) -> int:
    from lmtier_apps.engine.serve import cmd_serve  # noqa: PLC0415 - torch, fastapi

    return cmd_serve(args, config)


def _threads(text: str) -> int:
    """An argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    """An argparse type: a TCP port, 0 for any free one."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535, got {value}")
    return value


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``lmtier demo`` and ``lmtier demo serve`` share: the model, the
    tiers (embedded or a sidecar's), the device tier and torch's threads."""
    parser.add_argument(
        "--model", metavar="DIR", help="local model directory (default: random Llama)"
    )
    parser.add_argument("--cache-dir", metavar="DIR", help="disk tier directory (default: config)")
    parser.add_argument("--no-disk", action="store_true", help="CPU tier only")
    parser.add_argument("--cpu-capacity", default="1GiB", help="CPU tier size (default 1GiB)")
    parser.add_argument(
        "--sidecar",
        metavar="URL",
        help=(
            "use the `lmtier serve` at URL (unix:///path.sock or host:port) instead of an "
            "embedded cache; its config sets the tiers (--cache-dir, --no-disk and "
            "--cpu-capacity do not apply), the device tier stays in this process"
        ),
    )
    parser.add_argument(
        "--sidecar-token-file",
        metavar="FILE",
        help="a file whose first line is the sidecar's bearer token",
    )
    parser.add_argument(
        "--device-blocks",
        type=int,
        default=256,
        help="device prefix-cache blocks of 16 tokens (default 256; 0: no device tier)",
    )
    parser.add_argument(
        "--threads",
        type=_threads,
        metavar="N",
        help=(
            "torch intra-op threads (default: the CPUs this process may use, its affinity "
            "mask capped by a container's cgroup CPU quota, less those the machine's load "
            "average says other processes keep busy; at least 1)"
        ),
    )


def register(commands: Any) -> None:
    """Add ``lmtier demo`` and ``lmtier demo serve`` to the CLI (entry point
    ``lmtier.commands``)."""
    demo = commands.add_parser(
        "demo",
        help="run a small transformer over a shared-prefix workload, with and without lmtier",
        description=(
            "Build a small random Llama (or load --model DIR), run requests that share "
            "prefixes (system prompt, chat history, a RAG document) through lmtier and "
            "without it, and print cached tokens, serving tier, TTFT and logit differences. "
            "Run it twice: the second process is served from the disk tier (or, with "
            "--sidecar, from the sidecar's tiers). `lmtier demo serve` runs the same model "
            "behind an OpenAI-compatible HTTP API instead."
        ),
    )
    _add_engine_arguments(demo)
    demo.add_argument("--seed", type=int, default=0, help="weights and workload seed (default 0)")
    demo.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a table"
    )
    demo.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="scale every prompt length (e.g. 0.25 for a quick run)",
    )
    demo.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also write a PNG of TTFT per request with and without lmtier (needs matplotlib)",
    )
    demo.set_defaults(handler=_run)
    # Optional, so that a plain `lmtier demo` still runs the demo. An option given before
    # `serve` is overridden by serve's own default: give serve's options after it.
    actions = demo.add_subparsers(dest="demo_command", required=False, metavar="{serve}")
    serve = actions.add_parser(
        "serve",
        help="serve the demo model over an OpenAI-compatible HTTP API, with lmtier",
        description=(
            "Serve the demo model (or --model DIR) over the OpenAI API subset "
            "(/v1/completions, /v1/chat/completions, streaming, /v1/models, /health), its "
            "prefills served by lmtier's tiers; each response's usage reports the prompt "
            "tokens lmtier served (prompt_tokens_details.cached_tokens). Requests are "
            "served one at a time. Prints 'lmtier demo serve: listening on URL' when ready."
        ),
    )
    _add_engine_arguments(serve)
    serve.add_argument("--seed", type=int, default=0, help="demo model weights seed (default 0)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument(
        "--port", type=_port, default=8000, help="port (default 8000; 0: any free port)"
    )
    serve.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name clients send and /v1/models lists (default: the model's id)",
    )
    serve.add_argument(
        "--check-logits",
        action="store_true",
        help=(
            "also run every prompt through a full prefill without lmtier and report the "
            "largest logit difference in usage.lmtier.max_logit_diff (doubles prefill cost)"
        ),
    )
    serve.set_defaults(handler=_serve)
