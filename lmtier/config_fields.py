"""Typed fields of the frozen config dataclasses, checked the same way on every path.

A field's rules live in its ``dataclasses.field(metadata=...)`` (see :func:`rules`),
next to its default, and its type is read from its annotation: there is one place
that says what a field is, and both a direct ``CPUTierConfig(capacity_bytes=-1)`` and
a file go through the same :func:`problem`. Loading adds :func:`coerce`, which turns
raw values (YAML scalars, environment strings) into the field's type first, and
:func:`to_plain` turns a config back into plain data.

Annotations are strings here (``from __future__ import annotations``), so the type
is looked up by name: ``"int"``, ``"float | None"``, ``"SecretURL | None"``. A field
of a type with no entry in ``_IS_TYPE`` is checked by class name (the sections).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import Field, fields, is_dataclass
from pathlib import Path
from typing import Any

from lmtier.errors import ConfigError, brief
from lmtier.secrets import MASK, Secret, SecretURL
from lmtier.sizes import parse_size

__all__ = [
    "NOT_EMPTY",
    "POSITIVE",
    "Check",
    "at_least",
    "coerce",
    "expand_home",
    "home_dir",
    "problem",
    "rules",
    "to_plain",
    "validate",
]

Check = Callable[[Any], "str | None"]
"""A field's own rule: the problem with a value of the right type, or None."""


def rules(check: Check | None = None, normalize: Callable[[str], str] | None = None) -> Any:
    """Metadata for ``dataclasses.field``: a ``check`` run on every construction, and a
    ``normalize`` applied to strings while loading (``str.upper`` for log levels)."""
    return {"check": check, "normalize": normalize}


def at_least(lowest: int) -> Any:
    """Rules for a number that must be ``>= lowest``."""
    return rules(check=lambda v: None if v >= lowest else f"must be >= {lowest}, got {v}")


POSITIVE = rules(check=lambda v: None if v > 0 else f"must be > 0, got {v}")
NOT_EMPTY = rules(check=lambda v: None if v.strip() else "must not be empty")

_IS_TYPE: dict[str, Callable[[Any], bool]] = {
    "bool": lambda v: isinstance(v, bool),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    "str": lambda v: isinstance(v, str),
    "Path": lambda v: isinstance(v, Path),
    "Secret": lambda v: isinstance(v, Secret),
    "SecretURL": lambda v: isinstance(v, SecretURL),
    "HashAlgorithm": lambda v: v in ("xxh3", "vllm"),
}
_EXPECTED = {
    "bool": "true or false (or yes/no, 1/0)",
    "int": "an integer",
    "float": "a finite number",
    "str": "a string (quote it in YAML)",
    "Path": "a non-empty path",
    "Secret": "a string",
    "SecretURL": "a URL string",
    "HashAlgorithm": "one of 'xxh3', 'vllm'",
}
_BOOL_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _kind(f: Field[Any]) -> tuple[str, bool]:
    """The field's base type name and whether None is allowed."""
    text = str(f.type)
    return text.removesuffix(" | None"), text.endswith(" | None")


def problem(f: Field[Any], value: Any) -> str | None:
    """What is wrong with ``value`` for field ``f`` (type, then the field's check), or None.

    The message never quotes a secret: for Secret fields it names only the type.
    """
    base, optional = _kind(f)
    if value is None and optional:
        return None
    is_type = _IS_TYPE.get(base, lambda v: type(v).__name__ == base)
    if not is_type(value):
        shown = type(value).__name__ if base in ("Secret", "SecretURL") else brief(value)
        return f"must be {_EXPECTED.get(base, base)}, got {shown}"
    check: Check | None = f.metadata.get("check")
    return check(value) if check is not None else None


def validate(obj: Any, section: str) -> None:
    """Raise ConfigError naming ``section.field`` for the first bad field of ``obj``.

    A plain ``str`` given for a secret field (``RedisTierConfig(url="redis://...")``)
    is wrapped first, as loading would have done.
    """
    prefix = f"{section}." if section else ""
    for f in fields(obj):
        base, _ = _kind(f)
        value = getattr(obj, f.name)
        if base in ("Secret", "SecretURL") and isinstance(value, str):
            object.__setattr__(obj, f.name, _FROM_TEXT[base](value))
    for f in fields(obj):
        found = problem(f, getattr(obj, f.name))
        if found is not None:
            raise ConfigError(f"{prefix}{f.name}: {found}")


def to_plain(obj: Any, redact: bool) -> dict[str, Any]:
    """Nested dict of a config dataclass: paths as str, secrets masked if ``redact``."""
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):
            value = to_plain(value, redact)
        elif isinstance(value, Path):
            value = str(value)
        elif isinstance(value, Secret):
            value = MASK if redact else value.reveal()
        elif isinstance(value, SecretURL):
            value = str(value) if redact else value.reveal()
        out[f.name] = value
    return out


def coerce(f: Field[Any], raw: Any, env: Mapping[str, str] | None) -> Any:
    """Turn a value from YAML, the environment or overrides into the field's type.

    Strings are parsed for every type, wherever they come from: env values are always
    strings, and so are ``--set key=value`` overrides from a command line. An empty
    string is None for optional fields. Strings for ``*_bytes`` fields go through
    :func:`~lmtier.sizes.parse_size` (which raises ConfigError). Any other value that
    does not convert is returned as it is, for :func:`problem` to report.
    """
    base, optional = _kind(f)
    if optional and (raw is None or (isinstance(raw, str) and not raw.strip())):
        return None
    if f.name.endswith("_bytes") and isinstance(raw, str):
        return parse_size(raw)
    value = raw
    if isinstance(raw, str) and raw.strip() and base in _FROM_TEXT:
        with contextlib.suppress(ValueError):
            value = _FROM_TEXT[base](raw.strip())
    normalize: Callable[[str], str] | None = f.metadata.get("normalize")
    if normalize is not None and isinstance(value, str):
        value = normalize(value.strip())
    if isinstance(value, Path):
        value = expand_home(value, env)
    if base == "float" and _IS_TYPE["int"](value):
        value = float(value)
    return value


def _parse_bool(text: str) -> bool:
    try:
        return _BOOL_WORDS[text.lower()]
    except KeyError:
        raise ValueError(text) from None


_FROM_TEXT: dict[str, Callable[[str], Any]] = {
    "bool": _parse_bool,
    "int": int,
    "float": float,
    "Path": Path,
    "Secret": Secret,
    "SecretURL": SecretURL,
}


def home_dir(env: Mapping[str, str] | None) -> Path:
    """``$HOME`` from ``env``; the account's home if ``env`` has none (or is None)."""
    home = env.get("HOME", "") if env is not None else ""
    return Path(home) if home else Path.home()


def expand_home(path: Path, env: Mapping[str, str] | None) -> Path:
    """``path`` with a leading ``~`` replaced by :func:`home_dir` of ``env``."""
    if path.parts and path.parts[0] == "~":
        return home_dir(env).joinpath(*path.parts[1:])
    return path
