"""lmtier's optional dependencies (pyproject's extras), and the one-line error that says
which to install when a command needs one that is missing.

The core installs only its own dependencies; the sidecar (grpc), the demo engine
(serve), the transformers demo (hf), the Redis and S3 tiers and the plots each import
theirs when they run. A missing one would surface as ``No module named 'grpc'`` at
the end of a traceback. :func:`missing_extra` turns such a ModuleNotFoundError into a
:class:`MissingExtraError` that names the extra and the command that installs it
(``lmtier.cli.main`` applies it to every subcommand), and :func:`require` checks for
extras up front, before a command starts anything (``lmtier cluster up``).

The install command is the one that works for this installation: lmtier is not on a
package index, so for a checkout (the README's editable install) it is
``pip install -e '<checkout>[extra]'``, for a copy installed from a directory
``pip install '<directory>[extra]'``, and ``pip install 'lmtier[extra]'`` only for
an installation from an index.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

from lmtier.errors import LMTierError

__all__ = ["EXTRA_MODULES", "MissingExtraError", "install_command", "missing_extra", "require"]

EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "grpc": ("grpc", "grpc_health", "google.protobuf", "prometheus_client"),
    "serve": ("fastapi", "uvicorn", "starlette"),
    "hf": ("transformers", "tokenizers", "rich"),
    "redis": ("redis",),
    "s3": ("boto3", "botocore"),
    "plot": ("matplotlib",),
    "vllm": ("vllm",),
    "cuda": ("cupy",),
    "events": ("zmq",),
    "route": ("aiohttp",),
    "cluster": ("cryptography",),
}
"""Each extra of pyproject.toml and the top-level modules it installs that lmtier
imports (a test checks the extras against pyproject.toml)."""

_CHECKOUT = Path(__file__).resolve().parents[1]
"""Where this package's checkout would be: the directory above ``lmtier/``."""


class MissingExtraError(LMTierError, ImportError):
    """A module of an optional extra is not installed; the message says which extra and
    the command that installs it. ``extras``: the extras missing."""

    def __init__(self, message: str, *, extras: tuple[str, ...]) -> None:
        super().__init__(message)
        self.extras = extras


def install_command(*extras: str) -> str:
    """The shell command that installs ``extras`` into this installation of lmtier
    (see the module docstring)."""
    wanted = ",".join(extras)
    if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "lmtier").is_dir():
        root = "." if Path.cwd() == _CHECKOUT else str(_CHECKOUT)
        return f"pip install -e {shlex.quote(f'{root}[{wanted}]')}"
    directory = _installed_from()
    if directory is not None:
        return f"pip install {shlex.quote(f'{directory}[{wanted}]')}"
    return f"pip install {shlex.quote(f'lmtier[{wanted}]')}"


def _installed_from() -> str | None:
    """The local directory lmtier was installed from (PEP 610's ``direct_url.json``),
    or None for an installation from an index."""
    try:
        text = metadata.distribution("lmtier").read_text("direct_url.json")
        url = json.loads(text or "null")
    except (metadata.PackageNotFoundError, ValueError, OSError):
        return None
    if not isinstance(url, dict) or not isinstance(url.get("url"), str):
        return None
    parsed = urlparse(url["url"])
    return unquote(parsed.path) if parsed.scheme == "file" and "dir_info" in url else None


def _extra_of(module: str) -> str | None:
    for extra, modules in EXTRA_MODULES.items():
        if any(module == name or module.startswith(name + ".") for name in modules):
            return extra
    if module == "google":  # the namespace package protobuf lives in
        return "grpc"
    return None


def missing_extra(exc: ModuleNotFoundError) -> MissingExtraError | None:
    """``exc`` as a MissingExtraError when the module it misses belongs to an extra,
    else None: a module lmtier does not know is a bug of the installation, reported
    as it is."""
    module = exc.name or ""
    extra = _extra_of(module)
    if extra is None:
        return None
    return MissingExtraError(
        f"{module} is not installed (the {extra!r} extra): {install_command(extra)}",
        extras=(extra,),
    )


def require(*extras: str, what: str) -> None:
    """MissingExtraError naming every one of ``extras`` that is not installed (all in
    one install command), before ``what`` starts anything."""
    missing = tuple(extra for extra in extras if not _installed(extra))
    if missing:
        names = ", ".join(repr(extra) for extra in missing)
        plural = "s" if len(missing) > 1 else ""
        raise MissingExtraError(
            f"{what} needs the {names} extra{plural}: {install_command(*missing)}",
            extras=missing,
        )


def _installed(extra: str) -> bool:
    for module in EXTRA_MODULES[extra]:
        try:
            if importlib.util.find_spec(module) is None:
                return False
        except (ImportError, ValueError):  # a parent package missing, or half-installed
            return False
    return True
