"""The field types of lmtier's configuration, and its errors in lmtier's words.

Each type is a pydantic ``Annotated`` type that takes what a YAML file, an
environment variable or code may hold and refuses the rest: strings are parsed (env
values are always strings), other values must already be of the type. Strictness
is deliberate: ``1`` is no bool, ``256.0`` no chunk size and ``"on"`` no boolean,
where pydantic's lax mode would accept all three.

:func:`config_error` turns a pydantic ValidationError into one
:class:`~lmtier.errors.ConfigError` line that names the dotted key, says what it
must be, quotes the bad value briefly (never a secret) and says where it came from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, PlainSerializer, Strict
from pydantic import ValidationError as PydanticValidationError

from lmtier.config.secrets import Secret, SecretURL
from lmtier.config.sizes import parse_size
from lmtier.errors import ConfigError, brief

__all__ = [
    "MAX_BYTES",
    "MAX_COUNT",
    "MAX_DURATION_S",
    "MAX_TIMEOUT_S",
    "Bool",
    "Count",
    "Int",
    "NonEmptyText",
    "PathValue",
    "PositiveFloat",
    "SecretText",
    "SecretUrl",
    "Size",
    "Text",
    "Timeout",
    "Wait",
    "config_error",
]

# Upper bounds: a setting past them is a typo (or a unit mistaken), never intended,
# and it would break things far from the config: a timeout of 1e308 s turns a hung
# server into a hung call instead of a miss, a million I/O threads exhaust the process.
MAX_BYTES = 1 << 60
"""Largest size any ``*_bytes`` setting may name (1 EiB): beyond it, a typo."""
MAX_COUNT = 1 << 20
"""Largest count (queue slots, sessions, keys per call) any setting may name."""
MAX_TIMEOUT_S = 3600.0
"""Longest timeout or wait any setting may name: an hour."""
MAX_DURATION_S = 10 * 365 * 86400.0
"""Longest duration (a TTL) any setting may name: ten years."""

_BOOL_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _from_text(parse: Callable[[str], Any]) -> BeforeValidator:
    """Parse strings with ``parse`` (a failure leaves the string, for the type check to
    report); other values pass unchanged."""

    def convert(value: Any) -> Any:
        if isinstance(value, str):
            try:
                return parse(value.strip())
            except ValueError:
                return value
        return value

    return BeforeValidator(convert)


def _bool(value: Any) -> Any:
    if isinstance(value, str):
        parsed = _BOOL_WORDS.get(value.strip().lower())
        if parsed is not None:
            return parsed
    if isinstance(value, bool):
        return value
    raise ValueError(f"must be true or false (or yes/no, 1/0), got {brief(value)}")


def _size(value: Any) -> Any:
    return parse_size(value) if isinstance(value, str) else value


def _bytes_in_range(value: int) -> int:
    if value < 0:
        raise ValueError(f"must be >= 0, got {value}")
    if value > MAX_BYTES:
        raise ValueError(f"must be at most 2**60 bytes (1 EiB): {value} is surely a typo")
    return value


def _non_empty(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty")
    return value


def _not_blank(value: str) -> str:
    """Empty is a value (the default, or none); spaces alone are a typo, and a NUL
    byte fits no name, address or path (the OS would refuse it far from here)."""
    if value and not value.strip():
        raise ValueError(f"must not be blank, got {brief(value)}")
    if "\0" in value:
        raise ValueError(f"must not hold a NUL character, got {brief(value)}")
    return value


def _path(value: Any) -> Any:
    if isinstance(value, (str, Path)) and "\0" in str(value):
        raise ValueError(f"must not hold a NUL character, got {brief(str(value))}")
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("must be a non-empty path")
        return Path(value)
    return value


def _secret(kind: type[Secret] | type[SecretURL]) -> BeforeValidator:
    def wrap(value: Any) -> Any:
        if isinstance(value, str):
            if not value.strip():  # never quoted: a secret's value is not shown
                raise ValueError("must not be blank")
            return kind(value)
        return value

    return BeforeValidator(wrap)


Bool = Annotated[bool, BeforeValidator(_bool)]
Int = Annotated[int, _from_text(int), Strict()]
_Float = Annotated[float, _from_text(float), Strict(), Field(allow_inf_nan=False)]
PositiveFloat = Annotated[_Float, Field(gt=0.0, le=MAX_DURATION_S)]
"""Seconds (a TTL, an interval): finite, > 0 and at most ``MAX_DURATION_S``."""
Timeout = Annotated[_Float, Field(gt=0.0, le=MAX_TIMEOUT_S)]
"""Seconds a call or a wait may take: > 0 and at most ``MAX_TIMEOUT_S``."""
Wait = Annotated[_Float, Field(ge=0.0, le=MAX_TIMEOUT_S)]
"""Seconds to wait for something before giving up: 0 (not at all) to ``MAX_TIMEOUT_S``."""
PinFraction = Annotated[_Float, Field(ge=0.0, le=0.9)]
"""A part of a tier's capacity that pinned chunks may take: at most 0.9, so that
pins never starve the cache of room for new chunks."""
Share = Annotated[_Float, Field(gt=0.0, le=1.0)]
"""A part of a resource one caller may hold (more than 0, at most 1: all of it)."""
Text = Annotated[str, Strict(), AfterValidator(_not_blank)]
"""A string; empty, or holding more than spaces, and no NUL."""
NonEmptyText = Annotated[Text, AfterValidator(_non_empty)]
Size = Annotated[int, BeforeValidator(_size), Strict(), AfterValidator(_bytes_in_range)]
"""Bytes: an int, or a string like ``"8GiB"`` (see :mod:`lmtier.config.sizes`)."""
PathValue = Annotated[Path, BeforeValidator(_path)]
SecretText = Annotated[
    Secret, _secret(Secret), PlainSerializer(lambda s: s.reveal(), return_type=str)
]
SecretUrl = Annotated[
    SecretURL, _secret(SecretURL), PlainSerializer(lambda s: s.reveal(), return_type=str)
]


Count = Annotated[int, _from_text(int), Strict(), Field(ge=1, le=MAX_COUNT)]
"""An ``Int`` from 1 to ``MAX_COUNT`` (queue slots, sessions); fields of threads and
connections bound it lower where they are declared."""


# --- errors --------------------------------------------------------------------------

_EXPECTED = {
    "bool_type": "must be true or false (or yes/no, 1/0)",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a finite number",
    "float_parsing": "must be a finite number",
    "finite_number": "must be a finite number",
    "string_type": "must be a string (quote it in YAML)",
    "path_type": "must be a non-empty path",
    "model_type": "must be a mapping of settings",
    "dict_type": "must be a mapping of settings",
    "model_attributes_type": "must be a mapping of settings",
}


def _number(value: object) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))  # 315360000, not 3.1536e+08
    return f"{value:g}" if isinstance(value, float) else str(value)


def describe(error: Mapping[str, Any], secret: bool = False) -> str:
    """What is wrong, in lmtier's words, for one pydantic error (``secret``: never
    quote the value, only its type)."""
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    shown = type(value).__name__ if secret else brief(value)
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    bound = {
        "greater_than_equal": ("ge", ">="),
        "greater_than": ("gt", ">"),
        "less_than_equal": ("le", "<="),
        "less_than": ("lt", "<"),
    }.get(kind)
    if bound is not None:
        limit = ctx[bound[0]]
        if isinstance(value, str):  # an env string: show it as it was read
            shown = str(type(limit)(value.strip()))
        return f"must be {bound[1]} {_number(limit)}, got {shown}"
    if kind == "is_instance_of":
        noun = "URL string" if "URL" in str(ctx.get("class")) else "string"
        return f"must be a {noun}, got {shown}"
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        shown = type(value).__name__
    expected = _EXPECTED.get(kind, str(error["msg"]).lower())
    return expected if kind == "path_type" else f"{expected}, got {shown}"


def config_error(
    exc: PydanticValidationError,
    *,
    model: type[BaseModel],
    prefix: tuple[str, ...] = (),
    where: Mapping[str, str] | None = None,
) -> ConfigError:
    """One ConfigError for the first error of ``exc``: ``"<dotted key>: <problem><where>"``.

    ``model`` is what was validated (its fields say which hold secrets: their values
    are never quoted), ``prefix`` its location (a section's name), ``where`` says
    where a dotted key's value came from (``" (in /etc/x.yaml)"``). A check across
    fields names its keys itself.
    """
    error = exc.errors(include_url=False)[0]
    loc = tuple(str(part) for part in error["loc"])
    key = ".".join(prefix + loc)
    inner = (error.get("ctx") or {}).get("error")
    if isinstance(inner, ConfigError) and inner.key:  # raised by a section, nested here
        return ConfigError(f"{inner}{(where or {}).get(inner.key, '')}", key=inner.key)
    note = (where or {}).get(key, "")
    if error["type"] == "extra_forbidden":
        return ConfigError(f"unknown config key {brief(key)}{note}", key=key)
    problem = describe(error, _is_secret(model, loc))
    if error["type"] == "value_error" and "." in problem.partition(":")[0]:
        return ConfigError(problem, key=key)  # a check across fields
    return ConfigError(f"{key}: {problem}{note}" if key else f"{problem}{note}", key=key)


def _is_secret(model: type[BaseModel], loc: tuple[str, ...]) -> bool:
    """Whether the field at ``loc`` in ``model`` holds a Secret or SecretURL."""
    field = None
    for part in loc:
        field = model.model_fields.get(part)
        if field is None:
            return False
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
    return field is not None and "Secret" in str(field.annotation)
