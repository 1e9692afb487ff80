"""What the disk tier's tests share: running a coroutine, and the files in a tier's
directory (chunk files, temp files of writes)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from lmtier.testing import make_chunk

__all__ = ["CHUNK_LEN", "GIB", "chunk_files", "run", "temp_files"]

T = TypeVar("T")
GIB = 1 << 30
CHUNK_LEN = len(make_chunk()[1])  # 16 tokens x 64 hidden: 192-byte header + 8192 payload


def run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``asyncio.run`` of ``fn(*args)``."""

    async def main() -> T:
        return await fn(*args)

    return asyncio.run(main())


def chunk_files(path: Path) -> list[Path]:
    """The chunk files under a disk tier's ``path``."""
    return sorted((path / "v1").glob("??/*.lmtc"))


def temp_files(path: Path) -> list[Path]:
    """Temp files of writes: beside chunk files, or in ``tmp/`` (older versions)."""
    return sorted([*(path / "v1").glob("??/.*.tmp"), *(path / "v1" / "tmp").iterdir()])
