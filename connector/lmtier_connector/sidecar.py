"""What an engine integration needs to be a sidecar's client besides
:meth:`lmtier.api.LMTier.connect`: the bearer token read from a file, as the vLLM
connector's ``sidecar_token_file`` and ``lmtier demo --sidecar-token-file`` take it.
"""

from __future__ import annotations

import os
from pathlib import Path

from lmtier.config import Secret
from lmtier.errors import ConfigError

__all__ = ["read_token_file"]


def read_token_file(path: str | os.PathLike[str], what: str = "sidecar_token_file") -> Secret:
    """The first line of the file at ``path``, stripped; a ConfigError naming ``what``
    when it cannot be read or that line is empty. The token itself is never shown."""
    file = Path(path).expanduser()
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ConfigError(f"{what}: cannot read {file}: {reason}") from None
    token = lines[0].strip() if lines else ""
    if not token:
        raise ConfigError(f"{what}: the first line of {file} is empty; put the token there")
    return Secret(token)
