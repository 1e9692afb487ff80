"""Paged KV memory and the transfer engine on CPU: gather/scatter bit-exact for random
block tables, every dtype, partial chunks, wrapped strided page layouts, slab encoding,
and the layer-wise load/save API (synchronous on CPU)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmtier.chunks.format import decode
from lmtier.chunks.keys import ChunkKey
from lmtier.kv_spec import KVSpec, chunk_tensor, encode_kv_into
from lmtier.storage.host_pool import HostPool
from lmtier_connector.device import transfer
from lmtier_connector.device.paged_kv import PagedKVCache
from lmtier_connector.device.transfer import (
    TransferEngine,
    gather,
    load_chunk_from_slab,
    save_chunk_into_slab,
    scatter,
)
from support.fake_streams import FakeStream, fake_cuda
from support.kv_bits import bits, randomize, same_bits

L, H, D, N = 3, 2, 4, 24  # layers, KV heads, head dim, blocks
DTYPES = ["float32", "float16", "bfloat16", "int8"] + (
    ["float8_e4m3fn"] if hasattr(torch, "float8_e4m3fn") else []
)
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def tokens_of_layer(layer: torch.Tensor, layout: str, slots: torch.Tensor) -> torch.Tensor:
    """Reference: the KV at ``slots`` of one native per-layer tensor, written per layout
    without the module's canonical views: (2, T, H, D), or (T, D) for MLA."""
    if layout == "KNSHD":
        return layer.reshape(2, -1, *layer.shape[-2:])[:, slots]
    if layout == "NKSHD":
        return layer.transpose(0, 1).reshape(2, -1, *layer.shape[-2:])[:, slots]
    if layout == "NSD":
        return layer.reshape(-1, layer.shape[-1])[slots]
    heads, width = layer.shape[1], layer.shape[3]  # NHSC: (N, H, S, C)
    rows = layer.permute(0, 2, 1, 3).reshape(-1, heads, width)[slots]
    if heads == 1 and width == D:  # MLA in the NHSC layout
        return rows[:, 0, :]
    return torch.stack([rows[..., : width // 2], rows[..., width // 2 :]])


def expected_chunk(pages: PagedKVCache, ids: list[int], num_tokens: int) -> torch.Tensor:
    slots = pages.slot_mapping(ids, num_tokens)
    per_layer = [tokens_of_layer(pages.layer(i), pages.layout, slots) for i in range(L)]
    chunk = torch.stack(per_layer)  # (L, K, T, H, D), or (L, T, D) for MLA
    order = {"KLTHD": (1, 0, 2, 3, 4), "KTLHD": (1, 2, 0, 3, 4), "TLD": (1, 0, 2)}
    layout = pages.spec.layout
    return chunk.permute(order[layout]) if layout in order else chunk


def empty_chunk(spec: KVSpec, pages: PagedKVCache, num_tokens: int) -> torch.Tensor:
    return torch.empty(spec.shape(num_tokens), dtype=pages.dtype)


def whole(pages: PagedKVCache) -> torch.Tensor:
    assert pages.stacked is not None
    return pages.stacked


def need(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# --- own allocation: random block tables, dtypes, partial chunks ---------------------------


@FAST
@given(
    dtype=st.sampled_from(DTYPES),
    block_size=st.sampled_from([1, 4, 16]),
    data=st.data(),
)
def test_gather_scatter_round_trip_is_bit_exact(
    dtype: str, block_size: int, data: st.DataObject
) -> None:
    spec = KVSpec(L, H, D, dtype)
    num_tokens = data.draw(st.integers(1, min(N * block_size, 70)), label="num_tokens")
    count = need(num_tokens, block_size)
    src_ids = data.draw(st.permutations(range(N)), label="src")[:count]
    dst_ids = data.draw(st.permutations(range(N)), label="dst")[:count]
    pages = PagedKVCache(spec, N, block_size)
    randomize(whole(pages), 1)

    chunk = empty_chunk(spec, pages, num_tokens)
    gather(pages, src_ids, chunk)
    assert same_bits(chunk, expected_chunk(pages, src_ids, num_tokens))

    target = PagedKVCache(spec, N, block_size)
    randomize(whole(target), 2)
    before = whole(target).clone()
    scatter(chunk, target, torch.tensor(dst_ids))
    back = empty_chunk(spec, target, num_tokens)
    gather(target, dst_ids, back)
    assert same_bits(back, chunk)
    # Nothing outside the first num_tokens slots of the run changed.
    written = torch.zeros(N * block_size, dtype=torch.bool)
    written[target.slot_mapping(dst_ids, num_tokens)] = True
    keep = (~written).view(N, block_size)
    assert torch.equal(bits(whole(target)[:, :, keep]), bits(before[:, :, keep]))


def test_partial_chunk_leaves_the_rest_of_its_last_block_untouched() -> None:
    spec = KVSpec(L, H, D, "float16")
    pages = PagedKVCache(spec, N, 16)
    whole(pages).fill_(-1.0)
    chunk = torch.full(spec.shape(35), 7.0, dtype=torch.float16)
    scatter(chunk, pages, [9, 4, 17])
    layer = pages.layer(1)
    assert bool((layer[:, [9, 4]] == 7).all()) and bool((layer[:, 17, :3] == 7).all())
    assert bool((layer[:, 17, 3:] == -1).all())
    others = [b for b in range(N) if b not in (9, 4, 17)]
    assert bool((layer[:, others] == -1).all())


def test_repeated_ids_gather_the_same_block_twice_and_a_scatter_refuses_them() -> None:
    spec = KVSpec(L, H, D)
    pages = PagedKVCache(spec, N, 4)
    randomize(whole(pages), 3)
    chunk = empty_chunk(spec, pages, 8)
    gather(pages, [5, 5], chunk)
    assert same_bits(chunk[:, :, :4], chunk[:, :, 4:])
    with pytest.raises(ValueError, match="repeats"):
        scatter(chunk, pages, [5, 5])


@pytest.mark.parametrize(
    ("ids", "num_tokens", "match"),
    [
        ([1, 2], 9, "fill 3 blocks"),
        ([1, 2, 3], 8, "fill 2 blocks"),
        ([1, N], 8, "outside"),
        ([-1, 2], 8, "outside"),
    ],
)
def test_bad_block_runs_are_value_errors(ids: list[int], num_tokens: int, match: str) -> None:
    spec = KVSpec(L, H, D)
    pages = PagedKVCache(spec, N, 4)
    with pytest.raises(ValueError, match=match):
        gather(pages, ids, empty_chunk(spec, pages, num_tokens))


def test_block_ids_must_be_integers() -> None:
    spec = KVSpec(L, H, D)
    pages = PagedKVCache(spec, N, 4)
    with pytest.raises(TypeError):
        gather(pages, [1.5, 2.0], empty_chunk(spec, pages, 8))  # type: ignore[list-item]
    with pytest.raises(TypeError):
        scatter(empty_chunk(spec, pages, 8), pages, torch.tensor([1.0, 2.0]))


def test_chunk_of_the_wrong_shape_or_dtype_is_a_value_error() -> None:
    spec = KVSpec(L, H, D, "float16")
    pages = PagedKVCache(spec, N, 4)
    with pytest.raises(ValueError, match="these pages need"):
        gather(pages, [1], torch.empty(spec.shape(4), dtype=torch.float32))
    with pytest.raises(ValueError, match="these pages need"):
        gather(pages, [1], torch.empty(L, 2, 4, H, D + 1, dtype=torch.float16))


@pytest.mark.parametrize("layout", ["KLTHD", "KTLHD", "LTD", "TLD"])
def test_other_chunk_layouts_and_a_strided_out_tensor(layout: str) -> None:
    latent = layout in ("LTD", "TLD")
    spec = KVSpec(L, 1 if latent else H, D, "bfloat16", layout)
    pages = PagedKVCache(spec, N, 4)
    assert pages.layout == ("NSD" if latent else "KNSHD")
    randomize(whole(pages), 4)
    shape = spec.shape(10)
    wide = torch.empty(*shape[:-1], shape[-1] + 3, dtype=torch.bfloat16)
    out = wide[..., : shape[-1]]  # not contiguous
    gather(pages, [3, 0, 11], out)
    assert same_bits(out, expected_chunk(pages, [3, 0, 11], 10))
    target = PagedKVCache(spec, N, 4)
    scatter(out, target, [1, 2, 3])
    assert same_bits(expected_chunk(target, [1, 2, 3], 10), out)


# --- wrapped tensors: layouts and strides --------------------------------------------------


def _separate(spec: KVSpec) -> list[torch.Tensor]:
    return [torch.empty(2, N, 4, H, D, dtype=torch.float16) for _ in range(L)]


def _nhsc(order: tuple[int, ...]) -> Callable[[KVSpec], list[torch.Tensor]]:
    """vLLM >= 0.33: physical order ``order`` of the logical [L, N, H, S, C] axes."""

    def make(spec: KVSpec) -> list[torch.Tensor]:
        logical = (L, N, H, 4, 2 * D)
        raw = torch.empty([logical[axis] for axis in order], dtype=torch.float16)
        return list(raw.permute(*[order.index(axis) for axis in range(5)]).unbind(0))

    return make


WRAPPED: dict[str, tuple[Callable[[KVSpec], list[torch.Tensor]], str, bool, str]] = {
    # name: (make layers, expected layout, expected stacked, spec layout)
    "KNSHD one buffer": (
        lambda s: list(torch.empty(L, 2, N, 4, H, D, dtype=torch.float16).unbind(0)),
        "KNSHD",
        True,
        "LKTHD",
    ),
    "KNSHD separate": (_separate, "KNSHD", False, "LKTHD"),
    "KNSHD padded, stride-2 dims": (
        lambda s: list(
            torch.empty(L, 2, N + 3, 4, H, 2 * D, dtype=torch.float16)[:, :, :N, :, :, ::2].unbind(
                0
            )
        ),
        "KNSHD",
        True,
        "LKTHD",
    ),
    "NKSHD (FlashInfer)": (
        lambda s: list(torch.empty(L, N, 2, 4, H, D, dtype=torch.float16).unbind(0)),
        "NKSHD",
        True,
        "LKTHD",
    ),
    "NHSC LBNHC": (_nhsc((0, 1, 3, 2, 4)), "NHSC", True, "LKTHD"),
    "NHSC LBHNC": (_nhsc((0, 1, 2, 3, 4)), "NHSC", True, "LKTHD"),
    "NHSC BLNHC (cross-layer)": (_nhsc((1, 0, 3, 2, 4)), "NHSC", True, "LKTHD"),
    "NHSC LHBNC": (_nhsc((0, 2, 1, 3, 4)), "NHSC", True, "LKTHD"),
    "MLA NSD": (
        lambda s: list(torch.empty(L, N, 4, D, dtype=torch.float16).unbind(0)),
        "NSD",
        True,
        "LTD",
    ),
    "MLA NHSC": (
        lambda s: list(torch.empty(N, L, 1, 4, D, dtype=torch.float16).transpose(0, 1).unbind(0)),
        "NHSC",
        True,
        "LTD",
    ),
}


@pytest.mark.parametrize("name", list(WRAPPED))
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_wrapped_layouts_round_trip(name: str, data: st.DataObject) -> None:
    make, layout, stacked, chunk_layout = WRAPPED[name]
    spec = KVSpec(L, 1 if chunk_layout == "LTD" else H, D, "float16", chunk_layout)
    layers = make(spec)
    for seed, layer in enumerate(layers):
        randomize(layer, seed)
    pages = PagedKVCache.from_tensors(spec, layers)
    assert (pages.layout, pages.stacked is not None) == (layout, stacked)
    assert (pages.num_blocks, pages.block_size) == (N, 4)
    assert all(pages.layer(i) is layers[i] for i in range(L))

    num_tokens = data.draw(st.integers(1, 30), label="num_tokens")
    perm = data.draw(st.permutations(range(N)), label="ids")
    src, dst = perm[: need(num_tokens, 4)], perm[-need(num_tokens, 4) :]
    chunk = empty_chunk(spec, pages, num_tokens)
    gather(pages, src, chunk)
    assert same_bits(chunk, expected_chunk(pages, src, num_tokens))
    scatter(chunk, pages, dst)  # writes through to the engine's own tensors
    assert same_bits(expected_chunk(pages, dst, num_tokens), chunk)


@pytest.mark.parametrize("name", list(WRAPPED))
@pytest.mark.parametrize(
    ("src", "dst", "num_tokens"), [([4, 5, 6], [10, 11, 12], 11), ([2], [3], 4)]
)
def test_consecutive_runs_round_trip(
    name: str, src: list[int], dst: list[int], num_tokens: int
) -> None:
    """Consecutive ids take a slice instead of an index op; partly filled tails too."""
    make, _, _, chunk_layout = WRAPPED[name]
    spec = KVSpec(L, 1 if chunk_layout == "LTD" else H, D, "float16", chunk_layout)
    layers = [randomize(layer, seed) for seed, layer in enumerate(make(spec))]
    pages = PagedKVCache.from_tensors(spec, layers)
    chunk = empty_chunk(spec, pages, num_tokens)
    gather(pages, src, chunk)
    assert same_bits(chunk, expected_chunk(pages, src, num_tokens))
    untouched = tokens_of_layer(pages.layer(0), pages.layout, pages.slot_mapping([13], 4)).clone()
    scatter(chunk, pages, dst)
    assert same_bits(expected_chunk(pages, dst, num_tokens), chunk)
    after = tokens_of_layer(pages.layer(0), pages.layout, pages.slot_mapping([13], 4))
    assert same_bits(after, untouched)  # the block after the run, past a partial tail


def test_from_tensors_refuses_unsupported_and_ambiguous_layouts() -> None:
    spec = KVSpec(L, H, D, "float16")
    with pytest.raises(ValueError, match="match no supported page layout"):
        PagedKVCache.from_tensors(spec, [torch.empty(N, 4, H, D, dtype=torch.float16)] * L)
    two_blocks = [torch.empty(2, 2, 4, H, D, dtype=torch.float16) for _ in range(L)]
    with pytest.raises(ValueError, match="ambiguous"):
        PagedKVCache.from_tensors(spec, two_blocks)
    assert PagedKVCache.from_tensors(spec, two_blocks, layout="NKSHD").num_blocks == 2
    good = [torch.empty(2, N, 4, H, D, dtype=torch.float16) for _ in range(L)]
    with pytest.raises(ValueError, match="match no supported page layout"):
        PagedKVCache.from_tensors(spec, good, block_size=8)
    with pytest.raises(ValueError, match="is not KNSHD"):
        PagedKVCache.from_tensors(spec, good, block_size=8, layout="KNSHD")
    with pytest.raises(ValueError, match="cannot hold"):
        PagedKVCache.from_tensors(spec, good, layout="NSD")
    with pytest.raises(ValueError, match="layer tensors"):
        PagedKVCache.from_tensors(spec, good[:2])
    with pytest.raises(ValueError, match="layer tensors differ"):
        PagedKVCache.from_tensors(spec, [*good[:2], torch.empty(2, N + 1, 4, H, D)])
    with pytest.raises(ValueError, match="the spec says float16"):
        PagedKVCache.from_tensors(spec, [t.float() for t in good])


def test_geometry_and_slot_mapping() -> None:
    spec = KVSpec(L, H, D, "bfloat16")
    pages = PagedKVCache(spec, N, 16)
    assert (pages.dtype, pages.device, pages.num_layers) == (torch.bfloat16, torch.device("cpu"), L)
    assert pages.layer(0).shape == (2, N, 16, H, D)
    assert pages.slot_mapping([3, 1], 20).tolist() == [48 + i for i in range(16)] + [16, 17, 18, 19]
    with pytest.raises(ValueError, match="cannot hold"):
        pages.slot_mapping([3], 17)


# --- slabs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [64, 37])
def test_save_into_a_host_pool_slab_decodes_and_loads_back(num_tokens: int) -> None:
    spec = KVSpec(L, H, D, "bfloat16")
    pages = PagedKVCache(spec, N, 16)
    randomize(whole(pages), 5)
    pool = HostPool(spec.encoded_chunk_bytes(64), 2, pin=False)
    ours, reference = pool.acquire(), pool.acquire()
    assert ours is not None and reference is not None
    ids = [7, 2, 20, 11][: need(num_tokens, 16)]
    meta = dataclasses.replace(spec.meta(ChunkKey(bytes(range(32))), num_tokens), created=1.5)

    length = save_chunk_into_slab(pages, ids, ours, meta)
    chunk = decode(ours.view[:length])  # validates both checksums
    assert chunk.meta == meta
    assert same_bits(chunk_tensor(chunk), expected_chunk(pages, ids, num_tokens))
    # The same bytes as encode_kv_into of the same KV.
    ref_length = encode_kv_into(reference, meta, expected_chunk(pages, ids, num_tokens))
    assert bytes(ours.view[:length]) == bytes(reference.view[:ref_length])

    target = PagedKVCache(spec, N, 16)
    load_chunk_from_slab(chunk, target, [0, 1, 2, 3][: len(ids)])
    assert same_bits(
        expected_chunk(target, [0, 1, 2, 3][: len(ids)], num_tokens), chunk_tensor(chunk)
    )
    ours.release()
    reference.release()
    pool.close()


# --- the engine's layer-wise API on CPU ----------------------------------------------------


@pytest.mark.parametrize("stacked", [True, False])
def test_layerwise_load_on_cpu_in_and_out_of_order(stacked: bool) -> None:
    spec = KVSpec(L, H, D)
    layers = [randomize(torch.empty(2, N, 4, H, D), i) for i in range(L)]
    source = PagedKVCache.from_tensors(spec, layers)
    pages = PagedKVCache(spec, N, 4) if stacked else PagedKVCache.from_tensors(spec, _fresh())
    assert (pages.stacked is not None) == stacked
    runs = [[0, 1, 2], [5, 4], [23]]  # 12, 7 and 2 tokens
    chunks = [empty_chunk(spec, source, n) for n in (12, 7, 2)]
    for run, chunk in zip(runs, chunks, strict=True):
        gather(source, run, chunk)
    engine = TransferEngine(pages)
    assert engine.pages is pages
    targets = [[9, 3, 10], [22, 0], [6]]
    handle = engine.start_load(chunks, targets)
    assert handle.done() and handle.events == ()
    for layer in reversed(range(L)):
        handle.wait_layer(layer)
    for layer in range(L):
        handle.wait_layer(layer)
    handle.wait()
    handle.synchronize()
    with pytest.raises(ValueError, match="outside"):
        handle.wait_layer(L)
    for run, chunk in zip(targets, chunks, strict=True):
        assert same_bits(expected_chunk(pages, run, chunk.shape[2]), chunk)
    with pytest.raises(ValueError, match="repeats"):
        engine.start_load(chunks[1:], [[1, 2], [2]])


def _fresh() -> list[torch.Tensor]:
    return [torch.zeros(2, N, 4, H, D) for _ in range(L)]


@pytest.mark.parametrize("stacked", [True, False])
def test_save_handle_on_cpu_layer_by_layer(stacked: bool) -> None:
    spec = KVSpec(L, H, D)
    pages = PagedKVCache(spec, N, 4) if stacked else PagedKVCache.from_tensors(spec, _fresh())
    for layer in range(L):
        randomize(pages.layer(layer), 10 + layer)
    engine = TransferEngine(pages)
    outs = [empty_chunk(spec, pages, 8).zero_(), empty_chunk(spec, pages, 3).zero_()]
    runs = [[4, 8], [15]]
    handle = engine.begin_save(runs, outs)
    assert handle.pending_layers == list(range(L)) and not handle.done()
    with pytest.raises(RuntimeError, match="never enqueued"):
        handle.wait()
    handle.save_layer(2)
    handle.save_layer(0)
    assert handle.pending_layers == [1]
    assert bool((outs[0][1] == 0).all())  # layer 1 not copied yet
    with pytest.raises(ValueError, match="was saved"):
        handle.save_layer(0)
    handle.save_all()
    assert handle.done()
    handle.wait()
    for run, out in zip(runs, outs, strict=True):
        assert same_bits(out, expected_chunk(pages, run, out.shape[2]))

    again = [torch.zeros_like(out) for out in outs]
    whole = engine.begin_save(runs, again)
    whole.save_all()
    assert whole.done() and whole.pending_layers == []
    assert all(same_bits(a, b) for a, b in zip(again, outs, strict=True))


# --- the CUDA branches' stream protocol, with recording fakes on CPU -----------------------


def test_cuda_branches_follow_the_stream_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA code paths run on CPU tensors with fake streams and events: the load
    stream waits for compute once, then copies and records one event per layer; compute
    waits on exactly the event of the layer it asks for; the save stream waits for
    compute before each layer's copies; compute never waits on the save stream."""
    log: list[tuple[str, ...]] = []
    current = fake_cuda(monkeypatch, log)

    def traced(fn: Callable[..., None], what: str) -> Callable[..., None]:
        def run(*args: object, non_blocking: bool) -> None:
            log.append((current[-1].name, what, str(non_blocking)))
            fn(*args, non_blocking=non_blocking)

        return run

    monkeypatch.setattr(transfer, "_scatter_run", traced(transfer._scatter_run, "scatters"))
    monkeypatch.setattr(transfer, "_gather_run", traced(transfer._gather_run, "gathers"))

    spec = KVSpec(L, H, D, "float16")
    source = PagedKVCache(spec, N, 4)
    randomize(whole(source), 6)
    chunks = [empty_chunk(spec, source, 8), empty_chunk(spec, source, 5)]
    gather(source, [1, 2], chunks[0])
    gather(source, [3, 4], chunks[1])
    pages = PagedKVCache(spec, N, 4)
    engine = TransferEngine(pages)
    engine._load_stream = FakeStream("load", log)  # type: ignore[assignment]
    engine._save_stream = FakeStream("save", log)  # type: ignore[assignment]
    log.clear()

    load = engine.start_load(chunks, [[7, 8], [9, 10]])
    per_layer = [("load", "scatters", "True")] * 2
    expected = [("load", "waits for", "compute")]
    for layer in range(L):
        expected += [*per_layer, ("load", "records", f"event{layer}")]
    assert log == expected
    log.clear()
    load.wait_layer(1)
    load.wait()
    assert log == [("compute", "waits for", "event1"), ("compute", "waits for", f"event{L - 1}")]
    for run, chunk in zip([[7, 8], [9, 10]], chunks, strict=True):
        assert same_bits(expected_chunk(pages, run, chunk.shape[2]), chunk)

    log.clear()
    outs = [torch.zeros_like(chunk) for chunk in chunks]
    save = engine.begin_save([[7, 8], [9, 10]], outs)
    save.save_layer(0)
    assert log == [
        ("save", "waits for", "compute"),
        *[("save", "gathers", "True")] * 2,
        ("save", "records", "event0"),
    ]
    save.save_all()
    save.wait()
    assert log[-1] == ("host", "waits for", f"event{L - 1}")
    assert not [entry for entry in log if entry[0] == "compute"]
    assert all(same_bits(out, chunk) for out, chunk in zip(outs, chunks, strict=True))
