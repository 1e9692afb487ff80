"""``lmtier warm``'s command line (entry point ``lmtier.commands``). Heavy imports
(torch, transformers) happen only when the command runs, and only those it needs
(``--via`` imports neither)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lmtier.config import LMTierConfig

__all__ = ["register", "register_unpin"]

EXIT_INTERRUPTED = 130  # command.EXIT_INTERRUPTED: this module must not import it yet

EPILOG = """\
inputs: JSONL files ({"prompt": ...}, {"messages": [...]}, {"tokens": [...]}), text
files (one prompt each), directories of them, or - for stdin (the default).

examples:
  lmtier warm system_prompts.jsonl                      # the built-in demo model
  lmtier warm --model ./Llama-3.2-1B --pin prompts/     # a local model; pin the KV
  lmtier warm --via http://localhost:8000 chats.jsonl   # let a running engine compute
  lmtier warm --prefetch --sidecar unix:///run/lmtier.sock prompts.jsonl
"""


def register(commands: Any) -> None:
    """Add ``lmtier warm`` to the CLI."""
    warm = commands.add_parser(
        "warm",
        help="cache the KV of given prompts before traffic arrives",
        description=(
            "Make the KV of prompts cached before traffic arrives: compute it with a local "
            "model (default: the built-in demo model), have a running engine compute it "
            "(--via), or pull chunks already in Redis/S3 into this node's tiers "
            "(--prefetch). Prompts already cached are skipped, so a rerun (or a run "
            "after an interrupted one) does only what is missing."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    warm.add_argument("inputs", nargs="*", default=["-"], help="files, directories, - (stdin)")
    _add_model_arguments(
        warm,
        "local model directory (tokenizer and KV geometry; computes the KV unless "
        "--via/--prefetch); default: the built-in random demo Llama and its byte tokenizer",
    )
    warm.add_argument("--threads", type=int, help="torch threads (default: the usable CPUs)")
    how = warm.add_mutually_exclusive_group()
    how.add_argument(
        "--via", metavar="URL", help="send each prompt to this OpenAI-compatible engine"
    )
    how.add_argument(
        "--prefetch",
        action="store_true",
        help="pull chunks already in shared tiers (Redis, S3) into the local ones",
    )
    warm.add_argument(
        "--pin", action="store_true", help="exempt the warmed chunks from LRU eviction"
    )
    warm.add_argument(
        "--batch-size", type=int, default=1, help="prompts per batched prefill (default 1)"
    )
    warm.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the model prefills (default: CUDA if available)",
    )
    warm.add_argument(
        "--concurrency", type=int, default=4, help="requests in flight with --via (default 4)"
    )
    warm.add_argument("--served-model-name", help="model name sent with --via (default: ask)")
    warm.add_argument("--api-key-file", metavar="FILE", help="bearer token for --via (first line)")
    warm.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    warm.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    warm.set_defaults(handler=_run)


def register_unpin(commands: Any) -> None:
    """Add ``lmtier unpin`` to the CLI: the reverse of ``lmtier warm --pin``."""
    unpin = commands.add_parser(
        "unpin",
        help="make pinned chunks evictable again",
        description=(
            "Make the chunks of the given prompts (read as `lmtier warm` reads them, keyed "
            "with the same model) evictable again, or every pinned chunk with --all "
            "(through a sidecar: every pinned chunk of the model's namespace)."
        ),
    )
    unpin.add_argument("inputs", nargs="*", help="files, directories, - (stdin)")
    unpin.add_argument("--all", action="store_true", help="unpin every pinned chunk")
    _add_model_arguments(
        unpin,
        "local model directory whose prompts were warmed (its tokenizer and KV geometry; "
        "no weights are read); default: the built-in demo model and its byte tokenizer",
    )
    unpin.add_argument("--json", action="store_true", help="print one JSON object")
    unpin.set_defaults(handler=_run_unpin)


def _add_model_arguments(parser: argparse.ArgumentParser, model_help: str) -> None:
    """The options ``warm`` and ``unpin`` share: the model, its cache, the tenant."""
    parser.add_argument("--model", metavar="DIR", help=model_help)
    parser.add_argument("--seed", type=int, default=0, help="demo model seed (default 0)")
    parser.add_argument("--sidecar", metavar="URL", help="use this `lmtier serve`'s tiers")
    parser.add_argument("--sidecar-token-file", metavar="FILE", help="the sidecar's token")
    parser.add_argument("--cache-salt", default="", help="tenant salt of the KV")
    parser.add_argument("--cache-dir", metavar="DIR", help="disk tier directory (default: config)")


def _run_unpin(args: argparse.Namespace, config: LMTierConfig) -> int:
    from lmtier_apps.warm.command import run_unpin  # noqa: PLC0415

    return run_unpin(args, config, out=sys.stdout, err=sys.stderr)


def _run(args: argparse.Namespace, config: LMTierConfig) -> int:
    try:
        from lmtier_apps.warm.command import run_warm  # noqa: PLC0415
    except KeyboardInterrupt:  # Ctrl-C while the command is imported: nothing done yet
        return EXIT_INTERRUPTED
    return run_warm(args, config, out=sys.stdout, err=sys.stderr)
