"""The ``lmtier`` command line.

Each subcommand is a small function taking parsed arguments and the config and
returning an exit code; ``main`` builds the parser and maps lmtier's own errors to a
one-line message and exit status 2, so users never see a traceback for bad input: a
wrong option is reported with the usage of the subcommand it was given to, a module
of an extra that is not installed says which extra to install (:mod:`lmtier.extras`),
and Ctrl-C before a subcommand handles it itself ends the command with status 130.

Packages that sit on top of the core add subcommands through the ``lmtier.commands``
entry-point group (the core never imports them): an entry point names a function
``register(commands)`` that adds a subparser and sets ``handler`` on it, e.g.
``lmtier demo`` from ``lmtier_connector``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

# Only the standard library and two small modules at import time: until main() runs,
# Ctrl-C can only be Python's traceback, so the window before it is kept short; the
# rest (numpy, pydantic, the chunk code) is imported by the functions that use it.
from lmtier.errors import ConfigError, InvalidTokensError, LMTierError, brief
from lmtier.extras import missing_extra

if TYPE_CHECKING:
    from lmtier.config import LMTierConfig

__all__ = [
    "MAX_INPUT_CHARS",
    "add_namespace_arguments",
    "main",
    "read_token_ids",
    "token_ids_from",
]

EXIT_USAGE = 2
MAX_INPUT_CHARS = 64 * 2**20
"""Most characters a command reads as one prompt (token ids, or text): ~7M token ids,
far beyond any context."""
_READ_BLOCK = 1 << 20
_MAX_WORD = 32  # longer than any int64 token id, signs and underscores included
EXIT_INTERRUPTED = 130
"""128 + SIGINT, as a shell reports a command Ctrl-C ended."""
SAMPLE_TOKENS = 1000
"""Length of the built-in ``--sample`` prompt: three full 256-token chunks and a tail."""


def read_token_ids(stream: TextIO, source: str) -> list[int]:
    """Whitespace-separated token ids from ``stream``; ``source`` names it in the
    InvalidTokensError for a word that is not an integer (with its line), and for an
    input over :data:`MAX_INPUT_CHARS` (``/dev/zero`` must end in an error, not in
    memory). Read a block at a time: a file with no line ends is never held whole."""
    ids: list[int] = []
    carry, line_number, total = "", 1, 0
    while block := stream.read(_READ_BLOCK):
        total += len(block)
        if total > MAX_INPUT_CHARS:
            raise InvalidTokensError(
                f"{source}: more than {MAX_INPUT_CHARS} characters of token ids: not a prompt"
            )
        text = carry + block
        # A word that touches the block's end may go on in the next block.
        cut = len(text) if text[-1].isspace() else len(text) - len(text.split()[-1])
        carry = text[cut:]
        line_number = _add_ids(ids, text[:cut], source, line_number)
        if len(carry) > _MAX_WORD:
            raise InvalidTokensError(f"{source}:{line_number}: {brief(carry)} is not a token id")
    _add_ids(ids, carry, source, line_number)
    return ids


def _add_ids(ids: list[int], text: str, source: str, line_number: int) -> int:
    """Append the words of ``text`` (which starts on ``line_number``) as ids; the line
    number at its end."""
    position = 0
    for word in text.split():
        found = text.index(word, position)
        line_number += text.count("\n", position, found)
        position = found + len(word)
        try:
            ids.append(int(word))
        except ValueError:
            raise InvalidTokensError(
                f"{source}:{line_number}: {brief(word)} is not an integer token id"
            ) from None
    return line_number + text.count("\n", position)


def token_ids_from(file: str | None) -> list[int]:
    """Token ids from the file named ``file`` (None or ``-``: stdin)."""
    try:
        if file in (None, "-"):
            return read_token_ids(sys.stdin, "<stdin>")
        path = Path(file)
        try:
            with path.open(encoding="utf-8") as stream:
                return read_token_ids(stream, str(path))
        except OSError as exc:
            raise InvalidTokensError(f"cannot read token ids from {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise InvalidTokensError(
            f"cannot read token ids from {file or '<stdin>'}: not UTF-8 text (byte {exc.start})"
        ) from None


def _sample_token_ids() -> list[int]:
    import numpy as np  # noqa: PLC0415 - see the imports

    # A fixed pseudo-random prompt: the same keys print on every machine.
    rng = np.random.default_rng(2026)
    ids: list[int] = rng.integers(0, 32_000, size=SAMPLE_TOKENS).tolist()
    return ids


def _cmd_keys(args: argparse.Namespace, config: LMTierConfig) -> int:
    from lmtier.chunks.hashers import make_hasher  # noqa: PLC0415 - see the imports
    from lmtier.chunks.keys import Namespace  # noqa: PLC0415
    from lmtier.config import chunk_size_problem  # noqa: PLC0415

    ids = _sample_token_ids() if args.sample else token_ids_from(args.file)
    chunk_size = args.chunk_size if args.chunk_size is not None else config.chunk_size
    problem = chunk_size_problem(chunk_size)
    if problem is not None:
        raise ConfigError(f"--chunk-size {problem}")
    namespace = Namespace(
        model_id=args.model_id if args.model_id is not None else config.model_id,
        model_revision=(
            args.model_revision if args.model_revision is not None else config.model_revision
        ),
        kv_dtype=args.kv_dtype,
        kv_layout=args.kv_layout,
        kv_block_size=args.kv_block_size,
        kv_page_interior=args.kv_page_interior,
        num_layers=args.num_layers,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        chunk_size=chunk_size,
        cache_salt=args.cache_salt or "",
    )
    algorithm = args.hash or config.hash_algorithm
    hasher = make_hasher(namespace, algorithm=algorithm, vocab_size=args.vocab_size)
    keys = hasher.extend(ids)
    out = sys.stdout
    for key in keys:
        out.write(key.hex() + "\n")
    tail = len(ids) - len(keys) * namespace.chunk_size
    logging.getLogger("lmtier.cli").info(
        "%d tokens, %d full chunks of %d, %d tail tokens not keyed (%s)",
        len(ids),
        len(keys),
        namespace.chunk_size,
        tail,
        algorithm,
    )
    return 0


def _count(text: str) -> int:
    """An argparse type: an int >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_namespace_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options that name a cache namespace (model, tenant, chunk size, hash, KV
    geometry) to ``parser``: ``keys`` and the commands that compute keys share them."""
    from lmtier.chunks.format import (  # noqa: PLC0415 - see the imports
        DTYPE_ITEMSIZE,
        LAYOUTS,
        PAGE_INTERIORS,
    )
    from lmtier.chunks.keys import HASH_ALGORITHMS  # noqa: PLC0415

    parser.add_argument("--chunk-size", type=int, help="tokens per chunk (default: config, 256)")
    parser.add_argument("--model-id", help="model id of the namespace (default: config)")
    parser.add_argument("--model-revision", help="model revision / weights fingerprint")
    parser.add_argument("--cache-salt", help="tenant salt: keys differ for every salt")
    parser.add_argument(
        "--hash",
        choices=HASH_ALGORITHMS,
        help="xxh3: chained xxh3-128 (default); vllm: keys from vLLM's sha256_cbor block hashes",
    )
    parser.add_argument("--vocab-size", type=int, help="reject token ids >= this")
    geometry = parser.add_argument_group(
        "KV geometry",
        "part of every key: give the model's to print the keys its cache uses "
        "(0: unspecified, which no cache uses)",
    )
    geometry.add_argument("--num-layers", type=_count, default=0, help="layers")
    geometry.add_argument("--num-kv-heads", type=_count, default=0, help="KV heads per layer")
    geometry.add_argument("--head-dim", type=_count, default=0, help="size of one head")
    geometry.add_argument(
        "--kv-dtype", choices=sorted(DTYPE_ITEMSIZE), default="float32", help="KV element type"
    )
    geometry.add_argument(
        "--kv-layout", choices=sorted(LAYOUTS), default="LKTHD", help="KV layout in chunks"
    )
    geometry.add_argument(
        "--kv-block-size",
        type=_count,
        default=0,
        help="tokens per page block of a paged --kv-layout (LBHSC, LBSHC); 0 for the others",
    )
    geometry.add_argument(
        "--kv-page-interior",
        choices=sorted(PAGE_INTERIORS),
        default="",
        help="how the engine's attention backend lays K and V out in a page block, for a "
        "paged --kv-layout: flash (vLLM on GPU), cpu_attn (vLLM's CPU backend)",
    )


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with two changes that every subcommand's parser inherits (an
    entry point's ``commands.add_parser`` makes one of these): an option a subcommand
    does not know is reported by that subcommand, with its usage, rather than by the
    top-level parser with the list of commands (``lmtier serve --listn``); and the
    parsed arguments carry ``command_prog``, the innermost command's name
    (``lmtier demo serve``), for error messages."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.set_defaults(command_prog=self.prog)  # the innermost parser's wins

    def parse_known_args(  # type: ignore[override]  # argparse's overloads
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            message = f"unrecognized arguments: {' '.join(extras)}"
            if any(_is_global_option(extra) for extra in extras):
                message += " (lmtier's own options, -v and --config, go before the command)"
            self.error(message)
        return parsed, extras


def _is_global_option(word: str) -> bool:
    """Whether ``word`` is an option of the top-level parser (-v, -vv, --config=...)."""
    return (
        word in ("--verbose", "--config")
        or word.startswith("--config=")
        or (len(word) > 1 and word[0] == "-" and set(word[1:]) == {"v"})
    )


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lmtier",
        description="lmtier: a multi-tier KV cache for LLM inference.",
    )
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="YAML config file (default: $LMTIER_CONFIG; LMTIER_* variables override it)",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    keys = commands.add_parser(
        "keys",
        help="print the chunk keys of a token sequence",
        description=(
            "Read whitespace-separated token ids and print one hex key per full chunk "
            "(a partial tail gets no key). Keys are equal across processes and machines "
            "for the same tokens, model, chunk size and cache salt."
        ),
        epilog="example: echo 1 2 3 ... | lmtier keys --chunk-size 16 --model-id llama-3-8b",
    )
    source = keys.add_mutually_exclusive_group()
    source.add_argument("file", nargs="?", help="file of token ids (default: stdin; '-' = stdin)")
    source.add_argument(
        "--sample",
        action="store_true",
        help=f"hash a built-in {SAMPLE_TOKENS}-token sample prompt instead of reading input",
    )
    add_namespace_arguments(keys)
    keys.set_defaults(handler=_cmd_keys)
    for entry in sorted(entry_points(group="lmtier.commands"), key=lambda e: e.name):
        entry.load()(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lmtier`` command; returns the process exit code."""
    try:
        args = _build_parser().parse_args(argv)
    except KeyboardInterrupt:
        print("lmtier: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    name = str(args.command_prog)
    try:
        from lmtier.config import load_config  # noqa: PLC0415 - see the imports

        config = load_config(args.config)
        code: int = args.handler(args, config)
    except LMTierError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ModuleNotFoundError as exc:
        error = missing_extra(exc)
        if error is None:
            raise  # not an extra's module: a broken installation, shown as it is
        print(f"{name}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        # Ctrl-C while a command starts (imports, a model, a cache opening), before it
        # handles signals itself: the shell's convention, without a traceback.
        print(f"{name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `lmtier keys | head` closes the pipe early; that is not an error.
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
