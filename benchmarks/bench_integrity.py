"""Cost of keyed integrity (HMAC-SHA256 per chunk) against the plain checksum.

For chunks of the demo model's geometry (2 MiB at chunk 256) and a large one (16
MiB), measured in one run:
  (a) the plain chunk checksum (xxh3-64 over the payload), which every read pays,
  (b) sealing a chunk with and without an integrity key (header + checksum [+ MAC]),
  (c) verifying a chunk's MAC, which reads from shared tiers pay when a key is set,
against the baseline of copying the chunk into preallocated memory (memcpy), which
every load pays anyway.

Usage: python benchmarks/bench_integrity.py [--quick]   (last line: one JSON object)
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
import xxhash
from bench_common import median_s

from lmtier.chunks.format import decode
from lmtier.chunks.integrity import ChunkMac
from lmtier.chunks.keys import ChunkKey
from lmtier.kv_spec import KVSpec, payload_tensor, seal_slab
from lmtier.storage.host_pool import HostPool

SIZES = {
    "2MiB": KVSpec(num_layers=8, num_kv_heads=2, head_dim=64),  # 8 KiB/token x 256
    "16MiB": KVSpec(num_layers=16, num_kv_heads=8, head_dim=128, dtype="bfloat16"),
}
CHUNK = 256


def measure(spec: KVSpec, repeats: int) -> dict[str, float]:
    pool = HostPool(spec.encoded_chunk_bytes(CHUNK), 2)
    handle, copy_to = pool.acquire(), pool.acquire()
    assert handle is not None and copy_to is not None
    meta = spec.meta(ChunkKey(bytes(range(32))), CHUNK)
    generator = torch.Generator().manual_seed(0)
    payload_tensor(handle, meta).copy_(torch.rand(meta.shape, generator=generator))
    mac = ChunkMac(b"a benchmark key of 32 bytes!!!!!")
    size = seal_slab(handle, meta, mac.sign)
    view = handle.view[:size]
    chunk = decode(view)
    data = chunk.payload
    source = np.frombuffer(view, dtype=np.uint8)
    target = np.frombuffer(copy_to.view[:size], dtype=np.uint8)
    figures = {
        "memcpy_us": median_s(lambda: np.copyto(target, source), repeats) * 1e6,
        "checksum_us": median_s(lambda: xxhash.xxh3_64_intdigest(data), repeats) * 1e6,
        "seal_us": median_s(lambda: seal_slab(handle, meta), repeats) * 1e6,
        "seal_mac_us": median_s(lambda: seal_slab(handle, meta, mac.sign), repeats) * 1e6,
        "verify_mac_us": median_s(lambda: mac.verify(chunk), repeats) * 1e6,
    }
    assert mac.verify(decode(handle.view[: seal_slab(handle, meta, mac.sign)]))
    handle.release()
    copy_to.release()
    pool.close()
    figures["chunk_bytes"] = size
    figures["mac_vs_checksum"] = figures["verify_mac_us"] / figures["checksum_us"]
    figures["mac_vs_memcpy"] = figures["verify_mac_us"] / figures["memcpy_us"]
    figures["mac_gb_s"] = size / figures["verify_mac_us"] / 1e3
    return {name: round(value, 3) for name, value in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (< 60 s)")
    args = parser.parse_args()
    repeats = 9 if args.quick else 41
    results: dict[str, object] = {"benchmark": "integrity"}
    for name, spec in SIZES.items():
        figures = measure(spec, repeats)
        results[name] = figures
        print(
            f"{name:>6}: checksum {figures['checksum_us']:8.1f} us, memcpy "
            f"{figures['memcpy_us']:8.1f} us, seal {figures['seal_us']:8.1f} us, "
            f"seal+MAC {figures['seal_mac_us']:8.1f} us, verify MAC "
            f"{figures['verify_mac_us']:8.1f} us = {figures['mac_vs_checksum']:.0f}x the "
            f"checksum, {figures['mac_vs_memcpy']:.1f}x a copy ({figures['mac_gb_s']:.2f} GB/s)"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
