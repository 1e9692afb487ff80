"""What the operations commands' tests share: a config file in a temporary directory,
chunks stored there by a real cache, and the ``lmtier`` command run as a user runs it
(a process) or in this process (faster, for the cases that need no process)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lmtier import KVSpec, LMTier, load_config
from lmtier.chunks.keys import ChunkKey
from lmtier.cli import main

CHUNK = 16
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8)
GEOMETRY = ["--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8"]
MODEL_ID = "ops-test-model"


def write_config(directory: Path, **sections: Any) -> Path:
    """A config file: a small CPU tier and a disk tier under ``directory``."""
    settings: dict[str, Any] = {
        "model_id": MODEL_ID,
        "chunk_size": CHUNK,
        "cpu": {"capacity_bytes": "1MiB", "staging_bytes": "1MiB"},
        "disk": {"path": str(directory / "chunks"), "capacity_bytes": "64MiB"},
        **sections,
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "lmtier.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def kv_of(tokens: list[int], seed: int = 0) -> torch.Tensor:
    return torch.randn(SPEC.shape(len(tokens)), generator=torch.Generator().manual_seed(seed))


def store(config_path: Path, tokens: list[int], **model: Any) -> list[ChunkKey]:
    """Store ``tokens``' KV with a real embedded cache (its writes flushed); their keys."""
    with LMTier.open(load_config(config_path), kv=SPEC, **model) as cache:
        cache.store(tokens, kv_of(tokens))
        cache.flush()
        return cache.keys(tokens)


def chunk_file(config_path: Path, key: bytes) -> Path:
    """Where the disk tier of ``config_path`` keeps chunk ``key``."""
    root = Path(load_config(config_path).disk.path) / "v1"
    name = key.hex()
    return root / name[32:34] / f"{name}.lmtc"


def clean_env() -> dict[str, str]:
    """This process's environment without LMTIER_* settings (the config file rules)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("LMTIER_")}


def run_process(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """``python -m lmtier.cli ARGS`` in a new process."""
    return subprocess.run(
        [sys.executable, "-m", "lmtier.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=clean_env(),
    )


def run_here(monkeypatch: pytest.MonkeyPatch, *args: str, stdin: str = "") -> tuple[int, str, str]:
    """``lmtier ARGS`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    for name in [k for k in os.environ if k.startswith("LMTIER_")]:
        monkeypatch.delenv(name)
    code = main(list(args))
    return code, out.getvalue(), err.getvalue()


INTEGRITY_KEY = "k" * 32


def store_signed(directory: Path) -> tuple[Path, list[ChunkKey]]:
    """A config in ``directory`` with an integrity key, and the keys of three chunks
    stored through it (on its disk tier): what ``lmtier inspect``'s tests read."""
    config_path = write_config(directory, integrity={"key": INTEGRITY_KEY})
    return config_path, store(config_path, list(range(3 * CHUNK)))
