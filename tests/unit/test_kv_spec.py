"""KVSpec of the paged chunk layouts (LBHSC, LBSHC): validation, shapes, token counts,
narrowing by whole blocks, check_kv, sizes, and a store/load through the facade; and
the token-major layouts (KTLHD, TLD): their shapes, layer-major views and per-layer
pairs."""

from __future__ import annotations

import pytest
import torch

from lmtier import KVSpec, LMTier, LMTierConfig
from lmtier.chunks.keys import ChunkKey
from lmtier.config import CPUTierConfig, DiskTierConfig
from lmtier.errors import InvalidKVError
from lmtier.kv_spec import check_kv, layer_major, narrow_kv

L, H, D, S = 3, 2, 4, 8
HND = KVSpec(L, H, D, "float16", "LBHSC", block_size=S)
NHD = KVSpec(L, H, D, "float16", "LBSHC", block_size=S)


def test_paged_specs_need_a_block_size_and_other_layouts_refuse_one() -> None:
    assert HND.paged and NHD.paged and not KVSpec(L, H, D).paged
    with pytest.raises(ValueError, match="block_size"):
        KVSpec(L, H, D, layout="LBHSC")
    with pytest.raises(ValueError, match="block_size=0"):
        KVSpec(L, H, D, layout="LKTHD", block_size=16)
    with pytest.raises(ValueError, match="block_size=0"):
        KVSpec(L, 1, D, layout="LTD", block_size=16)
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="block_size"):
            KVSpec(L, H, D, layout="LBHSC", block_size=bad)  # type: ignore[arg-type]


def test_shapes_are_whole_blocks_in_page_order() -> None:
    assert HND.shape(32) == (L, 4, H, S, 2 * D)
    assert NHD.shape(32) == (L, 4, S, H, 2 * D)
    assert HND.shape(0) == (L, 0, H, S, 2 * D)
    with pytest.raises(ValueError, match="whole number of blocks of 8"):
        HND.shape(12)
    assert HND.token_axis == NHD.token_axis == 1  # the block axis: chunks concatenate on it
    assert HND.tokens_of(HND.shape(24)) == 24
    assert HND.tokens_of(NHD.shape(24)) is None  # heads and slots swapped
    assert HND.tokens_of((L, 3, H, S)) is None
    assert KVSpec(L, H, D).tokens_of((L, 2, 5, H, D)) == 5


def test_sizes_meta_and_geometry() -> None:
    assert HND.bytes_per_token == 2 * L * H * D * 2 == KVSpec(L, H, D, "float16").bytes_per_token
    meta = HND.meta(ChunkKey(bytes(range(32))), 16)
    assert (meta.shape, meta.layout, meta.num_tokens) == ((L, 2, H, S, 2 * D), "LBHSC", 16)
    assert meta.nbytes == 16 * HND.bytes_per_token
    assert HND.encoded_chunk_bytes(16) == KVSpec(L, H, D, "float16").encoded_chunk_bytes(16)
    assert NHD.geometry(32).shape == (L, 4, S, H, 2 * D)
    with pytest.raises(ValueError, match="blocks of 8"):
        HND.encoded_chunk_bytes(20)


def test_narrow_tokens_is_a_view_of_whole_blocks() -> None:
    kv = torch.arange(torch.Size(NHD.shape(32)).numel(), dtype=torch.float16).view(NHD.shape(32))
    part = NHD.narrow_tokens(kv, 8, 16)
    assert part.shape == NHD.shape(16) and part.data_ptr() == kv[:, 1].data_ptr()
    assert torch.equal(narrow_kv(kv, NHD, 8, 16), part)  # type: ignore[arg-type]
    for start, length in ((4, 8), (8, 12)):
        with pytest.raises(ValueError, match="whole"):
            NHD.narrow_tokens(kv, start, length)
    tokens = torch.zeros(KVSpec(L, H, D).shape(10))
    assert KVSpec(L, H, D).narrow_tokens(tokens, 3, 5).shape == (L, 2, 5, H, D)


def test_check_kv_takes_one_paged_tensor_and_refuses_per_layer_pairs() -> None:
    assert check_kv(torch.zeros(HND.shape(24), dtype=torch.float16), HND) == 24
    assert check_kv(torch.zeros(HND.shape(0), dtype=torch.float16), HND) == 0
    with pytest.raises(InvalidKVError, match="blocks of 8 tokens on axis 1"):
        check_kv(torch.zeros(NHD.shape(24), dtype=torch.float16), HND)
    with pytest.raises(InvalidKVError, match="dtype"):
        check_kv(torch.zeros(HND.shape(8)), HND)
    pairs = [(torch.zeros(8, H, D, dtype=torch.float16),) * 2 for _ in range(L)]
    with pytest.raises(InvalidKVError, match="per-layer"):
        check_kv(pairs, HND)


@pytest.mark.parametrize("spec", [HND, NHD], ids=["LBHSC", "LBSHC"])
def test_store_and_load_through_the_facade(spec: KVSpec) -> None:
    config = LMTierConfig(
        chunk_size=16,
        cpu=CPUTierConfig(capacity_bytes=1 << 20, staging_bytes=1 << 20),
        disk=DiskTierConfig(enabled=False),
    )
    kv = torch.randn(spec.shape(40), generator=torch.Generator().manual_seed(1)).half()
    prompt = list(range(45))
    with LMTier.open(config, kv=spec, model_id="m") as cache:
        digest = cache.namespace().digest
        assert cache.namespace().kv_block_size == S
        assert cache.store(prompt, kv) == 2
        with cache.load(prompt) as loaded:
            assert loaded.num_tokens == 32
            got = loaded.kv()
            assert got is not None and torch.equal(got, spec.narrow_tokens(kv, 0, 32))
    other = KVSpec(L, H, D, "float16", spec.layout, block_size=4)
    with LMTier.open(config, kv=other, model_id="m") as cache:
        assert cache.namespace().kv_block_size == 4
        assert cache.namespace().digest != digest  # another block size keys apart


LATENT = 6


@pytest.mark.parametrize("layout", ["LKTHD", "KLTHD", "KTLHD", "LTD", "TLD"])
def test_token_layouts_view_layer_major_and_store_what_they_view(layout: str) -> None:
    """Each token layout's chunk, viewed (L, K, T, H, D), holds the same elements as the
    LKTHD chunk of the same KV; a store in that layout loads back the same tensor."""
    latent = layout in ("LTD", "TLD")
    spec = KVSpec(L, 1 if latent else H, LATENT if latent else D, "float32", layout)
    assert spec.latent == latent
    reference = torch.randn(L, 1 if latent else 2, 20, spec.num_kv_heads, spec.head_dim)
    axes = [("LTD" if latent else "LKTHD").index(axis) for axis in layout]
    kv = (reference[:, 0, :, 0] if latent else reference).permute(axes).contiguous()
    assert tuple(kv.shape) == spec.shape(20) and spec.tokens_of(kv.shape) == 20
    assert kv.shape[spec.token_axis] == 20
    assert torch.equal(layer_major(kv, layout), reference)
    assert spec.bytes_per_token == (1 if latent else 2) * L * spec.num_kv_heads * spec.head_dim * 4
    config = LMTierConfig(
        chunk_size=16,
        cpu=CPUTierConfig(capacity_bytes=1 << 20, staging_bytes=1 << 20),
        disk=DiskTierConfig(enabled=False),
    )
    prompt = list(range(20))
    pairs = [] if latent else [(layer[0], layer[1]) for layer in reference]
    for source in [kv, pairs] if pairs else [kv]:  # pairs land where the layers would
        with LMTier.open(config, kv=spec, model_id="m") as cache:
            assert cache.store(prompt, source) == 1
            with cache.load(prompt) as loaded:
                got = loaded.kv()
                assert got is not None and torch.equal(got, spec.narrow_tokens(kv, 0, 16))
    if latent:
        with (
            LMTier.open(config, kv=spec, model_id="m") as cache,
            pytest.raises(InvalidKVError, match="per-layer"),
        ):
            cache.store(prompt, [(reference[0, 0], reference[0, 0])] * L)
    with pytest.raises(ValueError, match="whole page blocks"):
        layer_major(torch.zeros(HND.shape(8)), "LBHSC")
