"""The cache identity of a local model directory: the model id and revision that name
its KV.

Every command that takes ``--model DIR`` (``lmtier demo``, ``demo serve``, ``warm``,
``lookup``, ``purge``) must compute the same namespace for the same directory, or
what one warms another never finds. So the identity is computed here, once, from files
alone (no torch, no transformers):

* the model id is the directory's resolved path: absolute, ``..`` and symlinks
  resolved (:meth:`pathlib.Path.resolve`). So ``./m``, ``m/``, ``$PWD/m`` and a
  symlink to ``m`` all name one namespace: what ``warm --model ./m`` stores, ``lookup
  --model $PWD/m`` finds. Symlinks are resolved because the id should name the files,
  not one spelling of their place: a link ``~/models/llama -> /data/llama`` is the
  same model, and a link moved to other weights changes the revision anyway (below).
  The same directory mounted at two different paths (two containers) still gives two
  ids: give the engines an explicit ``model_id`` to share KV across them;
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

__all__ = ["WEIGHT_SUFFIXES", "local_model_id", "model_identity"]

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
    return str(path.resolve()), digest.hexdigest()


def local_model_id(name: str) -> str:
    """The model id of an engine's model name (vLLM's ``--model``): a local directory's
    resolved path, as :func:`model_identity` names it, else ``name`` unchanged (a hub
    id such as ``meta-llama/Llama-3.1-8B``)."""
    path = Path(name).expanduser()
    return str(path.resolve()) if path.is_dir() else name
