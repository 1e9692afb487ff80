"""lmtier.extras: which extra a missing module belongs to, and the install command that
works for this installation (a checkout here: lmtier is on no package index)."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path
from typing import Any

import pytest
import tomllib

from lmtier import extras
from lmtier.extras import (
    EXTRA_MODULES,
    MissingExtraError,
    install_command,
    missing_extra,
    require,
)
from support import ROOT


def test_every_extra_named_is_one_of_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert set(EXTRA_MODULES) <= set(project["optional-dependencies"])


def test_from_a_checkout_the_command_installs_the_checkout_editable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    assert install_command("grpc") == f"pip install -e {shlex.quote(f'{ROOT}[grpc]')}"
    monkeypatch.chdir(ROOT)  # the README's own spelling, from the checkout
    assert install_command("redis", "s3") == "pip install -e '.[redis,s3]'"


def test_an_installed_copy_names_its_directory_or_the_index(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(extras, "_CHECKOUT", tmp_path / "site-packages")
    monkeypatch.setattr(extras, "_installed_from", lambda: "/src/lmtier")
    assert install_command("serve") == "pip install '/src/lmtier[serve]'"
    monkeypatch.setattr(extras, "_installed_from", lambda: None)
    assert install_command("serve") == "pip install 'lmtier[serve]'"


@pytest.mark.parametrize(
    ("module", "extra"),
    [
        ("grpc", "grpc"),
        ("grpc_health.v1", "grpc"),
        ("google", "grpc"),
        ("google.protobuf", "grpc"),
        ("uvicorn", "serve"),
        ("fastapi", "serve"),
        ("redis", "redis"),
        ("boto3", "s3"),
        ("transformers", "hf"),
        ("matplotlib", "plot"),
    ],
)
def test_a_missing_module_names_its_extra_in_one_line(module: str, extra: str) -> None:
    error = missing_extra(ModuleNotFoundError(f"No module named {module!r}", name=module))
    assert isinstance(error, MissingExtraError) and isinstance(error, ImportError)
    assert error.extras == (extra,)
    assert str(error) == (
        f"{module} is not installed (the {extra!r} extra): {install_command(extra)}"
    )


@pytest.mark.parametrize("module", ["lmtier.nothing", "numpy", "", "grpcx"])
def test_a_module_of_no_extra_is_left_alone(module: str) -> None:
    assert missing_extra(ModuleNotFoundError(name=module or None)) is None


def test_require_names_every_missing_extra_in_one_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        if name.split(".", maxsplit=1)[0] in ("redis", "uvicorn"):
            return None
        if name == "google.protobuf":  # a missing parent package raises
            raise ModuleNotFoundError(name="google")
        return real(name, package)

    require("hf", what="x")  # installed here
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(MissingExtraError) as caught:
        require("hf", "redis", "serve", "grpc", what="a local cluster")
    assert caught.value.extras == ("redis", "serve", "grpc")
    assert str(caught.value) == (
        "a local cluster needs the 'redis', 'serve', 'grpc' extras: "
        + install_command("redis", "serve", "grpc")
    )
