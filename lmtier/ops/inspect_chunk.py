"""``lmtier inspect KEY|FILE``: one chunk's header, and whether its bytes check out.

``FILE`` is a chunk file (``<disk.path>/v1/<xx>/<key>.lmtc``) or any file holding a
chunk's bytes. ``KEY`` is a chunk key, 64 hex digits (the namespace digest, then the
chain: what ``lmtier keys`` prints and disk files are named), read from the config's
lower tiers (disk, Redis, S3, extra tiers), the first that holds it in waterfall
order, or the one ``--tier`` names. Host memory belongs to each process, so it is
not searched.

Inspecting changes nothing. A tier's normal read (``Tier.read_chunks``) deletes a
chunk that fails its checks (a corrupt chunk must not be found again), which would
destroy what the operator came to look at; so the bytes come from the backend's own
raw read (``Tier._read_into``), and they are checked here with the chunk format's
functions (:func:`~lmtier.chunks.format.decode`,
:func:`~lmtier.chunks.format.verify_payload`), never with a second parser.

What it prints: the header (key, namespace digest, dtype, shape, layout, tokens,
payload bytes, creation time, flags) and the checks:

* ``header checksum``: always ``ok`` in a report, since a header that fails it has
  no field worth showing: that is the error ``corrupt header: ...``;
* ``payload checksum``: ``ok``, ``bad``, or ``unsealed`` (framed in some process's
  host memory and never checksummed: such bytes must never reach a file or a tier);
* ``mac``: ``absent``, ``present`` (no integrity key configured to check it),
  ``valid`` or ``invalid``;
* ``key matches``: whether the header's key is the file's name (the disk tier's
  naming; ``-`` for a file named otherwise) or the KEY asked for.

Exit status: 0 when every check passes; 2 with one line on stderr naming the problem
when the bytes are not a readable chunk (nothing else is printed), or when a check
fails (after the report); 1 when no tier holds KEY.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import mmap
import re
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lmtier.chunks.format import (
    MAC_LEN,
    PREFIX_LEN,
    DecodedChunk,
    decode,
    verify_payload,
)
from lmtier.chunks.integrity import ChunkMac, load_key
from lmtier.chunks.keys import ChunkKey
from lmtier.config import LMTierConfig
from lmtier.errors import (
    BackendError,
    BackendUnavailable,
    BadMagic,
    ChecksumMismatch,
    ConfigError,
    CorruptChunk,
    InvalidRequestError,
    TruncatedChunk,
    UnsupportedVersion,
)

__all__ = ["READ_BUFFER_BYTES", "cmd_inspect", "inspect_bytes"]

logger = logging.getLogger(__name__)

READ_BUFFER_BYTES = 256 * 1024**2
"""The largest chunk read from a tier (an anonymous mapping: pages cost nothing until
a read fills them). 256 tokens of an 80-layer model with 8 KV heads of 128 in bf16
take 80 MiB."""
EXIT_NOT_FOUND = 1
EXIT_BAD = 2
_KEY = re.compile(r"[0-9a-fA-F]{64}")
_CHUNK_FILE = re.compile(r"([0-9a-f]{64})\.lmtc")
_KINDS: tuple[tuple[type[CorruptChunk], str], ...] = (
    (BadMagic, "not a chunk"),
    (TruncatedChunk, "truncated"),
    (UnsupportedVersion, "unsupported chunk format"),
    (ChecksumMismatch, "corrupt header"),
)


def _unreadable(where: str, exc: CorruptChunk) -> CorruptChunk:
    """The one-line error for bytes that do not decode, naming what is wrong."""
    kind = next((name for cls, name in _KINDS if isinstance(exc, cls)), "corrupt header")
    return type(exc)(f"{where}: {kind}: {exc}")


def inspect_bytes(
    data: bytes, where: str, *, expected_key: str | None, config: LMTierConfig, shared: bool
) -> dict[str, Any]:
    """The report of chunk bytes ``data`` (read from ``where``): header fields, checks,
    and ``problems`` (one line each; empty when every check passes). CorruptChunk,
    naming ``where``, when they do not decode at all.

    ``expected_key``: the key the bytes should hold (the file's name, the KEY asked
    for; None: unknown). ``shared``: read from a tier others can write, where a
    chunk without a MAC is refused when an integrity key is configured.
    """
    try:
        chunk = decode(data, verify=False)  # the header checksum is always verified
    except CorruptChunk as exc:
        raise _unreadable(where, exc) from None
    meta = chunk.meta
    key = (meta.namespace + meta.key).hex()
    problems: list[str] = []
    payload = _payload_state(chunk)
    if payload == "bad":
        problems.append("payload checksum mismatch: the KV bytes changed after sealing")
    elif payload == "unsealed":
        problems.append("unsealed: never checksummed, so no tier may serve it")
    signer = load_key(config.integrity.key, config.integrity.key_file)
    mac = _mac_state(chunk, signer)
    if mac == "invalid":
        problems.append("MAC invalid: not signed with the configured integrity key")
    elif mac == "absent" and shared and signer is not None:
        problems.append("no MAC: a shared tier's chunk without one is refused")
    matches = None if expected_key is None else expected_key.lower() == key
    if matches is False:
        problems.append(f"holds key {key}, not {expected_key}: misplaced")
    end = chunk.payload_offset + meta.nbytes
    return {
        "where": where,
        "size": len(data),
        "key": key,
        "namespace": meta.namespace.hex(),
        "dtype": meta.dtype,
        "shape": list(meta.shape),
        "layout": meta.layout,
        "tokens": meta.num_tokens,
        "nbytes": meta.nbytes,
        "payload_offset": chunk.payload_offset,
        "trailing_bytes": len(data) - end,
        "ctime": datetime.fromtimestamp(meta.created, tz=timezone.utc).isoformat(),
        "flags": [] if chunk.sealed else ["unsealed"],
        "header_checksum": "ok",
        "payload_checksum": payload,
        "mac": mac,
        "key_matches": matches,
        "problems": problems,
    }


def _payload_state(chunk: DecodedChunk) -> str:
    if not chunk.sealed:
        return "unsealed"
    try:
        verify_payload(chunk.payload, chunk.checksum)
    except ChecksumMismatch:
        return "bad"
    return "ok"


def _mac_state(chunk: DecodedChunk, signer: ChunkMac | None) -> str:
    if chunk.mac == bytes(MAC_LEN):
        return "absent"
    if signer is None or not chunk.sealed:
        return "present"
    return "valid" if signer.verify(chunk) else "invalid"


def _read_file(path: Path) -> bytes:
    """The bytes of ``path``; only its prefix when that already says it is no chunk
    (a large foreign file is not read whole to be rejected)."""
    try:
        with path.open("rb") as stream:
            data = stream.read(PREFIX_LEN)
            try:
                decode(data, verify=False)
            except TruncatedChunk:
                data += stream.read()  # a chunk's prefix (or a short file): read it all
            except CorruptChunk:
                pass  # decoded again by the caller, which reports it
            return data
    except OSError as exc:
        raise InvalidRequestError(f"cannot read {path}: {exc.strerror or exc}") from None


async def _read_from_tiers(
    config: LMTierConfig, key: ChunkKey, only: str | None
) -> tuple[str, str, bool, bytes] | None:
    """(tier name, where, shared, bytes) from the first tier holding ``key``, or None.
    Raw reads: nothing is deleted or counted as corrupt (module docstring)."""
    from lmtier.storage.plugins import open_tiers  # noqa: PLC0415 - the tiers' packages
    from lmtier.storage.tier import UNSERVABLE  # noqa: PLC0415

    tiers = await open_tiers(config)
    try:
        chosen = [t for t in tiers if only is None or t.name == only]
        if only is not None and not chosen:
            names = ", ".join(t.name for t in tiers) or "none"
            raise ConfigError(f"--tier {only}: no such tier in the config (configured: {names})")
        buffer = mmap.mmap(-1, READ_BUFFER_BYTES)
        silent: list[str] = []
        for tier in chosen:
            try:
                sizes = await tier._read_into([key], [memoryview(buffer)])
            except BackendError as exc:
                logger.debug("%s: not read: %s", tier.name, exc)
                silent.append(f"{tier.name} ({exc})")
                continue
            size = sizes[0]
            if size is None:
                continue
            path_of = getattr(tier, "path_of", None)  # a tier of files says which
            where = f"{tier.name} {path_of(key)}" if callable(path_of) else tier.name
            if size == UNSERVABLE:
                raise CorruptChunk(
                    f"{where}: holds chunk {key.hex()} but cannot return it (not a "
                    f"regular file or object, or larger than {READ_BUFFER_BYTES} bytes)"
                )
            return tier.name, where, tier.properties.shared, buffer[:size]
        if silent:
            raise BackendUnavailable(
                f"chunk {key.hex()} was not found, and these tiers did not answer: "
                + ", ".join(silent)
            )
        return None
    finally:
        for tier in tiers:
            await tier.close()


def _print_report(report: dict[str, Any]) -> None:
    shape = "x".join(map(str, report["shape"]))
    matches = {True: "yes", False: "NO", None: "-"}[report["key_matches"]]
    lines = [
        ("chunk", report["where"]),
        ("key", report["key"]),
        ("namespace", report["namespace"]),
        ("dtype", report["dtype"]),
        ("shape", f"{shape} ({report['layout']})"),
        ("tokens", str(report["tokens"])),
        ("payload", f"{report['nbytes']} bytes at offset {report['payload_offset']}"),
        ("size", f"{report['size']} bytes ({report['trailing_bytes']} after the payload)"),
        ("created", report["ctime"]),
        ("flags", ", ".join(report["flags"]) or "-"),
        ("header checksum", report["header_checksum"]),
        ("payload checksum", report["payload_checksum"]),
        ("mac", report["mac"]),
        ("key matches", matches),
    ]
    width = max(len(label) for label, _ in lines)
    for label, value in lines:
        print(f"{label:<{width}}  {value}")


def cmd_inspect(args: argparse.Namespace, config: LMTierConfig) -> int:
    """``lmtier inspect`` (module docstring)."""
    target: str = args.target
    path = Path(target).expanduser()
    shared = False
    if path.exists():
        if args.tier:
            raise InvalidRequestError("--tier says where to read a KEY; a FILE is read as is")
        data = _read_file(path)
        where = str(path)
        named = _CHUNK_FILE.fullmatch(path.name)
        expected = named.group(1) if named else None
    else:
        hex_key = target.removesuffix(".lmtc")
        if not _KEY.fullmatch(hex_key):
            raise InvalidRequestError(
                f"{target!r} is neither a file nor a chunk key (64 hex digits)"
            )
        key = ChunkKey(bytes.fromhex(hex_key))
        found = asyncio.run(_read_from_tiers(config, key, args.tier))
        if found is None:
            where = f"tier {args.tier}" if args.tier else "any configured tier"
            print(f"lmtier inspect: chunk {hex_key.lower()} is not in {where}", file=sys.stderr)
            return EXIT_NOT_FOUND
        _, where, shared, data = found
        expected = hex_key
    report = inspect_bytes(data, where, expected_key=expected, config=config, shared=shared)
    if args.json:
        print(json.dumps(report))
    else:
        _print_report(report)
    if report["problems"]:
        print(f"lmtier inspect: error: {'; '.join(report['problems'])}", file=sys.stderr)
        return EXIT_BAD
    return 0
