"""The model ``lmtier warm`` and ``unpin`` key prompts with, read in the order a run
needs it: its identity and KV geometry first, from files alone; its tokenizer when a
prompt is text or chat messages; its weights when a prompt is not all cached.

So a warm of ``--model DIR`` with nothing left to do opens the cache and looks its
prompts up without importing or loading a model (seconds), and a model directory with
weights and ``config.json`` but no tokenizer files warms token-id prompts (they need
none). The random demo model is built first: its revision hashes the weights it
drew (:func:`~lmtier_apps.demo.demo_model.demo_revision`), so that a transformers
release initialising differently can never be served another release's KV.

The namespace is the one the loaded model gives, and :meth:`WarmModel.load` checks
it: a directory's id and revision are :func:`lmtier.model_dir.model_identity`'s, its
geometry ``config.json``'s, and its KV dtype the one its weights are loaded in
(:data:`~lmtier_apps.demo.demo_model.WEIGHTS_DTYPE`, whatever the config says);
the demo model's from the model built.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmtier.api import LMTier
from lmtier.errors import InvalidRequestError
from lmtier.kv_spec import KVSpec
from lmtier.model_dir import model_identity
from lmtier.ops.model_args import context_length, model_settings
from lmtier_apps.warm.inputs import one_line
from lmtier_apps.warm.run import WarmItem

__all__ = ["LazyTokenizer", "LazyWarmer", "WarmModel", "check_device", "warm_model"]

logger = logging.getLogger(__name__)

_WEIGHTS_DTYPE = "float32"  # hf.demo_model.WEIGHTS_DTYPE: that module imports transformers


@dataclass(frozen=True, slots=True)
class WarmModel:
    """What names a model's chunks, known before its weights are read."""

    model_id: str
    revision: str
    spec: KVSpec
    vocab_size: int | None
    context: int | None
    """Its context length: longer prompts cannot be prefilled (None: not known)."""
    directory: str | None
    """``--model DIR``; None: the demo model of ``seed``."""
    seed: int = 0
    built: Any = field(default=None, compare=False, repr=False)
    """The demo model, built to name it (None for a directory)."""

    def open_cache(self, args: argparse.Namespace, config: Any, command: str) -> LMTier:
        """The cache of this model's namespace: embedded, or ``--sidecar``'s."""
        from lmtier_apps.command_cache import open_command_cache  # noqa: PLC0415

        return open_command_cache(
            args,
            config,
            self.spec,
            model_id=self.model_id,
            revision=self.revision,
            vocab_size=self.vocab_size,
            client_name=f"lmtier {command}",
        )

    def load(self, device: str, threads: int | None) -> Any:
        """The model's weights on ``device`` (``threads``: torch's, None: the usable
        CPUs). RuntimeError if they give another namespace than the one keyed with."""
        from transformers.utils import logging as hf_logging  # noqa: PLC0415 - heavy

        from lmtier_apps.demo.demo_model import (  # noqa: PLC0415
            build_demo_model,
            load_local_model,
        )
        from lmtier_apps.threads import set_torch_threads  # noqa: PLC0415
        from lmtier_connector.hf.adapter import kv_spec_of  # noqa: PLC0415

        set_torch_threads(threads)
        quiet: Any = hf_logging.disable_progress_bar  # untyped in transformers
        quiet()  # warm draws its own bar; transformers' "Loading weights" leaked into it
        loaded = load_local_model(self.directory) if self.directory else None
        demo = loaded or self.built or build_demo_model(self.seed)
        found = (demo.model_id, demo.revision, kv_spec_of(demo.model))
        if found != (self.model_id, self.revision, self.spec):  # a bug, not bad input
            raise RuntimeError(
                f"the loaded model's namespace {found} is not the one its prompts were "
                f"keyed in, {(self.model_id, self.revision, self.spec)}: warm.model.warm_model "
                "and hf.demo_model disagree"
            )
        if device != "cpu":
            demo.model.to(device)
        return demo.model


def warm_model(directory: str | None, seed: int = 0) -> WarmModel:
    """The :class:`WarmModel` of ``--model DIR`` (None: the demo model of ``seed``).
    ConfigError when DIR is not a model directory or its config has no KV geometry."""
    if directory:
        path = Path(directory).expanduser()
        model_id, revision = model_identity(path)
        fields, vocab = model_settings(path)
        spec = KVSpec(**{**fields, "dtype": _WEIGHTS_DTYPE})
        return WarmModel(model_id, revision, spec, vocab, context_length(path), directory)
    from lmtier_apps.demo.demo_model import build_demo_model  # noqa: PLC0415 - torch

    demo = build_demo_model(seed)
    config = demo.model.config
    spec = KVSpec.from_hf_config(config, dtype=_WEIGHTS_DTYPE)
    context = int(config.max_position_embeddings)
    return WarmModel(
        demo.model_id, demo.revision, spec, config.vocab_size, context, None, seed, demo
    )


class LazyTokenizer:
    """The model's tokenizer, loaded on the first call (the first text or messages
    prompt). A tokenizer that cannot be loaded is an InvalidRequestError, one line,
    raised again for every later call without another try."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory
        self._tokenizer: Any = None
        self._problem: str | None = None

    def __call__(self) -> Any:
        if self._tokenizer is None and self._problem is None:
            try:
                self._tokenizer = self._load()
            except InvalidRequestError as exc:
                self._problem = str(exc)
        if self._problem is not None:
            raise InvalidRequestError(self._problem)
        return self._tokenizer

    def _load(self) -> Any:
        if self.directory is None:
            from lmtier_apps.demo.demo_tokenizer import demo_tokenizer  # noqa: PLC0415

            return demo_tokenizer()
        from transformers import AutoTokenizer  # noqa: PLC0415 - only with --model

        try:
            return AutoTokenizer.from_pretrained(self.directory, local_files_only=True)
        # What transformers raises for a directory without (usable) tokenizer files
        # varies by version and file (OSError, ValueError, TypeError, KeyError...).
        except Exception as exc:
            raise InvalidRequestError(
                f"--model {self.directory}: no usable tokenizer there for text and chat "
                f'prompts ({one_line(exc)}); token-id prompts ({{"tokens": [...]}}) need none'
            ) from None


class LazyWarmer:
    """A :class:`~lmtier_apps.warm.run.Warmer` that loads the model and builds a
    :class:`~lmtier_apps.warm.compute.ModelWarmer` on the first batch to compute:
    a run whose prompts are all cached reads no weights."""

    def __init__(
        self, model: WarmModel, cache: LMTier, *, batch_size: int, device: str, threads: int | None
    ) -> None:
        self.model, self.cache, self.batch_size = model, cache, batch_size
        self.device, self.threads = device, threads
        self._warmer: Any = None

    def warm(self, items: Sequence[WarmItem], cache_salt: str = "") -> None:
        if self._warmer is None:
            from lmtier_apps.warm.compute import ModelWarmer  # noqa: PLC0415 - torch

            loaded = self.model.load(self.device, self.threads)
            self._warmer = ModelWarmer(loaded, self.cache, batch_size=self.batch_size)
        self._warmer.warm(items, cache_salt)


def check_device(name: str) -> str:
    """``--device``: ``auto`` is CUDA when this torch build and machine have it;
    InvalidRequestError for ``cuda`` without one (at once, not at the first prefill)."""
    import torch  # noqa: PLC0415 - only when a command runs

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("--device cuda: no CUDA device here (use cpu or auto)")
    return name
