"""``lmtier lookup``: how many tokens of a prompt are cached, and which tiers hold them.

The prompt is token ids (a file, stdin, or ``--tokens``) or text (``--text``,
``--text-file``) with ``--model DIR``. Its keys are computed as an engine computes
them, so the namespace must be the engine's: model id, revision, KV geometry and
dtype, chunk size, hash and cache salt (``docs/operations.md`` says what each engine
uses). ``--model DIR``, a local transformers model directory, supplies
(:mod:`lmtier.ops.model_args`, shared with ``purge``):

* the KV geometry from ``DIR/config.json`` (:meth:`KVSpec.from_hf_config`, the
  ``text_config`` of a multimodal model) and its KV dtype from the config's
  ``dtype`` (``torch_dtype`` in older files): :func:`lmtier.ops.model_args.model_settings`;
* the model id and revision, as ``lmtier warm`` and ``lmtier demo serve`` name it
  (:func:`lmtier.model_dir.model_identity`: the path, and a weights fingerprint);
* the tokenizer, ``DIR/tokenizer.json``, run with the ``tokenizers`` library: the
  same tokenizer transformers' fast tokenizers run, special tokens (BOS) included,
  without importing transformers (the core never does: ``tests/unit/test_layout.py``).

Any flag (``--model-id``, ``--num-layers``, ``--kv-dtype``, ...) overrides what the
directory says. The lookup asks the embedded tiers (:mod:`.caches`) or, with
``--sidecar``, the sidecar; nothing is loaded or changed.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

from lmtier.cli import MAX_INPUT_CHARS, read_token_ids, token_ids_from
from lmtier.config import LMTierConfig
from lmtier.errors import ConfigError, InvalidTokensError
from lmtier.extras import install_command
from lmtier.ops import render
from lmtier.ops.model_args import resolve_model

__all__ = ["cmd_lookup"]


def _tokenize(directory: Path, text: str) -> list[int]:
    """``text`` as the model's tokenizer encodes a prompt (special tokens included)."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{directory} has no tokenizer.json; pass token ids instead of text")
    try:
        from tokenizers import Tokenizer  # noqa: PLC0415 - the hf extra
    except ImportError:
        raise ConfigError(f"text needs the tokenizers package: {install_command('hf')}") from None
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a plain Exception
        raise ConfigError(f"cannot load the tokenizer {path}: {exc}") from None
    return list(tokenizer.encode(text).ids)


def _prompt(args: argparse.Namespace, model: Path | None) -> list[int]:
    """The prompt's token ids, from whichever input was given (stdin: token ids)."""
    if args.tokens is not None:
        return read_token_ids(io.StringIO(args.tokens), "--tokens")
    if args.text is None and args.text_file is None:
        return token_ids_from(args.file)
    if model is None:
        raise ConfigError("text needs --model DIR (its tokenizer); or pass token ids")
    text = args.text if args.text is not None else _read_text(args.text_file)
    return _tokenize(model, text)


def _read_text(name: str) -> str:
    """The text of file ``name`` (``-``: stdin), at most MAX_INPUT_CHARS of it: a prompt,
    not whatever a mistyped name holds (``/dev/zero`` is an error, not all of memory)."""
    try:
        if name == "-":
            text = sys.stdin.read(MAX_INPUT_CHARS + 1)
        else:
            with Path(name).open(encoding="utf-8") as stream:
                text = stream.read(MAX_INPUT_CHARS + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidTokensError(f"cannot read text from {name}: {exc}") from None
    if len(text) > MAX_INPUT_CHARS:
        raise InvalidTokensError(f"{name}: more than {MAX_INPUT_CHARS} characters: not a prompt")
    return text


def cmd_lookup(args: argparse.Namespace, config: LMTierConfig) -> int:
    """``lmtier lookup`` (module docstring)."""
    from lmtier.ops.caches import open_cache  # noqa: PLC0415 - torch

    model = resolve_model(args, config)
    ids = _prompt(args, model.directory)
    salt = args.cache_salt or ""
    chunk_size = model.config.chunk_size
    with open_cache(
        model.config,
        model.spec,
        sidecar=args.sidecar,
        token_file=args.sidecar_token_file,
        cache_salt=salt,
        tp_size=args.tp_size,
        **model.cache_kwargs(),
    ) as cache:
        found = cache.lookup(ids, cache_salt=salt)
        by_tier = found.tokens_by_tier(chunk_size)
        digest = cache.namespace(salt).digest.hex()
    report = {
        "source": "sidecar" if args.sidecar else "embedded",
        "model_id": model.model_id,
        "model_revision": model.revision,
        "namespace": digest,
        "chunk_size": chunk_size,
        "tokens": len(ids),
        "full_chunks": len(found.keys),
        "cached_tokens": found.num_tokens,
        "cached_chunks": found.num_chunks,
        "tokens_by_tier": by_tier,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    tail = len(ids) - len(found.keys) * chunk_size
    print(
        f"{render.counted(len(ids), 'token')}: {render.counted(len(found.keys), 'full chunk')} "
        f"of {chunk_size} (+{render.counted(tail, 'tail token')}, never cached); "
        f"namespace {digest}"
    )
    share = found.num_tokens / len(ids) if ids else None
    cached = render.counted(found.num_tokens, "token")
    print(f"cached: {cached} ({render.format_ratio(share)} of the prompt)")
    if by_tier:
        rows = [[tier, render.format_count(tokens)] for tier, tokens in by_tier.items()]
        render.print_table(["tier", "tokens"], rows)
    return 0
