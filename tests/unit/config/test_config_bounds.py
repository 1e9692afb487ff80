"""Every field of every config section refuses nonsense: each value below, set alone
in a config as a file would set it, must be one ConfigError line naming its key.

The fields are found by walking the sections, not listed, so a field added later is
checked too: absurdly large and negative numbers, NaN and infinities, blank and NUL
strings, blank secrets."""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import pytest
from pydantic import BaseModel

from lmtier.config import LMTierConfig, config_from_dict
from lmtier.config.secrets import Secret, SecretURL
from lmtier.errors import ConfigError

ENV = {"HOME": "/nonexistent"}
NONSENSE: dict[type, list[Any]] = {
    float: [1e308, "1e308", float("inf"), "-inf", float("nan"), -1.0, "-1"],
    int: [2**62, "99999999999999999999", -1],
    str: [" ", "\t", "a\0b"],
    Path: [" ", "a\0b"],
    Secret: [" ", "\n"],
    SecretURL: [" "],
    bool: ["maybe", 2],
}


def _base(annotation: Any) -> Any:
    """The type under Annotated[...] and Optional[...]."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (Union, types.UnionType):
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        else:
            return annotation


def _leaves(model: type[BaseModel], path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for name, field in model.model_fields.items():
        kind = _base(field.annotation)
        if typing.get_origin(kind) is tuple:  # extra_tiers: a list of sections
            kind = _base(typing.get_args(kind)[0])
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            yield from _leaves(kind, (*path, name))
        else:
            yield (*path, name)


def _kind(path: tuple[str, ...]) -> Any:
    model: Any = LMTierConfig
    kind: Any = None
    for name in path:
        kind = _base(model.model_fields[name].annotation)
        if typing.get_origin(kind) is tuple:  # a list of sections, or of strings
            kind = _base(typing.get_args(kind)[0])
        model = kind
    if typing.get_origin(kind) is Literal:
        return str
    return typing.get_origin(kind) or kind


def _config(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    data: Any = value
    for name in reversed(path):
        data = {name: [data] if name == "extra_tiers" else data}
    return data  # type: ignore[no-any-return]


CASES = [
    (".".join(path), path, value)
    for path in _leaves(LMTierConfig)
    if _kind(path) in NONSENSE
    for value in NONSENSE[_kind(path)]
]


def test_the_walk_finds_every_kind_of_field() -> None:
    walked = {_kind(path) for path in _leaves(LMTierConfig)}
    assert set(NONSENSE) <= walked
    assert walked - set(NONSENSE) <= {dict}  # extra_tiers.options: the backend's to check
    assert len({key for key, _, _ in CASES}) > 60


@pytest.mark.parametrize(("key", "path", "value"), CASES, ids=[f"{k}={v!r}" for k, _, v in CASES])
def test_nonsense_is_one_config_error_naming_the_key(
    key: str, path: tuple[str, ...], value: Any
) -> None:
    data = _config(path, value)
    if path[0] == "extra_tiers" and path[-1] != "backend":
        data["extra_tiers"][0]["backend"] = "plugin"
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, env=ENV)
    message = str(info.value)
    assert "\n" not in message
    section, field = path[0], path[-1]
    # A field's own check names its dotted key; a check across a section's fields
    # names the section and the field.
    assert message.startswith(f"{key}:") or (section in message and field in message), message
    if isinstance(value, str) and path[-1] in ("access_key_id", "secret_access_key", "key"):
        assert value.strip() == "" and repr(value) not in message  # a secret is never quoted


@pytest.mark.parametrize("name", ["lmtier", "kv-cache", "my.bucket.1", "abc", "a" * 63])
def test_bucket_names_aws_allows_are_accepted(name: str) -> None:
    assert config_from_dict({"s3": {"bucket": name}}, env=ENV).s3.bucket == name


@pytest.mark.parametrize(
    "name",
    [
        *("kv", "a" * 64, "Upper", "under_score", "-lead", "trail-", "a..b", "192.168.0.1"),
        *("xn--abc", "sthree-abc", "abc-s3alias", "abc--ol-s3", "abc.mrap", "has space"),
    ],
)
def test_bucket_names_aws_refuses_are_a_config_error(name: str) -> None:
    with pytest.raises(ConfigError, match=r"^s3\.bucket: must be an S3 bucket name"):
        config_from_dict({"s3": {"bucket": name}}, env=ENV)


@pytest.mark.parametrize("region", ["us-east-1", "eu-west-3", "garage", "RegionOne"])
def test_region_names_are_accepted(region: str) -> None:
    assert config_from_dict({"s3": {"region": region}}, env=ENV).s3.region == region


def test_a_prefix_longer_than_an_s3_key_allows_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^s3\.prefix: must be at most 512 bytes, got 513"):
        config_from_dict({"s3": {"prefix": "p" * 513}}, env=ENV)
