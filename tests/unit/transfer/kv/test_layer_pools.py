"""Per-layer pools over engine-owned tensors in vLLM's KV cache formats: addressing,
registration ranges, staging gather/scatter, descriptor arithmetic, bootstrap documents and
the protocol end to end over the loopback transport. Unit tests: no NIXL, no GPU.

Every expected value is computed by indexing the engine's tensors by hand (as vLLM shapes
them), never through the pool's own address or view helpers.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from pydantic import ValidationError

from pd_testbed.transfer_harness import TEST_AUTH, Cluster
from pd_transfer.common.paths import (
    choose_path,
    compute_contiguous_spans,
    compute_layout,
    compute_sliced_spans,
)
from pd_transfer.errors import GeometryMismatch
from pd_transfer.kv.layout import ByteRange, KVLayout, KVPacking, KVPart, PageFormat, PageRun
from pd_transfer.kv.plan import HeadSlice, LayerRange, RankCoord, TransferPlan
from pd_transfer.kv.pool import KVPool
from pd_transfer.kv.staging import gather, scatter, staged_chunk_bytes
from pd_transfer.protocol.lifecycle import State
from pd_transfer.trust.bootstrap import (
    MAX_KV_REGIONS,
    BootstrapServer,
    RankDocument,
    check_compatible,
)

pytestmark = pytest.mark.timeout(60)

PAGES, PAGE_SIZE, HEAD_DIM, LAYERS = 6, 4, 8, 3


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    count = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


@dataclass
class Engine:
    """One engine's per-layer KV tensors, shaped as vLLM shapes them, with the hand-made
    accessor of a page's head slice that the expectations use."""

    name: str
    layout: KVLayout
    layers: list[torch.Tensor]  # vLLM's per-layer tensors
    parts: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]  # a layer tensor -> its parts
    # (layer tensor, part index, page, h0, h1) -> that head slice in staging order [a, h, b]
    head_slice: Callable[[torch.Tensor, int, int, int, int], torch.Tensor]

    def pool(self) -> KVPool:
        return KVPool.from_layer_tensors(self.layout, [self.parts(t) for t in self.layers])


def _u8(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def cpu_engine(heads: int, dtype: torch.dtype, seed: int) -> Engine:
    """vLLM CPU backend: one allocation shared by all layers; layer ``l`` is
    ``[num_blocks, H, block_size, 2 * head_size]``, viewed per head as K rows then V rows."""
    gen = torch.Generator().manual_seed(seed)
    whole = random_bytes((LAYERS, PAGES, heads, PAGE_SIZE, 2 * HEAD_DIM), dtype, gen)
    layout = KVLayout(LAYERS, PAGES, PAGE_SIZE, heads, HEAD_DIM, dtype,
                      page_format=PageFormat.HND, packing=KVPacking.PER_HEAD)

    def head_slice(t: torch.Tensor, part: int, page: int, h0: int, h1: int) -> torch.Tensor:
        assert part == 0
        kv = t.view(PAGES, heads, 2, PAGE_SIZE, HEAD_DIM)[page, h0:h1]  # [h, 2, bs, D]
        return _u8(kv).reshape(1, h1 - h0, -1)

    return Engine("cpu", layout, list(whole), lambda t: (t,), head_slice)


def flash_engine(heads: int, dtype: torch.dtype, seed: int) -> Engine:
    """vLLM FlashAttention (NHD): per layer ``[2, num_blocks, block_size, H, head_size]``."""
    gen = torch.Generator().manual_seed(seed)
    layers = [random_bytes((2, PAGES, PAGE_SIZE, heads, HEAD_DIM), dtype, gen)
              for _ in range(LAYERS)]
    layout = KVLayout(LAYERS, PAGES, PAGE_SIZE, heads, HEAD_DIM, dtype)

    def head_slice(t: torch.Tensor, part: int, page: int, h0: int, h1: int) -> torch.Tensor:
        return _u8(t[part, page, :, h0:h1]).reshape(PAGE_SIZE, h1 - h0, -1)

    return Engine("flash", layout, layers, lambda t: (t[0], t[1]), head_slice)


def hnd_engine(heads: int, dtype: torch.dtype, seed: int) -> Engine:
    """vLLM's HND layout: per layer ``[2, num_blocks, H, block_size, head_size]``."""
    gen = torch.Generator().manual_seed(seed)
    layers = [random_bytes((2, PAGES, heads, PAGE_SIZE, HEAD_DIM), dtype, gen)
              for _ in range(LAYERS)]
    layout = KVLayout(LAYERS, PAGES, PAGE_SIZE, heads, HEAD_DIM, dtype,
                      page_format=PageFormat.HND)

    def head_slice(t: torch.Tensor, part: int, page: int, h0: int, h1: int) -> torch.Tensor:
        return _u8(t[part, page, h0:h1]).reshape(1, h1 - h0, -1)

    return Engine("hnd", layout, layers, lambda t: (t[0], t[1]), head_slice)


ENGINES = [cpu_engine, flash_engine, hnd_engine]
ENGINE_IDS = ["cpu-per-head", "flash-nhd", "hnd-separate"]


# Layout and pool --------------------------------------------------------------------------


def test_page_formats_give_the_page_view_parts_and_sizes() -> None:
    nhd = KVLayout(2, 5, 4, 3, 8, torch.bfloat16)
    hnd = KVLayout(2, 5, 4, 3, 8, torch.bfloat16, page_format=PageFormat.HND)
    packed = KVLayout(2, 5, 4, 3, 8, torch.bfloat16, page_format=PageFormat.HND,
                      packing=KVPacking.PER_HEAD)
    assert (nhd.page_view, hnd.page_view, packed.page_view) == ((4, 16), (1, 64), (1, 128))
    assert nhd.parts == hnd.parts == (KVPart.K, KVPart.V) and packed.parts == (KVPart.KV,)
    assert nhd.page_bytes_per_layer == hnd.page_bytes_per_layer == 4 * 3 * 16
    assert packed.page_bytes_per_layer == 2 * 4 * 3 * 16
    assert nhd.total_kv_bytes == hnd.total_kv_bytes == packed.total_kv_bytes
    assert nhd.is_token_major and not hnd.is_token_major and not packed.is_token_major
    for layout in (nhd, hnd, packed):  # same bytes whatever the format
        assert staged_chunk_bytes(layout, 2, 3, 1) == 2 * 3 * 2 * 4 * 16
    token_major = KVLayout(2, 5, 4, 3, 8, torch.bfloat16, packing=KVPacking.PER_HEAD)
    assert token_major.page_view == (4, 32) and token_major.parts == (KVPart.KV,)
    assert token_major.page_bytes_per_layer == packed.page_bytes_per_layer
    with pytest.raises(ValueError, match="PER_HEAD packing needs"):
        KVLayout(2, 5, 4, 1, 8, torch.bfloat16, has_v=False, page_format=PageFormat.HND,
                 packing=KVPacking.PER_HEAD)


@pytest.mark.parametrize("make", ENGINES, ids=ENGINE_IDS)
def test_page_addresses_are_the_engine_tensors_own(make: Callable[..., Engine]) -> None:
    engine = make(2, torch.bfloat16, 0)
    pool = engine.pool()
    assert not pool.is_stacked
    page_bytes = engine.layout.page_bytes_per_layer
    for layer, tensor in enumerate(engine.layers):
        for index, part in enumerate(engine.layout.parts):
            own = engine.parts(tensor)[index]
            assert pool.layer_page_base(part, layer) == own.data_ptr()
            assert pool.page_run_address(part, layer, PageRun(2, 3)) == ByteRange(
                own[2].data_ptr(), 3 * page_bytes)
            assert own[1].data_ptr() - own[0].data_ptr() == page_bytes
            assert pool.layer_tensor(part, layer).data_ptr() == own.data_ptr()
    with pytest.raises(IndexError, match="page 6 outside"):
        pool.page_run_address(engine.layout.parts[0], 0, PageRun(4, 3))


def test_registration_ranges_merge_one_allocation_and_alias_it() -> None:
    cpu = cpu_engine(2, torch.bfloat16, 0)  # every layer a slice of ONE allocation
    ranges = cpu.pool().registration_ranges()
    whole = cpu.layers[0].untyped_storage()
    assert ranges == [ByteRange(whole.data_ptr(), whole.nbytes())]
    flash = flash_engine(2, torch.bfloat16, 0)  # K and V halves of each layer tensor merged
    pool = flash.pool()
    assert pool.registration_ranges() == sorted(
        (ByteRange(t.data_ptr(), t.numel() * t.element_size()) for t in flash.layers),
        key=lambda r: r.address)
    for item, tensor in zip(pool.registration_ranges(), pool.registration_tensors(),
                            strict=True):
        assert tensor.dtype == torch.uint8 and tensor.is_contiguous()
        assert (tensor.data_ptr(), tensor.numel()) == (item.address, item.length_bytes)
    stacked = KVPool.allocate(flash.layout)
    assert stacked.is_stacked and stacked.registration_ranges() == sorted(
        (ByteRange(t.data_ptr(), flash.layout.part_bytes) for t in stacked.tensors()),
        key=lambda r: r.address)


def test_stacked_only_accessors_name_what_to_use_instead() -> None:
    pool = hnd_engine(2, torch.bfloat16, 0).pool()
    for call in (pool.tensors, lambda: pool.layer(KVPart.K, 0),
                 lambda: pool.pages_to_tokens([0]), lambda: pool.k, lambda: pool.v):
        with pytest.raises(TypeError, match="per layer: use layer_tensor"):
            call()


def test_wrapping_checks_counts_bytes_contiguity_and_device() -> None:
    engine = flash_engine(2, torch.bfloat16, 0)
    parts = [engine.parts(t) for t in engine.layers]
    with pytest.raises(ValueError, match="2 layers of tensors given, the layout has 3"):
        KVPool.from_layer_tensors(engine.layout, parts[:2])
    with pytest.raises(ValueError, match="layer 1 has 1 tensors"):
        KVPool.from_layer_tensors(engine.layout, [parts[0], parts[1][:1], parts[2]])
    short = [parts[0], (parts[1][0][:-1], parts[1][1]), parts[2]]
    with pytest.raises(ValueError, match=r"layer 1 part k holds .* bytes, the layout needs"):
        KVPool.from_layer_tensors(engine.layout, short)
    strided = engine.layers[2].transpose(2, 3).contiguous().transpose(2, 3)
    with pytest.raises(ValueError, match="layer 2 part k must be contiguous"):
        KVPool.from_layer_tensors(engine.layout, [*parts[:2], (strided[0], strided[1])])
    meta = torch.empty(engine.layers[0][0].shape, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="on meta, the first tensor on cpu"):
        KVPool.from_layer_tensors(engine.layout, [*parts[:2], (meta, meta)])
    with pytest.raises(ValueError, match=r"use KVPool\.from_layer_tensors"):
        KVPool.allocate(cpu_engine(2, torch.bfloat16, 0).layout)


@pytest.mark.parametrize("make", ENGINES, ids=ENGINE_IDS)
def test_token_bytes_reads_keys_and_values_of_every_format(make: Callable[..., Engine]) -> None:
    engine = make(2, torch.float16, 1)
    pool = engine.pool()
    for layer, tensor in enumerate(engine.layers):
        for part, index in ((KVPart.K, 0), (KVPart.V, 1)):
            view = pool.token_bytes(part, layer)  # [pages, page_size, heads, head_bytes]
            for page in (0, 5):
                if engine.name == "cpu":
                    own = tensor.view(PAGES, 2, 2, PAGE_SIZE, HEAD_DIM)[page, :, index]
                    expected = _u8(own.transpose(0, 1))
                elif engine.name == "flash":
                    expected = _u8(tensor[index, page])
                else:
                    expected = _u8(tensor[index, page].transpose(0, 1))
                assert torch.equal(view[page], expected.reshape(PAGE_SIZE, 2, -1))


# Staging ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
@pytest.mark.parametrize("make", ENGINES, ids=ENGINE_IDS)
@pytest.mark.parametrize(("src_heads", "dst_heads", "h_src", "h_dst", "count"),
                         [(4, 2, 2, 0, 2), (2, 4, 0, 3, 1), (2, 2, 0, 0, 2)])
def test_gather_then_scatter_is_bit_exact_against_the_engine_tensors(  # noqa: PLR0917
    make: Callable[..., Engine], dtype: torch.dtype, src_heads: int, dst_heads: int,
    h_src: int, h_dst: int, count: int,
) -> None:
    src, dst = make(src_heads, dtype, 10), make(dst_heads, dtype, 11)
    dst_before = [t.clone() for t in dst.layers]
    src_pool, dst_pool = src.pool(), dst.pool()
    layers, src_pages, dst_pages = [2, 0], [5, 1, 3], [0, 4, 2]
    size = staged_chunk_bytes(src.layout, len(layers), len(src_pages), count)
    buffer = torch.full((size + 7,), 0xAB, dtype=torch.uint8)
    assert gather(src_pool, layers, src_pages, head_start=h_src, num_heads=count,
                  out=buffer) == size
    assert buffer[size:].eq(0xAB).all()
    a, b = src.layout.page_view
    staged = buffer[:size].view(len(src.layout.parts), len(layers), len(src_pages), a, count, b)
    for p in range(len(src.layout.parts)):
        for i, layer in enumerate(layers):
            for j, page in enumerate(src_pages):
                expected = src.head_slice(src.layers[layer], p, page, h_src, h_src + count)
                assert torch.equal(staged[p, i, j], expected)
    assert scatter(buffer, dst_pool, layers, dst_pages, head_start=h_dst,
                   num_heads=count) == size
    for layer, (after, before) in enumerate(zip(dst.layers, dst_before, strict=True)):
        for p in range(len(dst.layout.parts)):
            for page in range(PAGES):
                for h in range(dst_heads):
                    got = dst.head_slice(after, p, page, h, h + 1)
                    moved = (layer in layers and page in dst_pages
                             and h_dst <= h < h_dst + count)
                    if moved:
                        src_page = src_pages[dst_pages.index(page)]
                        src_h = h - h_dst + h_src
                        want = src.head_slice(src.layers[layer], p, src_page, src_h, src_h + 1)
                    else:
                        want = dst.head_slice(before, p, page, h, h + 1)
                    assert torch.equal(got, want), (layer, p, page, h)


def test_nhd_per_layer_staging_is_byte_identical_to_the_stacked_pool() -> None:
    """The FlashAttention format moves the same staged bytes as our stacked pool."""
    flash = flash_engine(4, torch.bfloat16, 3)
    stacked = KVPool.allocate(flash.layout)
    for part in range(2):
        stacked.tensors()[part].copy_(torch.stack([t[part] for t in flash.layers])
                                      .reshape(flash.layout.tensor_shape))
    size = staged_chunk_bytes(flash.layout, 2, 2, 2)
    out_layers, out_stacked = torch.empty(size, dtype=torch.uint8), torch.empty(size,
                                                                                dtype=torch.uint8)
    gather(flash.pool(), [1, 2], [4, 0], head_start=1, num_heads=2, out=out_layers)
    gather(stacked, [1, 2], [4, 0], head_start=1, num_heads=2, out=out_stacked)
    assert torch.equal(out_layers, out_stacked)


# Descriptor arithmetic ---------------------------------------------------------------------


def _plan(num_heads: int, src_offset: int = 0, dst_offset: int = 0) -> TransferPlan:
    heads = HeadSlice(0, 0, src_offset, dst_offset, num_heads, src_offset)
    return TransferPlan(0, 0, RankCoord(0, 0), RankCoord(0, 0), LayerRange(0, LAYERS), 0, 0,
                        heads, 2, HEAD_DIM * 2)


@pytest.mark.parametrize("make", ENGINES, ids=ENGINE_IDS)
def test_contiguous_spans_move_whole_pages_between_per_layer_pools(
    make: Callable[..., Engine],
) -> None:
    src, dst = make(2, torch.bfloat16, 20), make(2, torch.bfloat16, 21)
    src_pool, dst_pool = src.pool(), dst.pool()
    pages = [(1, 3), (2, 4), (5, 0)]  # the first two consecutive on both sides
    local, remote = compute_contiguous_spans(
        src.layout, src_bases=src_pool.base_table(), dst=dst.layout,
        dst_bases=dst_pool.base_table(), layers=[(0, 2), (2, 1)], pages=pages)
    assert len(local) == len(src.layout.parts) * 2 * 2
    for (s_addr, length), (d_addr, d_length) in zip(local, remote, strict=True):
        assert length == d_length
        copy_bytes(s_addr, d_addr, length, src_pool, dst_pool)
    for p in range(len(src.layout.parts)):
        for src_layer, dst_layer in [(0, 2), (2, 1)]:
            for s_page, d_page in pages:
                assert torch.equal(dst.head_slice(dst.layers[dst_layer], p, d_page, 0, 2),
                                   src.head_slice(src.layers[src_layer], p, s_page, 0, 2))


def copy_bytes(src_addr: int, dst_addr: int, length: int, src: KVPool, dst: KVPool) -> None:
    """What the transport does with one descriptor pair, through the registered views."""

    def at(pool: KVPool, address: int) -> torch.Tensor:
        for item, tensor in zip(pool.registration_ranges(), pool.registration_tensors(),
                                strict=True):
            if item.address <= address and address + length <= item.end:
                return tensor[address - item.address : address - item.address + length]
        raise AssertionError(f"{address:#x} +{length} is in no registered range")

    at(dst, dst_addr).copy_(at(src, src_addr))


def test_sliced_path_needs_token_major_pages() -> None:
    hnd, flash = hnd_engine(2, torch.bfloat16, 0), flash_engine(2, torch.bfloat16, 0)
    with pytest.raises(ValueError, match=r"path 'sliced' needs token-major pages \(NHD\)"):
        choose_path("sliced", _plan(1), hnd.layout, hnd.layout)
    with pytest.raises(ValueError, match="the decode pool has hnd pages packed separate"):
        choose_path("sliced", _plan(1), flash.layout, hnd.layout)
    assert choose_path("auto", _plan(2), hnd.layout, hnd.layout) == "contiguous"
    assert choose_path("auto", _plan(1), hnd.layout, hnd.layout) == "staged"
    pool = hnd.pool()
    with pytest.raises(ValueError, match="needs token-major pages"):
        compute_sliced_spans(hnd.layout, src_bases=pool.base_table(), dst=hnd.layout,
                             dst_bases=pool.base_table(), layers=[(0, 0)], pages=[(0, 0)],
                             plan=_plan(1))


def test_sliced_spans_of_a_per_layer_nhd_pool_address_each_token_row() -> None:
    src, dst = flash_engine(4, torch.bfloat16, 30), flash_engine(2, torch.bfloat16, 31)
    src_pool, dst_pool = src.pool(), dst.pool()
    local, remote = compute_sliced_spans(
        src.layout, src_bases=src_pool.base_table(), dst=dst.layout,
        dst_bases=dst_pool.base_table(), layers=[(1, 0)], pages=[(3, 5)], plan=_plan(2, 2, 0))
    assert len(local) == 2 * PAGE_SIZE
    for (s_addr, length), (d_addr, _) in zip(local, remote, strict=True):
        copy_bytes(s_addr, d_addr, length, src_pool, dst_pool)
    for p in range(2):
        assert torch.equal(dst.head_slice(dst.layers[0], p, 5, 0, 2),
                           src.head_slice(src.layers[1], p, 3, 2, 4))


# Bootstrap documents ------------------------------------------------------------------------


def cpu_cluster(**kwargs: object) -> Cluster:
    return Cluster(page_format="hnd", packing="per_head", **kwargs)  # type: ignore[arg-type]


def test_document_publishes_regions_and_the_base_table_and_round_trips() -> None:
    cluster = cpu_cluster()
    receiver = cluster.receivers[0]
    document = receiver.document()
    assert document.v == 5
    assert (document.geometry.page_format, document.geometry.packing) == ("hnd", "per_head")
    assert document.layer_bases == receiver.pool.base_table()
    assert len(document.kv_regions) == 1  # one allocation shared by every layer
    assert RankDocument.model_validate_json(document.model_dump_json()) == document
    layout = compute_layout(document)
    assert layout.parts == (KVPart.KV,) and layout.page_format is PageFormat.HND


def _tampered(document: RankDocument, **changes: object) -> dict[str, object]:
    data = document.model_dump()
    data.update(changes)
    return data


def test_hostile_documents_are_refused() -> None:
    document = Cluster(per_layer=True).receivers[0].document()  # FlashAttention-shaped
    region = document.kv_regions[0].model_dump()
    bases = [list(row) for row in document.layer_bases]
    layer_bytes = document.num_pages * document.page_bytes_per_layer
    end = region["base_address"] + region["size_bytes"]
    cases: list[tuple[dict[str, object], str]] = [
        ({"layer_bases": [[end - layer_bytes + 1, *bases[0][1:]], bases[1]]},
         r"layer_bases\[0\]\[0\] .* do not lie inside one of kv_regions"),
        ({"layer_bases": [[1, *bases[0][1:]], bases[1]]}, "do not lie inside"),
        ({"layer_bases": [bases[0]]}, r"rows of \[2\] entries, the geometry needs 2 parts"),
        ({"layer_bases": [bases[0][:1], bases[1][:1]]}, "needs 2 parts x 2 local layers"),
        ({"layer_bases": [bases[0], bases[1], bases[1]]}, "at most 2 items"),
        ({"num_pages": document.num_pages + 1}, "do not lie inside"),
        ({"kv_regions": [region] * (MAX_KV_REGIONS + 1)}, f"at most {MAX_KV_REGIONS} items"),
        ({"kv_regions": [*document.kv_regions[1:], document.kv_regions[0]]},
         "sorted by address and not overlap"),
        ({"kv_regions": [region, dict(region, name="other")]}, "not overlap"),
        ({"kv_regions": [region, dict(region, base_address=end)]}, "repeat a region name"),
        ({"kv_regions": [dict(region, base_address=1 << 64)]}, "less than"),
        ({"tp_rank": 5}, r"TP rank 5 outside \[0, 1\)"),
        ({"geometry": dict(document.geometry.model_dump(), packing="per_head",
                           attention="MLA")},
         "packing 'per_head' needs MHA attention"),
    ]
    for changes, match in cases:
        with pytest.raises(ValidationError, match=match):
            RankDocument.model_validate(_tampered(document, **changes))


def test_a_page_format_mismatch_is_refused_at_the_handshake_naming_both_values() -> None:
    flash, cpu = Cluster(per_layer=True), cpu_cluster(host="127.0.0.1")
    with pytest.raises(GeometryMismatch, match="has page_format='hnd' but this rank has "
                                               "page_format='nhd'"):
        check_compatible(flash.geometry, cpu.senders[0].document(), "prefill:1")
    hnd = Cluster(page_format="hnd")
    with pytest.raises(GeometryMismatch, match="has packing='separate' but this rank has "
                                               "packing='per_head'"):
        check_compatible(cpu.geometry, hnd.senders[0].document(), "prefill:1")
    server = BootstrapServer(cpu.senders[0].document, TEST_AUTH)
    try:
        with pytest.raises(GeometryMismatch, match="page_format='hnd' but this rank has "
                                                   "page_format='nhd'"):
            flash.receivers[0].add_peer(server.address, timeout_s=5.0)
    finally:
        server.close()


def test_an_endpoint_refuses_a_pool_its_geometry_does_not_describe() -> None:
    cluster = Cluster(per_layer=True)
    wrong = hnd_engine(2, torch.bfloat16, 0).pool()
    sender = cluster.senders[0]
    with pytest.raises(ValueError, match="pool has hnd pages packed separate but the rank's "
                                         "geometry says nhd/separate"):
        type(sender)(cluster.fabric.create("x"), wrong, sender.identity, auth=TEST_AUTH,
                     staging_bytes=4096)


# The protocol over loopback ---------------------------------------------------------------


FORMATS = [
    {"page_format": "hnd", "packing": "per_head"},
    {"per_layer": True},
    {"page_format": "hnd"},
]
FORMAT_IDS = ["cpu-per-head", "flash-nhd", "hnd-separate"]
TOPOLOGIES = [
    ({}, "contiguous"), ({}, "staged"),
    ({"prefill_tp": 1, "decode_tp": 2, "kv_heads": 2}, "auto"),
    ({"prefill_tp": 2, "decode_tp": 1, "kv_heads": 2}, "staged"),
    ({"prefill_tp": 2, "decode_tp": 4, "kv_heads": 2}, "auto"),  # fewer heads than ranks
    ({"prefill_tp": 2, "prefill_pp": 2, "decode_tp": 1, "kv_heads": 2, "layers": 4}, "auto"),
]


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize(("topology", "mode"), TOPOLOGIES,
                         ids=["1-1-contiguous", "1-1-staged", "1-2", "2-1", "2-4", "pp2x2-1"])
def test_per_layer_pools_transfer_bit_exactly_over_loopback(
    fmt: dict[str, object], topology: dict[str, int], mode: str,
) -> None:
    cluster = Cluster(mode=mode, head_dim=8, **fmt, **topology)  # type: ignore[arg-type]
    for num_tokens in (13, 4):
        request = cluster.new_request(num_tokens=num_tokens)
        cluster.start(request)
        cluster.run(lambda r=request: cluster.finished(r.room))  # type: ignore[misc]
        assert cluster.states(request.room) == {State.SUCCEEDED}
        assert cluster.verified(request)
        cluster.retire(request)


def test_verify_pool_catches_a_single_flipped_byte_in_a_per_layer_pool() -> None:
    cluster = cpu_cluster(mode="staged")
    request = cluster.new_request(num_tokens=9)
    cluster.start(request)
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.verified(request)
    pool = cluster.receivers[0].pool
    view = pool.token_bytes(KVPart.V, 1)
    view[request.dst_pages[2], 0, 1, 3] ^= 0x40  # token 8: within the 9 tokens
    assert not cluster.verified(request)


def test_random_chunks_of_per_layer_pools_round_trip() -> None:
    """Gather from one pool and scatter into another with random layers, pages and slices;
    the destination then equals the source slice for slice (all formats)."""
    rng = random.Random(5)
    for make in ENGINES:
        src, dst = make(4, torch.bfloat16, 40), make(4, torch.bfloat16, 41)
        src_pool, dst_pool = src.pool(), dst.pool()
        for _ in range(10):
            layers = rng.sample(range(LAYERS), rng.randint(1, LAYERS))
            src_pages = rng.sample(range(PAGES), rng.randint(1, PAGES))
            dst_pages = rng.sample(range(PAGES), len(src_pages))
            count = rng.randint(1, 4)
            h_src, h_dst = rng.randint(0, 4 - count), rng.randint(0, 4 - count)
            size = staged_chunk_bytes(src.layout, len(layers), len(src_pages), count)
            buffer = torch.empty(size, dtype=torch.uint8)
            gather(src_pool, layers, src_pages, head_start=h_src, num_heads=count, out=buffer)
            scatter(buffer, dst_pool, layers, dst_pages, head_start=h_dst, num_heads=count)
            for p in range(len(src.layout.parts)):
                for layer in layers:
                    for s_page, d_page in zip(src_pages, dst_pages, strict=True):
                        assert torch.equal(
                            dst.head_slice(dst.layers[layer], p, d_page, h_dst, h_dst + count),
                            src.head_slice(src.layers[layer], p, s_page, h_src, h_src + count))
