"""The lmtier keys of SGLang's ``--hicache-storage-backend-extra-config``, checked.

SGLang hands a ``dynamic`` backend the whole extra config: its own keys
(:data:`SGLANG_KEYS`) and the backend's. lmtier's (:class:`BackendSettings`) are
checked here, once, when SGLang attaches the backend; an unknown key is an error that
lists the known ones (a typo must not silently open a cache of the defaults).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmtier.config import LMTierConfig, load_config
from lmtier.errors import ConfigError
from lmtier_connector.settings import SidecarSettings, sidecar_settings

__all__ = ["SGLANG_KEYS", "WHERE", "BackendSettings"]

WHERE = "hicache-storage-backend-extra-config"

SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "file_storage_path",  # SGLang sets it for every backend (--file-storage-path)
        "allocator",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
    }
)
"""Keys SGLang itself reads from the extra config (left to it)."""

_OWN_KEYS = frozenset(
    {"config_path", "config", "model_id", "model_revision", "cache_salt", "sidecar"}
)


@dataclass(frozen=True, slots=True)
class BackendSettings:
    """lmtier's keys of the extra config.

    ``config_path``: an lmtier YAML file (default: ``$LMTIER_CONFIG``, then lmtier's
    defaults: a CPU tier and a disk tier); ``config``: overrides of it (nested or
    dotted keys, as :func:`lmtier.config.load_config` takes them). ``model_id``
    (default: SGLang's served model name) and ``model_revision`` (a weights
    fingerprint) name the model in every key: servers that share pages must agree on
    both. ``cache_salt``: a tenant's secret bound into every key of this server (equal
    salts share, others never do). ``sidecar`` and ``sidecar_*``: use that ``lmtier
    serve`` instead of an embedded cache (as for vLLM's connector).
    """

    config: LMTierConfig
    model_id: str | None = None
    model_revision: str = ""
    cache_salt: str = ""
    sidecar: SidecarSettings | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> BackendSettings:
        """Check and read ``extra``; ConfigError naming the first bad key."""
        extra = dict(extra or {})
        unknown = sorted(
            k
            for k in extra
            if k not in SGLANG_KEYS and k not in _OWN_KEYS and not k.startswith("sidecar_")
        )
        if unknown:
            raise ConfigError(
                f"unknown {WHERE} keys {unknown} for lmtier; lmtier reads "
                f"{sorted(_OWN_KEYS | {'sidecar_token', 'sidecar_token_file'})} "
                "and sidecar_shared_memory, sidecar_timeout_s"
            )
        path = extra.get("config_path")
        if path is not None and (not isinstance(path, str) or not path.strip()):
            raise ConfigError(f"{WHERE}.config_path must be a path")
        overrides = extra.get("config", {})
        if not isinstance(overrides, Mapping):
            raise ConfigError(f"{WHERE}.config must be a mapping of lmtier settings")
        strings = {}
        for name in ("model_id", "model_revision", "cache_salt"):
            value = extra.get(name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{WHERE}.{name} must be a str, got {type(value).__name__}")
            strings[name] = value
        model_id = strings["model_id"]
        if model_id is not None and not model_id.strip():
            raise ConfigError(f"{WHERE}.model_id must not be empty")
        return cls(
            config=load_config(path, overrides=dict(overrides)),
            model_id=model_id,
            model_revision=strings["model_revision"] or "",
            cache_salt=strings["cache_salt"] or "",
            sidecar=sidecar_settings(extra, where=WHERE),
        )
