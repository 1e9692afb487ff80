"""The cache identity of a local model directory: the model id and revision that name
its KV.

Every command that takes ``--model DIR`` (``lmtier demo``, ``demo serve``, ``warm``,
``lookup``, ``purge``) must compute the same namespace for the same directory, or
what one warms another never finds. So the identity is computed here, once, from files
alone (no torch, no transformers):

* the model id is the directory as given, normalised (``./models/x/`` and
  ``models/x`` agree), which is also what transformers records as ``_name_or_path``
  and vLLM uses as the model's name when loaded from a path;
* the revision fingerprints the weights: ``config.json``'s bytes and each weight
  file's name, size and modification time. New weights under the same name (a
  fine-tune written in place) change it, so stale KV is never served for them.
  Copies of one model on two machines differ in mtime, hence in revision: to share KV
  across machines, give the engines an explicit revision (``model_revision``, e.g.
  the commit of the weights) instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import xxhash

from lmtier.errors import ConfigError

__all__ = ["WEIGHT_SUFFIXES", "model_identity"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def model_identity(directory: str | os.PathLike[str]) -> tuple[str, str]:
    """``(model_id, revision)`` of the model in ``directory`` (module docstring).
    ConfigError when it is not a model directory (no ``config.json``)."""
    path = Path(directory).expanduser()
    config = path / "config.json"
    try:
        data = config.read_bytes()
        files = sorted(path.iterdir())
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(f"{path}: not a model directory ({config}: {reason})") from None
    digest = xxhash.xxh3_64()
    digest.update(data)
    for file in files:
        if file.suffix in WEIGHT_SUFFIXES and file.is_file():
            stat = file.stat()
            digest.update(json.dumps([file.name, stat.st_size, stat.st_mtime_ns]).encode())
    return str(Path(os.path.normpath(path))), digest.hexdigest()
