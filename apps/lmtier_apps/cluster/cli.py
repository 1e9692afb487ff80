"""``lmtier cluster up|down|status|secrets|demo``, registered through the ``lmtier.commands``
entry point. The launcher, its clients (redis-py, boto3, grpc) and the demo are
imported when a command runs, so building the ``lmtier`` parser loads none of them.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmtier.config import LMTierConfig

if TYPE_CHECKING:
    from types import FrameType

    from lmtier_apps.cluster.demo import Story
    from lmtier_apps.cluster.launcher import LocalCluster

__all__ = ["register"]

EPILOG = """\
examples:
  lmtier cluster up --nodes 2 --dir /tmp/lmtier-cluster   # start, print addresses, return
  lmtier cluster status --dir /tmp/lmtier-cluster          # pids and health of each process
  lmtier cluster demo --dir /tmp/lmtier-cluster --plot cluster.png
  lmtier cluster demo --engine http://engine-a:8000 --engine http://engine-b:8000 \\
      --redis-url redis://:PASSWORD@redis:6379/0           # docker-compose's client
  lmtier cluster down --dir /tmp/lmtier-cluster [--clean]
  lmtier cluster secrets --dir /var/lib/lmtier/secrets    # docker-compose's cluster-secrets
"""


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def register(commands: Any) -> None:
    """Add ``lmtier cluster`` and its subcommands to the CLI."""
    cluster = commands.add_parser(
        "cluster",
        help="docker-compose.yml's cluster as local processes, and its demo",
        description=(
            "Run docker-compose.yml's topology without Docker: redis-server, an S3 "
            "endpoint (MinIO, else moto), and per node a sidecar (`lmtier serve`) and a "
            "demo engine (`lmtier demo serve`), with the same config files "
            "(deploy/cluster/). `demo` shows node B served from node A's work."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = cluster.add_subparsers(dest="cluster_command", required=True, metavar="ACTION")
    directory = argparse.ArgumentParser(add_help=False)
    directory.add_argument(
        "--dir", metavar="D", help="the cluster's directory (default: ~/.cache/lmtier/cluster)"
    )

    up = actions.add_parser("up", parents=[directory], help="start a cluster")
    up.add_argument("--nodes", type=_positive, default=2, help="nodes (default 2)")
    up.add_argument("--deploy-dir", metavar="DIR", help="the checkout with deploy/cluster/")
    up.add_argument(
        "--foreground", action="store_true", help="stay up until Ctrl-C, then stop it all"
    )
    up.add_argument(
        "--check-logits",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="engines compare every prefill with a full one (default on; the demo's last "
        "column; costs each request a second prefill, not its TTFT)",
    )
    up.set_defaults(handler=_up)

    down = actions.add_parser("down", parents=[directory], help="stop a cluster by its pids")
    down.add_argument("--clean", action="store_true", help="then remove its directory")
    down.set_defaults(handler=_down)

    status = actions.add_parser("status", parents=[directory], help="pids and health")
    status.add_argument("--json", action="store_true", help="one JSON object")
    status.set_defaults(handler=_status)

    trust = actions.add_parser(
        "secrets",
        help="write the peers' node secret, integrity key and TLS files where missing",
        description=(
            "Generate, where missing, what the nodes of a cluster need to trust each other "
            "and no one else (0600 files in D: peer.secret, integrity.key, peer-ca.pem, "
            "peer.pem, peer-key.pem); existing files are kept. `up` does this itself; "
            "docker-compose.yml's cluster-secrets job runs it."
        ),
    )
    trust.add_argument("--dir", metavar="D", required=True, help="the secrets directory")
    trust.set_defaults(handler=_secrets)

    _add_demo(actions)


def _secrets(args: argparse.Namespace, config: LMTierConfig) -> int:
    from lmtier_apps.cluster.trust import ensure_trust  # noqa: PLC0415

    files, made = ensure_trust(Path(args.dir).expanduser())
    kept = 5 - len(made)
    print(
        f"lmtier cluster secrets: {files.node_secret.parent}: "
        f"wrote {', '.join(made) or 'nothing'}; kept {kept} file(s)"
    )
    return 0


def _add_demo(actions: Any) -> None:
    """``lmtier cluster demo``: a local cluster's (``--dir``) or any two engines'."""
    demo = actions.add_parser(
        "demo",
        help="node A computes; node B is served from A's memory (peer), then Redis, then S3, "
        "then its own memory",
        description=(
            "Tell the cluster's story over HTTP (lmtier_apps.cluster.demo): node A "
            "computes P1; node B gets P1 from A's memory (the peer tier); A computes P2 and "
            "P3 and its sidecar restarts (its memory gone); B gets P2 from Redis; Redis is "
            "flushed, B gets P3 from S3; B gets P1 again from its own CPU tier. Against "
            "--engine URLs (compose's client) the restart cannot be done: Redis and S3 "
            "are skipped, with a note."
        ),
    )
    where = demo.add_mutually_exclusive_group()
    where.add_argument("--dir", metavar="D", help="a cluster of `lmtier cluster up` (default)")
    where.add_argument(
        "--engine", action="append", metavar="URL", help="an engine's URL: A first, then B"
    )
    demo.add_argument(
        "--metrics",
        action="append",
        metavar="URL",
        help="with --engine: each node's sidecar /metrics URL, in the same order (to wait "
        "for its writes to Redis and S3 instead of racing them)",
    )
    demo.add_argument(
        "--redis-url",
        metavar="URL",
        help="the shared Redis (password in the URL), flushed before B is served from S3; "
        "without it that phase is skipped (default with --dir: the cluster's)",
    )
    demo.add_argument("--chunk-size", type=_positive, help="the cluster's (default 256)")
    demo.add_argument(
        "--prompt-tokens", type=_positive, default=None, help="prompt length (default 1537)"
    )
    demo.add_argument(
        "--router",
        metavar="URL",
        help="`lmtier route` in front of the engines: conversations through it, round-robin "
        "then KV-aware (default with --dir: the cluster's router)",
    )
    demo.add_argument(
        "--router-api-key-file", metavar="F", help="the router's API key (its first line)"
    )
    demo.add_argument("--json", action="store_true", help="one JSON object")
    demo.add_argument("--plot", metavar="FILE", help="also write a PNG (needs matplotlib)")
    demo.set_defaults(handler=_demo)


def _directory(args: argparse.Namespace) -> Path:
    from lmtier_apps.cluster.launcher import default_directory  # noqa: PLC0415

    return Path(args.dir) if args.dir else default_directory()


def _attached(args: argparse.Namespace) -> LocalCluster:
    """The cluster ``--dir`` names (ClusterError when there is none)."""
    from lmtier_apps.cluster.launcher import LocalCluster  # noqa: PLC0415

    return LocalCluster.attach(_directory(args))


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _up(args: argparse.Namespace, config: LMTierConfig) -> int:
    from lmtier_apps.cluster.launcher import LocalCluster  # noqa: PLC0415

    cluster = LocalCluster(
        _directory(args),
        nodes=args.nodes,
        deploy_dir=args.deploy_dir,
        engine_args=["--check-logits"] if args.check_logits else [],
    )
    if args.foreground:  # SIGTERM stops it as Ctrl-C does, during start-up too
        signal.signal(signal.SIGTERM, _interrupt)
    started = time.monotonic()
    try:
        state = cluster.start()  # stops what it started if interrupted
        _print_cluster(cluster, time.monotonic() - started)
        if not args.foreground:
            print(f"stop it with: lmtier cluster down --dir {state.directory}")
            return 0
        print("running in the foreground: Ctrl-C (or SIGTERM) stops it", flush=True)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        problems = cluster.down()  # none left when start-up was interrupted: it stopped them
        return _report_down(problems)


def _print_cluster(cluster: LocalCluster, seconds: float) -> None:
    state = cluster.state
    print(f"lmtier cluster: {len(state.nodes)} node(s) up in {seconds:.1f} s, {state.directory}")
    print(f"  config  {state.deploy_dir}/deploy/cluster/{{sidecar,engine}}.yaml")
    print(f"  redis   redis://{state.redis_address}/0 (password in secrets.env)")
    print(f"  s3      {state.s3_endpoint} ({state.s3_kind}), bucket {state.bucket}")
    for node in state.nodes:
        print(f"  {node.name}  engine {node.engine_url}  sidecar {node.socket}")
        print(f"  {' ' * len(node.name)}  metrics {node.metrics_url}")
    print(f"  logs    {state.directory}/logs; token in {cluster.token_file}")
    print(f"  trust   {cluster.trust.ca.parent} (node secret, integrity key, peer TLS)")


def _report_down(problems: list[str]) -> int:
    for problem in problems:
        print(f"lmtier cluster down: {problem}", file=sys.stderr)
    if not problems:
        print("lmtier cluster: stopped, no process left")
    return 1 if problems else 0


def _down(args: argparse.Namespace, config: LMTierConfig) -> int:
    return _report_down(_attached(args).down(clean=args.clean))


def _status(args: argparse.Namespace, config: LMTierConfig) -> int:
    cluster = _attached(args)
    parts = cluster.status()
    healthy = all(part.healthy for part in parts)
    if args.json:
        body = {
            "schema": "lmtier.cluster_status/1",
            "directory": str(cluster.directory),
            "healthy": healthy,
            "parts": [
                {
                    "name": p.name,
                    "pid": p.pid,
                    "running": p.running,
                    "healthy": p.healthy,
                    "address": p.address,
                    "problem": p.problem,
                }
                for p in parts
            ],
        }
        print(json.dumps(body))
    else:
        print(f"{'part':<16} {'pid':>7}  {'running':<7}  {'address':<44} health")
        for p in parts:
            running = "yes" if p.running else "no"
            print(f"{p.name:<16} {p.pid:>7}  {running:<7}  {p.address:<44} {p.problem or 'ok'}")
    return 0 if healthy else 1


def _story(args: argparse.Namespace) -> Story:
    from lmtier_apps.cluster.demo import DEFAULT_PROMPT_TOKENS, Node, Story  # noqa: PLC0415
    from lmtier_apps.cluster.state import ClusterError  # noqa: PLC0415

    prompt_tokens = args.prompt_tokens or DEFAULT_PROMPT_TOKENS
    if args.engine:
        metrics = list(args.metrics or [])
        if len(metrics) > len(args.engine):
            raise ClusterError("more --metrics than --engine: one per engine, in order")
        metrics += [None] * (len(args.engine) - len(metrics))
        nodes = [
            Node(chr(ord("A") + i), url.rstrip("/"), metrics[i])
            for i, url in enumerate(args.engine)
        ]
        return Story(
            nodes,
            redis_url=args.redis_url,
            chunk_size=args.chunk_size or 256,
            prompt_tokens=prompt_tokens,
        )
    cluster = _attached(args)
    state = cluster.state
    nodes = []
    for node in state.nodes:
        if node.engine_url:
            nodes.append(Node(chr(ord("A") + len(nodes)), node.engine_url, node.metrics_url))
    return Story(
        nodes,
        redis_url=args.redis_url or cluster.redis_url,
        chunk_size=args.chunk_size or state.chunk_size,
        prompt_tokens=prompt_tokens,
        forget_a=lambda: cluster.restart_sidecar(0),
    )


def _demo(args: argparse.Namespace, config: LMTierConfig) -> int:
    from lmtier_apps.cluster import report  # noqa: PLC0415
    from lmtier_apps.demo.plot import matplotlib_problem  # noqa: PLC0415

    problem = matplotlib_problem() if args.plot else None
    if problem is not None:  # before the run, not after it
        print(f"lmtier cluster demo: error: {problem}", file=sys.stderr)
        return 2
    from lmtier_apps.cluster.routing import print_routing, run_routing  # noqa: PLC0415

    result = _story(args).run()
    router = args.router or (None if args.engine else _attached(args).state.router_url)
    key = None
    if args.router_api_key_file:
        key = Path(args.router_api_key_file).read_text().splitlines()[0].strip()
    routed = run_routing(router.rstrip("/"), api_key=key) if router else None
    if args.json:
        out = report.story_json(result)
        if routed is not None:
            out["routing"] = {
                "router": routed.router_url,
                "rows": [asdict(row) for row in routed.rows],
                "summary": routed.summary(),
            }
        print(json.dumps(out))
    else:
        report.print_table(result, sys.stdout)
        if routed is not None:
            print_routing(routed, sys.stdout)
    if args.plot:
        report.write_plot(result, args.plot)
        print(f"lmtier cluster demo: wrote {args.plot}", file=sys.stderr)
    return 0
