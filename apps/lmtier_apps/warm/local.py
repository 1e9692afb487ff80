"""``lmtier warm`` into this process's cache (``--model`` and ``--prefetch``) and the
cache ``unpin`` opens: the model's namespace first (:mod:`.model`), then the cache,
then :class:`~lmtier_apps.warm.run.Warm`'s loop, which asks for the tokenizer and
the weights only when a prompt needs them.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterable, Iterator
from typing import TextIO

from lmtier.api import LMTier
from lmtier.config import LMTierConfig
from lmtier_apps.command_cache import sidecar_problem
from lmtier_apps.warm.inputs import Prompt, PromptError
from lmtier_apps.warm.interrupt import Interrupt
from lmtier_apps.warm.model import (
    LazyTokenizer,
    LazyWarmer,
    WarmModel,
    check_device,
    warm_model,
)
from lmtier_apps.warm.progress import Progress, Tally
from lmtier_apps.warm.run import Warm

__all__ = ["opened_cache", "warm_into_cache"]


@contextlib.contextmanager
def opened_cache(
    args: argparse.Namespace, config: LMTierConfig, err: TextIO, command: str
) -> Iterator[tuple[LMTier, WarmModel] | None]:
    """The cache of the model's namespace (embedded, or ``--sidecar``'s) and the model;
    None, with a message on ``err``, when the sidecar does not answer."""
    model = warm_model(args.model, args.seed)
    with model.open_cache(args, config, command) as cache:
        salt = getattr(args, "cache_salt", "")
        problem = sidecar_problem(args, cache, command=f"lmtier {command}", cache_salt=salt)
        if problem is not None:
            print(problem, file=err)
            yield None
        else:
            yield cache, model


def warm_into_cache(
    args: argparse.Namespace,
    config: LMTierConfig,
    tally: Tally,
    progress: Progress,
    prompts: Iterable[Prompt | PromptError],
    *,
    interrupt: Interrupt,
    err: TextIO,
) -> bool:
    """Warm ``prompts`` (``--model``: compute what is not cached; ``--prefetch``: pull
    it from the shared tiers); False when the sidecar does not answer (said on ``err``)."""
    device = None if args.prefetch else check_device(args.device)
    with opened_cache(args, config, err, "warm") as opened:
        if opened is None:
            return False
        cache, model = opened
        warmer = None
        if device is not None:
            warmer = LazyWarmer(
                model, cache, batch_size=args.batch_size, device=device, threads=args.threads
            )
        Warm(
            cache,
            LazyTokenizer(args.model),
            tally,
            progress,
            warmer=warmer,
            cache_salt=args.cache_salt,
            pin=args.pin,
            # A prefetch prefills nothing: no context to fit.
            max_len=model.context if warmer is not None else None,
            errors=err,
            interrupt=interrupt,
        ).run(prompts)
    return True
