"""``lmtier route``: parse its arguments into a :class:`~.server.Router` and serve it
until SIGTERM or SIGINT (then exit 0). Prints ``lmtier route: listening on URL`` once
the socket accepts connections."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import signal
import socket
import sys
from pathlib import Path

from aiohttp import web

from lmtier.config import LMTierConfig
from lmtier.config.secrets import SecretURL
from lmtier.errors import ConfigError
from lmtier_apps.route.engines import EngineError, Engines, parse_engine
from lmtier_apps.route.prompts import load_route_model
from lmtier_apps.route.server import Router, RouterSettings
from lmtier_backends.fleet import open_index

__all__ = ["READY", "cmd_route"]

logger = logging.getLogger(__name__)

READY = "lmtier route: listening on {url}"


def _key(path: str | None, what: str) -> str | None:
    if path is None:
        return None
    try:
        text = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {path} ({exc.strerror})") from None
    if not text or not text[0].strip():
        raise ConfigError(f"{what}: {path} is empty")
    return text[0].strip()


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_router(args: argparse.Namespace, config: LMTierConfig) -> Router:
    """The router ``args`` describe; ConfigError or EngineError for bad arguments."""
    api_key = _key(args.api_key_file, "--api-key-file")
    if api_key is None and not _loopback(args.host):
        raise ConfigError(
            f"--host {args.host} is reachable from other machines: give --api-key-file"
        )
    engines = Engines(
        [parse_engine(value) for value in args.engine], interval_s=args.health_interval
    )
    fleet = config.fleet.resolved(config.redis.url)
    if args.index_url is not None:
        fleet = fleet.replace(index_url=SecretURL(args.index_url))
    index = open_index(fleet) if fleet.index_url is not None else None
    if index is None and args.policy == "kv-aware":
        logger.warning("no fleet index (fleet.index_url, redis.url or --index-url): kv-aware "
                       "knows only what this router sent")  # fmt: skip
    settings = RouterSettings(
        args.policy,
        load_tokens=args.load_tokens,
        index_timeout_s=args.index_timeout,
        read_timeout_s=args.read_timeout,
        api_key=api_key,
        engine_key=_key(args.engine_api_key_file, "--engine-api-key-file"),
    )
    return Router(load_route_model(args, config), engines, index, settings)


def cmd_route(args: argparse.Namespace, config: LMTierConfig) -> int:
    """Run ``lmtier route`` (module docstring)."""
    try:
        router = build_router(args, config)
    except (ConfigError, EngineError) as exc:
        print(f"lmtier route: error: {exc}", file=sys.stderr)
        return 2
    try:
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        sock = socket.create_server((args.host, args.port), family=family, backlog=512)
    except OSError as exc:
        print(f"lmtier route: error: cannot listen on {args.host}:{args.port}: {exc.strerror}",
              file=sys.stderr)  # fmt: skip
        return 1
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    asyncio.run(_serve(router, sock, f"http://{host}:{port}"))
    return 0


async def _serve(router: Router, sock: socket.socket, url: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(router.app(), access_log=None)
    await runner.setup()
    try:
        await web.SockSite(runner, sock).start()
        print(READY.format(url=url), flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()
