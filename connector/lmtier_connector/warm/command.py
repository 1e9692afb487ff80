"""What ``lmtier warm`` does once its arguments are parsed: load the model's tokenizer
(and weights, unless the KV comes from elsewhere), open the cache (embedded tiers
from config, or a sidecar), and run :mod:`.run`'s loop with a progress bar.

Exit status: 0 when every prompt was warmed or already cached; 1 when some input was
bad or some prompt failed (each printed on stderr with its source; the others were
warmed all the same), or the engine or sidecar could not be reached; 130 when
interrupted (what was stored so far stays stored: run again to finish).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from lmtier.api import LMTier
from lmtier.chunks.keys import ChunkKey
from lmtier.config import LMTierConfig
from lmtier.config.secrets import read_secret_file
from lmtier.errors import InvalidRequestError
from lmtier.kv_spec import KVSpec
from lmtier.model_dir import model_identity
from lmtier.ops.model_args import model_settings
from lmtier_connector.hf.adapter import kv_spec_of
from lmtier_connector.hf.demo import DemoSetup, open_cache, sidecar_problem
from lmtier_connector.hf.demo_model import DemoModel, build_demo_model, load_local_model
from lmtier_connector.hf.demo_tokenizer import demo_tokenizer
from lmtier_connector.hf.threads import set_torch_threads
from lmtier_connector.warm.compute import ModelWarmer
from lmtier_connector.warm.inputs import (
    JSONL_SUFFIXES,
    STDIN,
    PromptError,
    read_prompts,
    tokenize,
)
from lmtier_connector.warm.progress import Progress, Tally
from lmtier_connector.warm.run import Warm, warm_via
from lmtier_connector.warm.via import EngineClient, EngineUnavailable

__all__ = ["count_prompts", "run_unpin", "run_warm"]

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
    mode = "via" if args.via else "prefetch" if args.prefetch else "model"
    tally = Tally(mode)
    progress = Progress(
        tally, count_prompts(args.inputs), enabled=not (args.quiet or args.json), stream=err
    )
    prompts = read_prompts(args.inputs)
    try:
        if args.via:
            _via(args, tally, progress, prompts, err)
        else:
            code = _with_cache(args, config, tally, progress, prompts=prompts, err=err)
            if code:
                return code
    except EngineUnavailable as exc:
        progress.close()
        print(f"lmtier warm: {exc}", file=err)
        tally.errors.append(str(exc))
        progress.summary(as_json=args.json, out=out if args.json else err)
        return EXIT_PARTIAL
    except KeyboardInterrupt:  # before the loop started, or while the model loaded
        tally.interrupted = True
    progress.summary(as_json=args.json, out=out if args.json else err)
    if tally.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_PARTIAL if tally.failed else 0


def _via(
    args: argparse.Namespace, tally: Tally, progress: Progress, prompts: Any, err: TextIO
) -> None:
    key = read_secret_file(args.api_key_file, "--api-key-file") if args.api_key_file else None
    client = EngineClient(args.via, model=args.served_model_name, api_key=key)
    warm_via(client, prompts, tally, progress, concurrency=args.concurrency, errors=err)


@contextlib.contextmanager
def _opened(
    args: argparse.Namespace,
    config: LMTierConfig,
    err: TextIO,
    command: str,
    *,
    weights: bool = True,
) -> Iterator[tuple[Any, Any, LMTier] | None]:
    """The model (``--model DIR``, else the demo Llama), its tokenizer, and the cache
    (embedded, or ``--sidecar``); None, with a message, when the sidecar is down.
    Without ``weights`` (prefetch, unpin: only the keys matter), a model directory's
    weights are not loaded: its identity and KV geometry come from its files."""
    threads = set_torch_threads(args.threads)
    if args.model and not weights:
        demo, spec = _model_without_weights(args.model)
    else:
        demo = load_local_model(args.model) if args.model else build_demo_model(args.seed)
        device = _device(getattr(args, "device", "cpu"))
        if device != "cpu":
            demo.model.to(device)
        spec = kv_spec_of(demo.model)
    tokenizer = _tokenizer(args.model) if args.model else demo_tokenizer()
    setup = DemoSetup(demo, config, spec, None, threads)
    with open_cache(args, setup, client_name=f"lmtier {command}") as cache:
        problem = sidecar_problem(args, cache, command=f"lmtier {command}")
        if problem is not None:
            print(problem, file=err)
            yield None
        else:
            yield demo, tokenizer, cache


def _model_without_weights(directory: str) -> tuple[DemoModel, KVSpec]:
    """A model directory's identity and KV geometry from its files alone (the same
    namespace :func:`load_local_model` gives, without reading the weights)."""
    path = Path(directory).expanduser()
    model_id, revision = model_identity(path)
    fields, vocab = model_settings(path)
    return DemoModel(None, model_id, revision, vocab or 0), KVSpec(**fields)


def _with_cache(
    args: argparse.Namespace,
    config: LMTierConfig,
    tally: Tally,
    progress: Progress,
    *,
    prompts: Any,
    err: TextIO,
) -> int:
    with _opened(args, config, err, "warm", weights=not args.prefetch) as opened:
        if opened is None:
            progress.close()
            return EXIT_PARTIAL
        demo, tokenizer, cache = opened
        batch = args.batch_size
        warmer = None if args.prefetch else ModelWarmer(demo.model, cache, batch_size=batch)
        # No model read (a prefetch): nothing is prefilled, so no context to fit.
        context = getattr(getattr(demo.model, "config", None), "max_position_embeddings", None)
        Warm(
            cache,
            tokenizer,
            tally,
            progress,
            warmer=warmer,
            cache_salt=args.cache_salt,
            pin=args.pin,
            max_len=int(context) if context else None,
            errors=err,
        ).run(prompts)
    return 0


def run_unpin(args: argparse.Namespace, config: LMTierConfig, *, out: TextIO, err: TextIO) -> int:
    """``lmtier unpin``: make the chunks of the given prompts (``--all``: every pinned
    chunk; through a sidecar, of this model's namespace) evictable again. Prints, per
    tier, how many chunks were pinned; bad input lines are reported as warm does."""
    if args.all == bool(args.inputs):
        raise InvalidRequestError("give the prompts to unpin, or --all (not both)")
    if args.cache_dir:
        config = config.replace(disk=config.disk.replace(path=Path(args.cache_dir)))
    failed = 0
    with _opened(args, config, err, "unpin", weights=False) as opened:
        if opened is None:
            return EXIT_PARTIAL
        _, tokenizer, cache = opened
        if args.all:
            counts = cache.unpin_keys(None)
        else:
            keys: list[ChunkKey] = []
            for item in read_prompts(args.inputs):
                try:
                    if isinstance(item, PromptError):
                        raise InvalidRequestError(str(item))
                    keys += cache.keys(tokenize(item, tokenizer), cache_salt=args.cache_salt)
                except InvalidRequestError as exc:
                    failed += 1
                    print(f"lmtier unpin: {exc}", file=err)
            counts = cache.unpin_keys(list(dict.fromkeys(keys)))
    if args.json:
        print(json.dumps({"unpinned": counts, "failed": failed}), file=out)
    else:
        print(f"unpinned by tier: {counts}", file=out)
    return EXIT_PARTIAL if failed else 0


def _device(name: str) -> str:
    """``--device``: ``auto`` is CUDA when this torch build and machine have it."""
    import torch  # noqa: PLC0415 - only when a command runs

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("--device cuda: no CUDA device here (use cpu or auto)")
    return name


def _tokenizer(directory: str) -> Any:
    from transformers import AutoTokenizer  # noqa: PLC0415 - only with --model

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(
            f"--model {directory}: no usable tokenizer there ({exc})"
        ) from exc


def count_prompts(inputs: list[str]) -> int | None:
    """How many prompts the inputs hold, counted cheaply (newlines of JSONL files, one per
    other file), for the progress bar's ETA; None when it cannot tell (stdin, directories)."""
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
                total += sum(1 for line in stream if line.strip())
        except OSError:
            return None
    return total
