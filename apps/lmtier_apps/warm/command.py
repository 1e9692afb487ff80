"""What ``lmtier warm`` and ``unpin`` do once their arguments are parsed: name the
model (:mod:`.model`: its namespace from its files; tokenizer and weights only once a
prompt needs them), open the cache (embedded tiers from config, or a sidecar), and run
:mod:`.run`'s loop with a progress bar; or, with ``--via``, send the prompts to an
engine. This module imports no torch (``--via`` needs none); the cache path does.

Exit status: 0 when every prompt was warmed or already cached; 1 when some input was
bad or some prompt failed (each printed on stderr with its source; the others were
warmed all the same), or the engine or sidecar could not be reached; 130 when
interrupted (what was stored so far stays stored: run again to finish).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, TextIO

from lmtier.config import LMTierConfig
from lmtier.config.secrets import read_secret_file
from lmtier.errors import InvalidRequestError
from lmtier_apps.warm.inputs import (
    JSONL_SUFFIXES,
    STDIN,
    PromptError,
    read_prompts,
    tokenize,
)
from lmtier_apps.warm.interrupt import Interrupt
from lmtier_apps.warm.progress import Progress, Tally, by_tier
from lmtier_apps.warm.run import warm_via
from lmtier_apps.warm.via import EngineClient, EngineUnavailable

if TYPE_CHECKING:
    from lmtier.chunks.keys import ChunkKey

__all__ = ["EXIT_INTERRUPTED", "count_prompts", "run_unpin", "run_warm"]

EXIT_PARTIAL = 1
EXIT_INTERRUPTED = 130


def run_warm(args: argparse.Namespace, config: LMTierConfig, *, out: TextIO, err: TextIO) -> int:
    """Run ``lmtier warm`` (module docstring); the exit status."""
    for name in ("batch_size", "concurrency"):
        if getattr(args, name) < 1:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be >= 1")
    if args.via and args.pin:
        raise InvalidRequestError(
            "--pin needs this process to reach the tiers: warm with --model or --prefetch "
            "(and --sidecar), or pin after --via with `lmtier warm --prefetch --pin`"
        )
    if args.cache_dir:
        config = config.replace(disk=config.disk.replace(path=Path(args.cache_dir)))
    tally = Tally("via" if args.via else "prefetch" if args.prefetch else "model")
    progress = Progress(tally, None, enabled=False, stream=err)  # until the input is counted
    with Interrupt() as interrupt:
        try:
            total = count_prompts(args.inputs)
            progress = Progress(tally, total, enabled=not (args.quiet or args.json), stream=err)
            return _warm(args, config, progress, interrupt, out=out, err=err)
        except KeyboardInterrupt:  # before the loop started, or while the cache opened
            tally.interrupted = True
            progress.summary(as_json=args.json, out=out if args.json else err)
            return EXIT_INTERRUPTED


def _warm(
    args: argparse.Namespace,
    config: LMTierConfig,
    progress: Progress,
    interrupt: Interrupt,
    *,
    out: TextIO,
    err: TextIO,
) -> int:
    tally = progress.tally
    prompts = read_prompts(args.inputs)
    try:
        if args.via:
            key_file = args.api_key_file
            key = read_secret_file(key_file, "--api-key-file") if key_file else None
            client = EngineClient(args.via, model=args.served_model_name, api_key=key)
            warm_via(
                client,
                prompts,
                tally,
                progress,
                concurrency=args.concurrency,
                errors=err,
                interrupt=interrupt,
            )
        else:
            from lmtier_apps.warm.local import warm_into_cache  # noqa: PLC0415 - torch

            warmed = warm_into_cache(
                args, config, tally, progress, prompts, interrupt=interrupt, err=err
            )
            if not warmed:
                progress.close()
                return EXIT_PARTIAL
    except EngineUnavailable as exc:
        progress.close()
        print(f"lmtier warm: {exc}", file=err)
        tally.errors.append(str(exc))
        progress.summary(as_json=args.json, out=out if args.json else err)
        return EXIT_PARTIAL
    tally.interrupted = tally.interrupted or interrupt.received
    with interrupt.deferred():
        progress.summary(as_json=args.json, out=out if args.json else err)
    if tally.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_PARTIAL if tally.failed else 0


def run_unpin(args: argparse.Namespace, config: LMTierConfig, *, out: TextIO, err: TextIO) -> int:
    """``lmtier unpin``: make the chunks of the given prompts (``--all``: every pinned
    chunk; through a sidecar, of this model's namespace) evictable again. Prints, per
    tier, how many chunks were pinned; bad input lines are reported as warm does."""
    from lmtier_apps.warm.local import opened_cache  # noqa: PLC0415 - torch
    from lmtier_apps.warm.model import LazyTokenizer  # noqa: PLC0415

    if args.all == bool(args.inputs):
        raise InvalidRequestError("give the prompts to unpin, or --all (not both)")
    if args.cache_dir:
        config = config.replace(disk=config.disk.replace(path=Path(args.cache_dir)))
    failed = 0
    tokenizer = LazyTokenizer(args.model)
    with opened_cache(args, config, err, "unpin") as opened:
        if opened is None:
            return EXIT_PARTIAL
        cache, _ = opened
        if args.all:
            counts = cache.unpin_keys(None)
        else:
            keys: list[ChunkKey] = []
            for item in read_prompts(args.inputs):
                try:
                    if isinstance(item, PromptError):
                        raise InvalidRequestError(str(item))
                    ids = tokenize(item, tokenizer() if item.needs_tokenizer else None)
                    keys += cache.keys(ids, cache_salt=args.cache_salt)
                except InvalidRequestError as exc:
                    failed += 1
                    print(f"lmtier unpin: {exc}", file=err)
            counts = cache.unpin_keys(list(dict.fromkeys(keys)))
    if args.json:
        print(json.dumps({"unpinned": counts, "failed": failed}), file=out)
    else:
        print(f"unpinned by tier: {by_tier(counts) or 'none'}", file=out)
    return EXIT_PARTIAL if failed else 0


def count_prompts(inputs: Iterable[str]) -> int | None:
    """How many prompts the inputs hold, counted cheaply (non-blank lines of JSONL
    files, one per other file), for the progress bar's ETA; None when it cannot tell
    (stdin, directories, a file it cannot read)."""
    total = 0
    for name in inputs:
        path = Path(name)
        if name == STDIN or not path.is_file():
            return None
        if path.suffix.lower() not in JSONL_SUFFIXES:
            total += 1
            continue
        try:
            with path.open("rb") as stream:
                total += _non_blank_lines(stream)
        except OSError:
            return None
    return total


def _non_blank_lines(stream: IO[bytes]) -> int:
    """Lines with something on them, read a MiB at most at a time: a file without
    line ends is not held whole."""
    count, content = 0, False
    while piece := stream.readline(1 << 20):
        content = content or bool(piece.strip())
        if piece.endswith(b"\n"):
            count, content = count + content, False
    return count + content
