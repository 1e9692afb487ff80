"""The cache a model command opens from its flags: the config's tiers embedded in this
process, or a client of the ``lmtier serve`` that ``--sidecar URL`` names.

Shared by ``lmtier demo``, ``demo serve`` (through :func:`lmtier_apps.demo.demo.
open_cache`), ``warm`` and ``unpin``. It imports neither transformers nor the model
code, so that ``lmtier warm`` can open the cache and look its prompts up before it
pays for a model it may not need.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from lmtier.config import LMTierConfig
from lmtier.config.secrets import read_secret_file
from lmtier.errors import AuthenticationError, BackendUnavailable, PermissionDeniedError

if TYPE_CHECKING:
    from lmtier.api import LMTier
    from lmtier.kv_spec import KVSpec

__all__ = ["open_command_cache", "sidecar_problem"]


def open_command_cache(
    args: argparse.Namespace,
    config: LMTierConfig,
    spec: KVSpec,
    *,
    model_id: str,
    revision: str,
    vocab_size: int | None,
    client_name: str,
) -> LMTier:
    """The embedded cache, or a client of the sidecar at ``args.sidecar`` (its token
    from ``args.sidecar_token_file``); ``client_name`` is how the sidecar's logs and
    metrics name this process."""
    from lmtier.api import LMTier  # noqa: PLC0415 - torch, only when a command runs
    from lmtier.remote.client import connect  # noqa: PLC0415 - the grpc extra

    if not args.sidecar:
        return LMTier.open(
            config, kv=spec, model_id=model_id, model_revision=revision, vocab_size=vocab_size
        )
    token_file = getattr(args, "sidecar_token_file", None)
    token = read_secret_file(token_file, "--sidecar-token-file") if token_file else None
    return connect(
        args.sidecar,
        config,
        kv=spec,
        token=token,
        client_name=client_name,
        model_id=model_id,
        model_revision=revision,
        vocab_size=vocab_size,
    )


def sidecar_problem(
    args: argparse.Namespace, cache: LMTier, *, command: str, cache_salt: str | None = None
) -> str | None:
    """A one-line message when ``--sidecar`` was given and the sidecar cannot be used:
    it does not answer, refuses the token, or (for a command that works under one
    ``cache_salt``) does not let the token use that salt. A client that cannot use the
    sidecar serves misses, which would look like a cold cache. A command serving
    requests of any salt (``cache_salt`` None) only needs the sidecar to answer: the
    token's scope decides each request."""
    check = getattr(cache, "check", None) if args.sidecar else None
    if check is None:
        return None
    try:
        check(cache_salt or "")
    except PermissionDeniedError as exc:
        return None if cache_salt is None else f"{command}: {exc}"
    except AuthenticationError as exc:
        return f"{command}: the sidecar at {args.sidecar} refused the token: {exc}"
    except BackendUnavailable:
        return (
            f"{command}: the sidecar at {args.sidecar} does not answer (is `lmtier "
            "serve` running there?)"
        )
    return None
