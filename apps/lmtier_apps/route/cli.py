"""The command line of ``lmtier route`` (``lmtier.commands`` entry point); building the
parser loads neither torch nor aiohttp."""

from __future__ import annotations

import argparse
from typing import Any

from lmtier.config import LMTierConfig

__all__ = ["register"]


def _run(args: argparse.Namespace, config: LMTierConfig) -> int:
    from lmtier_apps.route.run import cmd_route  # noqa: PLC0415 - torch, aiohttp

    return cmd_route(args, config)


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def register(commands: Any) -> None:
    """Add ``lmtier route`` to the CLI."""
    from lmtier.cli import add_namespace_arguments  # noqa: PLC0415 - the shared flags

    route = commands.add_parser(
        "route",
        help="an OpenAI-compatible router that sends each request where its prefix is cached",
        description=(
            "Route /v1/completions and /v1/chat/completions to the engine whose node holds "
            "the most of the prompt's prefix (the fleet index, fleet.* in the config, fed "
            "by every node's tiers), weighted by tier speed and against load; "
            "round-robin and least-loaded for comparison. Prints "
            "'lmtier route: listening on URL' when ready (docs/fleet.md)."
        ),
    )
    route.add_argument(
        "--engine",
        action="append",
        required=True,
        metavar="NAME=URL",
        help="an engine, NAME its node's fleet.node_id (repeat for each engine)",
    )
    route.add_argument(
        "--policy",
        choices=("kv-aware", "round-robin", "least-loaded"),
        default="kv-aware",
        help="how to choose (default kv-aware)",
    )
    route.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    route.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free)")
    route.add_argument(
        "--api-key-file",
        help="a file whose first line clients must send as 'Authorization: Bearer KEY' "
        "(required to bind an address other machines reach)",
    )
    route.add_argument(
        "--engine-api-key-file", help="a file with the key the engines want (vLLM's --api-key)"
    )
    route.add_argument(
        "--index-url",
        help="the fleet index's Redis (default: fleet.index_url, else redis.url, in the config)",
    )
    route.add_argument(
        "--index-timeout",
        type=_positive(float),
        default=0.1,
        help="seconds an index query may take before the request is routed by load (0.1)",
    )
    route.add_argument(
        "--load-tokens",
        type=_positive(int),
        default=512,
        help="what one request in flight costs an engine's score, in prompt tokens (512)",
    )
    route.add_argument(
        "--health-interval", type=_positive(float), default=2.0, help="seconds between checks"
    )
    route.add_argument(
        "--read-timeout",
        type=_positive(float),
        default=600.0,
        help="seconds an engine may stay silent mid-answer before it counts as failed",
    )
    route.add_argument("--model", help="the engines' model directory (tokenizer, config.json)")
    route.add_argument("--seed", type=int, default=0, help="without --model: the demo model's")
    route.add_argument("--tp-size", type=int, default=1, help="the engines' tensor parallelism")
    add_namespace_arguments(route)
    route.set_defaults(handler=_run)
