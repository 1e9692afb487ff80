"""Keyed integrity for chunks on shared tiers: an HMAC that only key holders can make.

Checksums catch accidents, not attacks: anyone who can write to a shared Redis or
bucket can plant a chunk with valid checksums under a key that tenant's prompts will
ask for, and have it served. With an integrity key configured (``integrity.key`` or
``integrity.key_file``), every chunk this deployment encodes carries an HMAC-SHA256
of its canonical header (``mac`` zeroed; see :func:`lmtier.chunks.format.signed_header`)
and its payload, and every chunk read from a tier that declares ``shared`` must carry
a valid one: a chunk without it, or with a wrong one, is a miss, deleted and counted
in ``corrupt``. The header names the chunk's key, namespace and geometry, so a valid
chunk cannot be replayed under another key either.

What it does not do: hide KV (a reader of the store can still read it: use TLS and
the store's access control), or stop anyone with write access from deleting chunks.
Local tiers (host memory, this user's disk directory) are not checked: only this
process and this user write to them.

Why HMAC-SHA256 over the whole payload: a MAC over only the header (which holds the
payload's xxh3 checksum) would be cheap but worthless, since xxh3 is not collision
resistant and a forger could match a checksum. SHA-256 with the SHA extensions ran
at ~2 GB/s here, faster than keyed BLAKE2b (1.4 GB/s) and BLAKE2s (0.8 GB/s); the
cost per chunk against the plain checksum is in benchmarks/bench_integrity.py.
hashlib releases the GIL while it hashes, so verification runs in worker threads.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import stat
from pathlib import Path

from lmtier.chunks.encoding import signed_header
from lmtier.chunks.format import DecodedChunk
from lmtier.errors import ConfigError
from lmtier.secret import Secret

__all__ = ["MIN_KEY_BYTES", "ChunkMac", "load_key"]

logger = logging.getLogger(__name__)

MIN_KEY_BYTES = 16
"""Shortest integrity key accepted (128 bits)."""


class ChunkMac:
    """Signs and verifies chunk MACs under one secret key (module docstring).

    ``sign`` is a :data:`~lmtier.chunks.format.MacSigner` for the encoders; ``verify``
    checks a decoded chunk in constant time. Both may run in any thread.
    """

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise ConfigError(
                f"the integrity key has {len(key)} bytes; use at least {MIN_KEY_BYTES} "
                "random bytes (e.g. `openssl rand -hex 32 > key`)"
            )
        self._key = key

    def sign(self, header: bytes, payload: memoryview) -> bytes:
        """The MAC of a chunk's canonical header and its payload."""
        mac = hmac.new(self._key, header, hashlib.sha256)
        mac.update(payload)
        return mac.digest()

    def verify(self, chunk: DecodedChunk) -> bool:
        """Whether ``chunk`` carries the MAC this key makes for it."""
        expected = self.sign(signed_header(chunk.meta, chunk.checksum), chunk.payload)
        return hmac.compare_digest(expected, chunk.mac)

    def __repr__(self) -> str:
        return "ChunkMac(key=***)"


def load_key(key: Secret | None, key_file: Path | None) -> ChunkMac | None:
    """The configured integrity key as a :class:`ChunkMac`, or None when there is none.

    A key file is read as bytes, without a trailing newline; one that other users may
    read is used but logged as a warning. ConfigError names the setting on any problem.
    """
    if key is not None and key_file is not None:
        raise ConfigError("integrity.key and integrity.key_file: set one, not both")
    if key is not None:
        return ChunkMac(key.reveal().encode())
    if key_file is None:
        return None
    try:
        data = key_file.read_bytes().rstrip(b"\r\n")
        mode = key_file.stat().st_mode
    except OSError as exc:
        raise ConfigError(
            f"integrity.key_file: cannot read {key_file}: {exc.strerror or exc}"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning(
            "integrity.key_file %s can be read by other users (mode %o); chmod 600 it",
            key_file,
            stat.S_IMODE(mode),
        )
    try:
        return ChunkMac(data)
    except ConfigError as exc:
        raise ConfigError(f"integrity.key_file {key_file}: {exc}") from None
