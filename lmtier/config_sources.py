"""Where configuration values come from, each source flattened to dotted keys.

:func:`lmtier.config.load_config` layers three sources: a YAML file, ``LMTIER_*``
environment variables and overrides from code. Each is turned here into a dict
from dotted key (``"cpu.capacity_bytes"``) to a :class:`Setting`: the raw value, and
where it came from so that an error can say so. Nothing here converts or checks
values (that is :mod:`lmtier.config`'s job); this module only knows key names.

LMCache's key names are translated here (the table is in :mod:`lmtier.config`), in
files and overrides; never in the environment, whose names are ours alone.
"""

from __future__ import annotations

import difflib
import logging
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import yaml

from lmtier.errors import ConfigError, brief
from lmtier.secrets import redact_url

__all__ = [
    "CONFIG_ENV_VAR",
    "ENV_PREFIX",
    "LMCACHE_KEYS",
    "REDIS_SCHEMES",
    "Setting",
    "env_name",
    "flatten",
    "from_environment",
    "read_yaml",
]

logger = logging.getLogger(__name__)

ENV_PREFIX = "LMTIER_"
CONFIG_ENV_VAR = "LMTIER_CONFIG"
"""Names the YAML file when no path is passed; the one ``LMTIER_*`` name that is no key."""
REDIS_SCHEMES = ("redis", "rediss", "unix")
_GIB = 1024**3


@dataclass(frozen=True, slots=True)
class Setting:
    """One raw value from one source.

    - ``value``: as the source gave it (a YAML scalar, an env string, any object).
    - ``origin``: the key or variable that set it (``"max_local_cpu_size"``,
      ``"LMTIER_CPU__CAPACITY_BYTES"``), to name both sides of a conflict.
    - ``note``: where it came from, appended to error messages (``" (in /etc/x.yaml)"``).
    """

    value: Any
    origin: str
    note: str


def read_yaml(path: Path) -> Mapping[Any, Any]:
    """The file's top-level mapping; an empty file is ``{}``. Uses ``yaml.safe_load`` only."""
    try:
        with path.open(encoding="utf-8") as stream:
            data = yaml.safe_load(stream)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text: {exc.reason}") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"invalid YAML in {path}{where}: {reason}") from exc
    if data is None:  # empty, or only comments: all defaults
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def flatten(
    data: Mapping[Any, Any], keys: Collection[str], note: str, *, dotted: bool
) -> dict[str, Setting]:
    """Dotted keys of a mapping shaped like the file, LMCache keys translated to ours.

    ``keys`` are the valid dotted keys; anything else is a ConfigError naming the
    closest one. ``dotted`` also allows ``{"cpu.capacity_bytes": ...}`` (overrides);
    a file keeps one spelling per field, the nested one. A field set twice (an
    LMCache key and ours) is a ConfigError naming both.
    """
    sections = {key.partition(".")[0] for key in keys if "." in key}
    out: dict[str, Setting] = {}
    for name, value in data.items():
        if not isinstance(name, str):
            raise ConfigError(f"config key {brief(name)} is not a string{note}")
        if name in LMCACHE_KEYS:
            try:
                mapped = LMCACHE_KEYS[name](value)
            except ValueError as exc:
                raise ConfigError(f"{name}: {exc}{note}") from None
            logger.debug("LMCache key %r mapped to %s", name, [key for key, _ in mapped])
            for key, item in mapped:
                _put(out, keys, key, Setting(item, name, note))
        elif name in sections:
            if value is None:  # "redis:" with nothing under it
                continue
            if not isinstance(value, Mapping):
                kind = type(value).__name__
                raise ConfigError(f"{name}: must be a mapping of settings, got {kind}{note}")
            for sub, item in value.items():
                key = f"{name}.{sub}"
                _put(out, keys, key, Setting(item, key, note))
        elif "." in name and name in keys and not dotted:
            section, _, sub = name.partition(".")
            raise ConfigError(f"'{name}': write it nested, as '{section}: {{{sub}: ...}}'{note}")
        else:
            _put(out, keys, name, Setting(value, name, note))
    return out


def _put(out: dict[str, Setting], keys: Collection[str], key: str, setting: Setting) -> None:
    if key not in keys:
        sections = {k.partition(".")[0] for k in keys if "." in k}
        close = difflib.get_close_matches(key, [*keys, *sections, *LMCACHE_KEYS], n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"unknown config key {brief(key)}{hint}{setting.note}")
    if key in out:
        first = out[key].origin
        both = (
            f"'{first}' twice" if first == setting.origin else f"'{first}' and '{setting.origin}'"
        )
        raise ConfigError(f"{both} both set {key}; keep one{setting.note}")
    out[key] = setting


def from_environment(env: Mapping[str, str], keys: Collection[str]) -> dict[str, Setting]:
    """``LMTIER_*`` variables by dotted key (``LMTIER_CPU__X`` is ``cpu.x``).

    Any ``LMTIER_*`` name but :data:`CONFIG_ENV_VAR` that is no key is a ConfigError:
    a misspelt variable that silently did nothing would be worse.
    """
    out: dict[str, Setting] = {}
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var == CONFIG_ENV_VAR:
            continue
        key = var.removeprefix(ENV_PREFIX).lower().replace("__", ".")
        if key not in keys:
            close = difflib.get_close_matches(key, list(keys), n=1)
            hint = f" (did you mean {env_name(close[0])}?)" if close else ""
            raise ConfigError(
                f"unknown config key {brief(key)} from environment variable {var}{hint}"
            )
        out[key] = Setting(env[var], var, f" (from environment variable {var})")
    return out


def env_name(key: str) -> str:
    """The variable for a dotted key: ``cpu.capacity_bytes`` -> ``LMTIER_CPU__CAPACITY_BYTES``."""
    return ENV_PREFIX + key.upper().replace(".", "__")


# --- LMCache's key names -------------------------------------------------------------
# Each translator returns (dotted key, raw value) pairs, or raises ValueError with the
# problem; values are converted and checked later, like any other.


def _lmcache_gb(target: str) -> Callable[[Any], list[tuple[str, Any]]]:
    """LMCache sizes are numbers of "GB" that it multiplies by 1024**3."""

    def translate(value: Any) -> list[tuple[str, Any]]:
        number = value
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                raise ValueError(f"must be a number of GB, got {brief(value)}") from None
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ValueError(f"must be a number of GB, got {brief(value)}")
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"must be a non-negative number of GB, got {brief(value)}")
        return [(target, round(number * _GIB))]

    return translate


def _lmcache_local_disk(value: Any) -> list[tuple[str, Any]]:
    if value is None or value is False:
        return [("disk.enabled", False)]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"must be a path, a file:// URL, or null, got {brief(value)}")
    if value.startswith("file:"):
        parts = urlsplit(value)
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise ValueError(f"must be a file:///absolute/path URL, got {brief(value)}")
        value = unquote(parts.path)
    return [("disk.enabled", True), ("disk.path", value)]


def _lmcache_remote_url(value: Any) -> list[tuple[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, str):
        raise ValueError(f"must be a URL string, got {type(value).__name__}")
    scheme = value.partition("://")[0].lower() if "://" in value else ""
    if scheme in REDIS_SCHEMES:
        return [("redis.url", value)]
    if scheme == "s3":
        parts = urlsplit(value)
        bucket = parts.netloc.rpartition("@")[2]
        if not bucket:
            raise ValueError(f"an s3:// URL needs a bucket, got {brief(redact_url(value))}")
        prefix = parts.path.strip("/")
        # Only an explicit prefix replaces ours; a bare s3://bucket keeps "lmtier/".
        return [("s3.bucket", bucket)] + ([("s3.prefix", prefix + "/")] if prefix else [])
    supported = ", ".join(f"{s}://" for s in (*REDIS_SCHEMES, "s3"))
    raise ValueError(f"scheme {scheme!r} is not supported by lmtier (use {supported})")


LMCACHE_KEYS: dict[str, Callable[[Any], list[tuple[str, Any]]]] = {
    "local_cpu": lambda value: [("cpu.enabled", value)],
    "max_local_cpu_size": _lmcache_gb("cpu.capacity_bytes"),
    "local_disk": _lmcache_local_disk,
    "max_local_disk_size": _lmcache_gb("disk.capacity_bytes"),
    "remote_url": _lmcache_remote_url,
}
"""LMCache key -> translator to (dotted key, raw value) pairs."""
