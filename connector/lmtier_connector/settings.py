"""What every engine integration reads from its engine's extra config the same way:
the sidecar to use instead of an embedded cache (:class:`SidecarSettings`), bounded
numbers, and the cache it opens (:func:`open_engine_cache`).

Each engine names its extra config differently (vLLM's ``kv_connector_extra_config``,
SGLang's ``--hicache-storage-backend-extra-config``): every error names the key as
the user wrote it, under that name (``where``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import lmtier
from lmtier.api import LMTier
from lmtier.config import LMTierConfig, Secret
from lmtier.config.secrets import read_secret_file
from lmtier.errors import ConfigError
from lmtier.kv_spec import KVSpec

__all__ = ["SidecarSettings", "bounded_number", "open_engine_cache", "sidecar_settings"]


@dataclass(frozen=True, slots=True)
class SidecarSettings:
    """Where an engine's cache lives when it is a sidecar's client
    (:func:`lmtier.connect`): its ``target``, the bearer ``token``,
    whether to map its shared host pool (``shared_memory``; else chunks stream), and
    each call's deadline (``timeout_s``: what a sidecar that stops answering costs
    the one call it hangs, a load inside a step included)."""

    target: str
    token: Secret | None = None
    shared_memory: bool = True
    timeout_s: float = 10.0


def bounded_number(
    value: object, name: str, span: str, within: Callable[[float], bool], *, where: str
) -> float:
    """``value`` as a float if it is a number (not a bool) ``within`` its bounds (named
    ``span`` in the error), else a ConfigError naming ``where.name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not within(value):
        raise ConfigError(f"{where}.{name} must be a number of {span}, got {value!r:.40}")
    return float(value)


def sidecar_settings(extra: Mapping[str, Any], *, where: str) -> SidecarSettings | None:
    """The ``sidecar*`` keys of an extra config (None: an embedded cache)."""
    target = extra.get("sidecar")
    options = sorted(k for k in extra if k.startswith("sidecar_"))
    if target is None:
        if options:
            raise ConfigError(f"{where} {options} need 'sidecar' (a target)")
        return None
    if not isinstance(target, str) or not target.strip():
        raise ConfigError(f"{where}.sidecar must be 'unix:///path.sock' or 'host:port'")
    token, token_file = extra.get("sidecar_token"), extra.get("sidecar_token_file")
    if token is not None and token_file is not None:
        raise ConfigError("set one of sidecar_token and sidecar_token_file, not both")
    if token is not None and (not isinstance(token, str) or not token.strip()):
        raise ConfigError(f"{where}.sidecar_token must be a non-empty str")
    secret = Secret(token.strip()) if token is not None else None
    if token_file is not None:
        if not isinstance(token_file, str) or not token_file.strip():
            raise ConfigError(f"{where}.sidecar_token_file must be a path")
        secret = read_secret_file(token_file, "sidecar_token_file")
    shared = extra.get("sidecar_shared_memory", True)
    if not isinstance(shared, bool):
        raise ConfigError(f"{where}.sidecar_shared_memory must be a bool")
    timeout = bounded_number(
        extra.get("sidecar_timeout_s", 10.0),
        "sidecar_timeout_s",
        "seconds in (0, 3600]",
        lambda v: 0 < v <= 3600,
        where=where,
    )
    return SidecarSettings(target.strip(), secret, shared, timeout)


def open_engine_cache(
    config: LMTierConfig,
    spec: KVSpec,
    *,
    model_id: str,
    model_revision: str,
    tp_size: int,
    tp_rank: int,
    sidecar: SidecarSettings | None,
    engine: str,
) -> LMTier:
    """A started LMTier for an engine's process: a client of ``sidecar`` (one that is
    down is not an error here: calls miss until it is up), or a cache of its own,
    opened now so that a misconfigured tier fails at the engine's start."""
    if sidecar is not None:
        return lmtier.connect(
            sidecar.target,
            config,
            kv=spec,
            model_id=model_id,
            model_revision=model_revision,
            tp_size=tp_size,
            tp_rank=tp_rank,
            token=sidecar.token,
            shared_memory=sidecar.shared_memory,
            timeout_s=sidecar.timeout_s,
            client_name=f"{engine} pid {os.getpid()} rank {tp_rank}",
        )
    cache = LMTier(
        config,
        spec,
        model_id=model_id,
        model_revision=model_revision,
        tp_size=tp_size,
        tp_rank=tp_rank,
    )
    cache.start()
    return cache
