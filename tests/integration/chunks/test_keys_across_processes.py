"""Chunk keys are equal in processes with different hash seeds (nothing depends on
Python's ``hash()``): a real process per seed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration


def test_keys_are_equal_across_processes_with_different_hash_seeds() -> None:
    script = textwrap.dedent(
        """
        from lmtier.chunks.keys import Namespace
        from lmtier.chunks.hashers import chunk_keys
        ns = Namespace(model_id="m", cache_salt="s", chunk_size=16)
        tokens = [(i * 7919) % 50000 for i in range(100)]
        print(",".join(k.hex() for k in chunk_keys(tokens, ns)))
        print(",".join(k.hex() for k in chunk_keys(tokens, ns, algorithm="vllm")))
        """
    )
    outputs = set()
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(result.stdout)
    assert len(outputs) == 1
    (output,) = outputs
    assert output.count(",") == 2 * (100 // 16 - 1)
