"""Where configuration values come from, layered into one :class:`LMTierConfig`.

The CLI, the sidecar and the engine connector call :func:`load_config` once and pass
the result down; nothing below them reads the environment or a file.

Precedence, lowest first: field defaults < the YAML file < LMCache's environment
variables < ``LMTIER_*`` environment variables < ``overrides`` passed by code. Each
layer replaces single keys, not whole sections. The file is the ``path`` argument,
else ``$LMTIER_CONFIG``, else an LMCache file named by ``$LMCACHE_CONFIG_FILE`` (its
keys translated, :mod:`.lmcache`), else none. LMCache's key names are also accepted
at the top level of an lmtier file and in ``overrides``; one file may not set a field
both ways.

LMCache reads ``LMCACHE_<KEY>`` variables (``LMCACHE_CHUNK_SIZE=256``,
``LMCACHE_LOCAL_CPU=True``, ``LMCACHE_MAX_LOCAL_CPU_SIZE=20``, ``LMCACHE_LOCAL_DISK``,
``LMCACHE_MAX_LOCAL_DISK_SIZE``, ``LMCACHE_REMOTE_URL``), and so does lmtier, through
the same translation as LMCache's file keys (``none`` or an empty value: unset, as
LMCache's null). Any other ``LMCACHE_*`` variable but ``LMCACHE_CONFIG_FILE`` is an
error naming every such variable: a setting that silently did nothing would be worse.

Environment names are ``LMTIER_`` plus the dotted key in capitals with ``__`` for the
dot: ``LMTIER_CHUNK_SIZE=512``, ``LMTIER_CPU__CAPACITY_BYTES=8GiB``,
``LMTIER_REDIS__URL=redis://:pw@cache:6379/0``; they are read by pydantic-settings'
env source over the mapping given. An empty value sets an optional field to None
(``LMTIER_REDIS__URL=`` disables Redis). Any other ``LMTIER_*`` name is an error,
like an unknown key in a file, with the closest valid name as a hint.

Every value keeps where it came from (:class:`Setting`), so an error names the file,
the variable or the overrides, besides the dotted key.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from lmtier.config import lmcache
from lmtier.config.model import LMTierConfig, default_disk_path, home_dir
from lmtier.config.types import config_error
from lmtier.errors import ConfigError, brief

__all__ = [
    "CONFIG_ENV_VAR",
    "ENV_PREFIX",
    "LMCACHE_CONFIG_ENV_VAR",
    "LMCACHE_ENV_PREFIX",
    "Setting",
    "config_from_dict",
    "env_name",
    "load_config",
    "read_yaml",
]

logger = logging.getLogger(__name__)

ENV_PREFIX = "LMTIER_"
CONFIG_ENV_VAR = "LMTIER_CONFIG"
"""Names the YAML file when no path is passed; the one ``LMTIER_*`` name that is no key."""
LMCACHE_CONFIG_ENV_VAR = "LMCACHE_CONFIG_FILE"
"""LMCache's own variable naming its YAML file: read when lmtier has no file of its own."""
LMCACHE_ENV_PREFIX = "LMCACHE_"
"""LMCache's settings in the environment: ``LMCACHE_`` plus its key in capitals."""


@dataclass(frozen=True, slots=True)
class Setting:
    """One raw value from one source: ``value`` as the source gave it, ``origin`` the
    key or variable that set it (to name both sides of a conflict), ``note`` where it
    came from, appended to error messages (``" (in /etc/x.yaml)"``)."""

    value: Any
    origin: str
    note: str


def _keys(model: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    """Every valid dotted key of ``model`` -> its field annotation."""
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out.update(_keys(annotation, f"{prefix}{name}."))
        else:
            out[prefix + name] = annotation
    return out


KEYS = _keys(LMTierConfig)
_SECTIONS = {key.partition(".")[0] for key in KEYS if "." in key}
_PATHS = {key for key, annotation in KEYS.items() if "Path" in str(annotation)}
_OPTIONAL = {key for key, annotation in KEYS.items() if type(None) in get_args(annotation)}


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
    data: Mapping[Any, Any], note: str, *, dotted: bool, lmcache_only: bool = False
) -> dict[str, Setting]:
    """Dotted keys of a mapping shaped like the file, LMCache keys translated to ours.

    ``dotted`` also allows ``{"cpu.capacity_bytes": ...}`` (overrides); a file keeps
    one spelling per field, the nested one. ``lmcache_only``: an LMCache file, whose
    keys must all be LMCache's. Unknown keys and a field set twice are ConfigErrors.
    """
    out: dict[str, Setting] = {}
    for name, value in data.items():
        if not isinstance(name, str):
            raise ConfigError(f"config key {brief(name)} is not a string{note}")
        if lmcache_only or (name in lmcache.KEYS and name not in KEYS):
            for key, item in _translate(name, value, note):
                _put(out, key, Setting(item, name, note))
        elif name in lmcache.UNSUPPORTED:
            raise ConfigError(_unsupported(name, note))
        elif name in _SECTIONS:
            if value is None:  # "redis:" with nothing under it
                continue
            if not isinstance(value, Mapping):
                kind = type(value).__name__
                raise ConfigError(f"{name}: must be a mapping of settings, got {kind}{note}")
            for sub, item in value.items():
                key = f"{name}.{sub}"
                _put(out, key, Setting(item, key, note))
        elif "." in name and name in KEYS and not dotted:
            section, _, sub = name.partition(".")
            raise ConfigError(f"'{name}': write it nested, as '{section}: {{{sub}: ...}}'{note}")
        else:
            _put(out, name, Setting(value, name, note))
    return out


def _translate(name: str, value: Any, note: str) -> list[tuple[str, Any]]:
    if name in lmcache.UNSUPPORTED:
        raise ConfigError(_unsupported(name, note))
    translator = lmcache.KEYS.get(name)
    if translator is None:
        close = difflib.get_close_matches(name, [*lmcache.KEYS, *lmcache.UNSUPPORTED], n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"unknown LMCache config key {brief(name)}{hint}{note}")
    try:
        mapped = translator(value)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}{note}") from None
    logger.debug("LMCache key %r mapped to %s", name, [key for key, _ in mapped])
    return mapped


def _unsupported(name: str, note: str) -> str:
    return f"LMCache's {name!r} is not supported by lmtier: {lmcache.UNSUPPORTED[name]}{note}"


def _put(out: dict[str, Setting], key: str, setting: Setting) -> None:
    if key not in KEYS:
        candidates = [*KEYS, *_SECTIONS, *lmcache.KEYS]
        close = difflib.get_close_matches(key, candidates, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"unknown config key {brief(key)}{hint}{setting.note}")
    if key in out:
        first = out[key].origin
        both = (
            f"'{first}' twice" if first == setting.origin else f"'{first}' and '{setting.origin}'"
        )
        raise ConfigError(f"{both} both set {key}; keep one{setting.note}")
    out[key] = setting


def from_lmcache_environment(env: Mapping[str, str]) -> dict[str, Setting]:
    """``LMCACHE_*`` variables by dotted key, translated as LMCache's file keys are
    (:mod:`.lmcache`). ConfigError naming every ``LMCACHE_*`` variable that has no
    lmtier meaning (LMCache's variable naming its file, :data:`LMCACHE_CONFIG_ENV_VAR`,
    is read by :func:`load_config`)."""
    names = sorted(
        var for var in env if var.startswith(LMCACHE_ENV_PREFIX) and var != LMCACHE_CONFIG_ENV_VAR
    )
    keys = {var: var[len(LMCACHE_ENV_PREFIX) :].lower() for var in names}
    refused = [var for var in names if keys[var] not in lmcache.KEYS]
    if refused:
        reasons = [
            f"{var} ({lmcache.UNSUPPORTED[keys[var]]})" if keys[var] in lmcache.UNSUPPORTED else var
            for var in refused
        ]
        known = ", ".join(LMCACHE_ENV_PREFIX + key.upper() for key in lmcache.KEYS)
        raise ConfigError(
            f"LMCache environment variables lmtier has no use for: {'; '.join(reasons)}. "
            f"Unset them (lmtier reads {known}, and LMTIER_* variables)"
        )
    out: dict[str, Setting] = {}
    for var in names:
        note = f" (from environment variable {var})"
        value: Any = env[var]
        if value.strip().lower() in ("", "none", "null"):
            value = None
        for key, item in _translate(keys[var], value, note):
            _put(out, key, Setting(item, var, note))
    return out


def from_environment(env: Mapping[str, str]) -> dict[str, Setting]:
    """``LMTIER_*`` variables by dotted key (``LMTIER_CPU__X`` is ``cpu.x``), read by
    pydantic-settings. Any ``LMTIER_*`` name but :data:`CONFIG_ENV_VAR` that is no key
    is a ConfigError: a misspelt variable that silently did nothing would be worse."""
    names: dict[str, str] = {}
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var == CONFIG_ENV_VAR:
            continue
        key = var[len(ENV_PREFIX) :].lower().replace("__", ".")
        if key not in KEYS:
            close = difflib.get_close_matches(key, list(KEYS), n=1)
            hint = f" (did you mean {env_name(close[0])}?)" if close else ""
            raise ConfigError(
                f"unknown config key {brief(key)} from environment variable {var}{hint}"
            )
        names[key] = var
    # A blank value unsets an optional field (the sections turn "" into None); it is
    # not handed to pydantic-settings, which would try to decode it as JSON.
    given = {var: env[var] for var in names.values() if env[var].strip()}
    nested = _read_env(given) if given else {}
    out: dict[str, Setting] = {}
    for key, var in names.items():
        section, _, field = key.rpartition(".")
        value = (nested.get(section, {}) if section else nested).get(field, "")
        out[key] = Setting(value, var, f" (from environment variable {var})")
    return out


def _read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """``LMTIER_*`` values as the nested mapping of the config, by pydantic-settings'
    env source over ``environ`` (imported here: it costs ~80 ms, and ``lmtier keys``
    must start fast when no variable is set)."""
    from pydantic_settings import EnvSettingsSource  # noqa: PLC0415

    class Source(EnvSettingsSource):
        def _load_env_vars(self) -> Mapping[str, str | None]:
            return {name.lower(): value for name, value in environ.items()}

    # A plain model, not a BaseSettings: every option pydantic-settings would read
    # from a settings class is given here.
    source = Source(
        LMTierConfig,  # type: ignore[arg-type]
        case_sensitive=False,
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
    )
    return source()


def env_name(key: str) -> str:
    """The variable for a dotted key: ``cpu.capacity_bytes`` -> ``LMTIER_CPU__CAPACITY_BYTES``."""
    return ENV_PREFIX + key.upper().replace(".", "__")


def _build(settings: Mapping[str, Setting], env: Mapping[str, str] | None) -> LMTierConfig:
    """Validate the layered settings into one config; errors say where a value came from."""
    nested: dict[str, Any] = {}
    for key, setting in settings.items():
        value = setting.value
        if key in _OPTIONAL and value == "":
            value = None  # LMTIER_REDIS__URL= unsets, as an empty value in a file does
        if key in _PATHS and isinstance(value, (str, Path)):
            value = _expand_home(Path(value) if str(value).strip() else value, env)
        section, _, field = key.rpartition(".")
        (nested.setdefault(section, {}) if section else nested)[field] = value
    if env is not None and "path" not in nested.get("disk", {}):
        nested.setdefault("disk", {})["path"] = default_disk_path(env)
    where = {key: setting.note for key, setting in settings.items()}
    try:
        return LMTierConfig.model_validate(nested)
    except PydanticValidationError as exc:
        raise config_error(exc, model=LMTierConfig, where=where) from None
    except ConfigError as exc:  # raised by a section: add where its value came from
        if exc.key is None or exc.key not in where:
            raise
        raise ConfigError(f"{exc}{where[exc.key]}", key=exc.key) from None


def _expand_home(path: Any, env: Mapping[str, str] | None) -> Any:
    if isinstance(path, Path) and path.parts and path.parts[0] == "~":
        return home_dir(env).joinpath(*path.parts[1:])
    return path


def config_from_dict(
    data: Mapping[str, Any], *, env: Mapping[str, str] | None = None
) -> LMTierConfig:
    """Build a config from a mapping shaped like the YAML file (LMCache keys allowed).

    ``env`` is used only for defaults that depend on the user (``XDG_CACHE_HOME`` and
    ``HOME``, for the disk path and ``~``), never for ``LMTIER_*`` values; None means
    the process environment, as for ``LMTierConfig()``.
    """
    return _build(flatten(data, "", dotted=False), env)


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> LMTierConfig:
    """Load the config: defaults < YAML file < ``LMCACHE_*`` < ``LMTIER_*`` in ``env`` <
    ``overrides``.

    ``path`` defaults to ``env["LMTIER_CONFIG"]``, then to an LMCache file named by
    ``env["LMCACHE_CONFIG_FILE"]``; with none, there is no file. ``env`` defaults to
    ``os.environ``: this is the one place that reads it. Keys in ``overrides`` are
    nested like the file's or dotted (``"cpu.capacity_bytes"``).
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    settings: dict[str, Setting] = {}
    lmcache_file = False
    if path is None:
        path = environ.get(CONFIG_ENV_VAR) or None
    if path is None and environ.get(LMCACHE_CONFIG_ENV_VAR):
        path, lmcache_file = environ[LMCACHE_CONFIG_ENV_VAR], True
    if path is not None:
        file_path = _expand_home(Path(path), environ)
        data = read_yaml(file_path)
        settings.update(
            flatten(data, f" (in {file_path})", dotted=False, lmcache_only=lmcache_file)
        )
    settings.update(from_lmcache_environment(environ))
    settings.update(from_environment(environ))
    if overrides:
        settings.update(flatten(overrides, " (in overrides)", dotted=True))
    config = _build(settings, environ)
    logger.debug("loaded config from %s: %r", path or "defaults and environment", config)
    return config
