"""The caches the operations commands open: a config's embedded tiers, or a sidecar.

Both are :class:`~lmtier.LMTier` objects, so a command runs the same calls against
either (``stats``, ``lookup``). Two things differ from an engine's cache:

* An operations process is not an engine: its own host memory never holds anything
  worth reporting. So the embedded cache opens with the CPU tier off and the least
  staging memory (two chunks), not the configured ``cpu.capacity_bytes``: allocating
  and touching the 4 GiB of a default CPU tier (seconds, at ~1.5 GB/s) to report an
  empty one would make ``lmtier stats`` slow and heavy. The lower tiers (disk, Redis,
  S3) open as configured: their chunks are shared with the engines that use them.
* A sidecar client streams (no shared-memory mapping: these commands move no KV),
  and a sidecar that does not answer, or refuses the token or the namespace the
  command names (``--cache-salt``, the model), is an error here, where an engine
  would take misses: an operator asking "what is cached?" must not be told "nothing".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmtier.chunks.format import align_up
from lmtier.config import LMTierConfig, Secret
from lmtier.config.secrets import read_secret_file

if TYPE_CHECKING:
    from lmtier.api import LMTier
    from lmtier.kv_spec import KVSpec

__all__ = ["OPS_MODEL_ID", "STAGING_CHUNKS", "connect_sidecar", "open_cache", "open_embedded"]

OPS_MODEL_ID = "lmtier-ops"
"""The model id of the namespace a command opens when it needs one but has no model
(``lmtier stats``): a namespace of its own, which holds no chunks."""
STAGING_CHUNKS = 2
"""Host memory of an operations process, in chunks: enough for a lookup's needs."""
_PAGE = 4096


def open_embedded(config: LMTierConfig, kv: KVSpec, **model: Any) -> LMTier:
    """The tiers of ``config`` opened in this process, with the CPU tier off and two
    chunks of staging memory (module docstring); ``model``: LMTier's keywords."""
    from lmtier.api import LMTier  # noqa: PLC0415 - torch, only when a command runs

    slab = align_up(kv.encoded_chunk_bytes(config.chunk_size), _PAGE)
    small = config.replace(
        cpu=config.cpu.replace(enabled=False, staging_bytes=STAGING_CHUNKS * slab)
    )
    return LMTier.open(small, kv=kv, **model)


def connect_sidecar(
    target: str,
    config: LMTierConfig,
    kv: KVSpec,
    *,
    token_file: str | None = None,
    cache_salt: str = "",
    **model: Any,
) -> LMTier:
    """A client of the sidecar at ``target`` that has opened a session of the model's
    namespace under ``cache_salt`` (the one the command asks through: a token scoped
    to salts may open no other).

    The token is ``token_file``'s first line, else the config's ``sidecar.auth_token``
    or ``auth_token_file`` (the node's own config names the token its sidecar wants).
    BackendUnavailable when the sidecar cannot be reached, AuthenticationError when it
    refuses the token, PermissionDeniedError when the token does not cover that
    namespace (each one line).
    """
    from lmtier.api import LMTier  # noqa: PLC0415 - torch, only when a command runs
    from lmtier.remote.client import SidecarStore  # noqa: PLC0415 - the grpc extra

    store = SidecarStore(
        target,
        token=_token(config, token_file),
        shared_memory=False,
        client_name="lmtier ops",
        open_session=False,  # the check below opens the one it asks through
        keepalive_s=config.sidecar.keepalive_s,
    )
    cache = LMTier(config, kv, store=store, **model).start()
    try:
        return cache.check(cache_salt)
    except BaseException:
        cache.close()
        raise


def open_cache(
    config: LMTierConfig,
    kv: KVSpec,
    *,
    sidecar: str | None,
    token_file: str | None = None,
    cache_salt: str = "",
    **model: Any,
) -> LMTier:
    """The sidecar at ``sidecar`` (:func:`connect_sidecar`), else the embedded tiers."""
    if sidecar:
        return connect_sidecar(
            sidecar, config, kv, token_file=token_file, cache_salt=cache_salt, **model
        )
    return open_embedded(config, kv, **model)


def _token(config: LMTierConfig, token_file: str | None) -> Secret | None:
    if token_file:
        return read_secret_file(token_file, "--sidecar-token-file")
    sidecar = config.sidecar
    if sidecar.auth_token is not None:
        return sidecar.auth_token
    if sidecar.auth_token_file is not None:
        return read_secret_file(sidecar.auth_token_file, "sidecar.auth_token_file")
    return None
