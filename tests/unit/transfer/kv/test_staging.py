"""Staging gather/scatter: exact buffer layout, bit-exact round trips, no hidden copies.

Unit tests: no NIXL. The CUDA tests (marked ``gpu``) compare the fused Triton kernel and the
torch path against the CPU result byte for byte and skip without a CUDA device.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from pd_transfer.kv import staging
from pd_transfer.kv.layout import KVLayout, KVPacking, PageFormat
from pd_transfer.kv.pool import KVPool
from pd_transfer.kv.staging import gather, scatter, staged_chunk_bytes

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]


def make_arange_pool(layout: KVLayout, v_offset: float = 1000.0) -> KVPool:
    """K[l, t, h, d] = ((l*num_tokens + t)*kv_heads + h)*head_dim + d; V = K + v_offset."""
    count = layout.num_layers * layout.num_tokens * layout.kv_heads * layout.head_dim
    k = torch.arange(count, dtype=torch.float32).reshape(layout.tensor_shape).to(layout.dtype)
    v = (k.float() + v_offset).to(layout.dtype) if layout.has_v else None
    return KVPool(layout, k, v)


def make_random_pool(layout: KVLayout, seed: int) -> KVPool:
    """Random raw bytes viewed as the dtype (fp8 NaN patterns included: we compare bytes)."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = layout.part_bytes

    def part() -> torch.Tensor:
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        return raw.view(layout.dtype).reshape(layout.tensor_shape)

    return KVPool(layout, part(), part() if layout.has_v else None)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


def test_staged_chunk_bytes_counts_every_dimension() -> None:
    layout = KVLayout(num_layers=8, num_pages=10, page_size=16, kv_heads=4, head_dim=128,
                      dtype=torch.bfloat16)
    # 2 parts x 3 layers x 5 pages x 16 tokens x 2 heads x (128 x 2 bytes)
    #   = 6 x 5 x 16 x 2 x 256 = 30 x 8192 = 245760
    assert staged_chunk_bytes(layout, num_layers=3, num_pages=5, num_heads=2) == 245_760
    mla = KVLayout(num_layers=8, num_pages=10, page_size=16, kv_heads=1, head_dim=576,
                   dtype=torch.bfloat16, has_v=False)
    # 1 part x 2 layers x 1 page x 16 tokens x 1 head x 1152 bytes = 36864
    assert staged_chunk_bytes(mla, num_layers=2, num_pages=1, num_heads=1) == 36_864


def test_gather_writes_the_documented_layout_element_by_element() -> None:
    """Guards the wire layout [part][layer][page-in-chunk][token][head-in-slice][dim]:
    decode unpacks by this layout, so any reordering would deliver the wrong KV."""
    layout = KVLayout(num_layers=2, num_pages=3, page_size=2, kv_heads=4, head_dim=2,
                      dtype=torch.float32)
    pool = make_arange_pool(layout)  # num_tokens = 6
    out = torch.full((staged_chunk_bytes(layout, 2, 2, 2),), 0xAB, dtype=torch.uint8)
    written = gather(pool, [0, 1], [2, 0], head_start=1, num_heads=2, out=out)
    assert written == 2 * 2 * 2 * 2 * 2 * 2 * 4  # parts*layers*pages*tokens*heads*dim*4B
    # K value = ((layer*6 + token)*4 + head)*2 + dim; heads 1 and 2 of each token.
    # layer 0, page 2 = tokens 4,5: (4*4+1)*2=34.. and (5*4+1)*2=42..
    # layer 0, page 0 = tokens 0,1: (0*4+1)*2=2..  and (1*4+1)*2=10..
    # layer 1, page 2 = tokens 10,11: (10*4+1)*2=82.. and (11*4+1)*2=90..
    # layer 1, page 0 = tokens 6,7: (6*4+1)*2=50.. and (7*4+1)*2=58..
    expected_k = [
        34, 35, 36, 37, 42, 43, 44, 45,
        2, 3, 4, 5, 10, 11, 12, 13,
        82, 83, 84, 85, 90, 91, 92, 93,
        50, 51, 52, 53, 58, 59, 60, 61,
    ]
    expected_v = [value + 1000 for value in expected_k]
    assert out.view(torch.float32).tolist() == [float(x) for x in expected_k + expected_v]


def test_gather_leaves_bytes_past_the_chunk_untouched() -> None:
    layout = KVLayout(num_layers=2, num_pages=3, page_size=2, kv_heads=4, head_dim=2,
                      dtype=torch.float16)
    pool = make_arange_pool(layout)
    needed = staged_chunk_bytes(layout, 1, 1, 1)  # 2 parts x 2 tokens x 2 dims x 2 B = 16
    out = torch.full((needed + 64,), 0xCD, dtype=torch.uint8)
    assert gather(pool, [1], [1], head_start=3, num_heads=1, out=out) == 16
    assert out[16:].eq(0xCD).all()
    # K[1, token 6+2=8, head 3] = ((8)*4+3)*2 = 70, 71 ; token 9: (9*4+3)*2 = 78, 79
    assert out[:8].view(torch.float16).tolist() == [70.0, 71.0, 78.0, 79.0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_bit_exact_and_touches_only_the_slice(dtype: torch.dtype) -> None:
    """Prefill heads [1, 3) of a 4-head pool land at decode heads [0, 2) of a 2-head pool,
    pages in unsorted order, for every dtype; bytes compared, so fp8 needs no arithmetic."""
    src_layout = KVLayout(num_layers=3, num_pages=7, page_size=4, kv_heads=4, head_dim=8,
                          dtype=dtype)
    dst_layout = KVLayout(num_layers=3, num_pages=9, page_size=4, kv_heads=2, head_dim=8,
                          dtype=dtype)
    src = make_random_pool(src_layout, seed=1)
    dst = make_random_pool(dst_layout, seed=2)
    dst_before = [as_bytes(t).clone() for t in dst.tensors()]
    src_pages, dst_pages, layers = [5, 0, 3], [8, 2, 4], [0, 2]
    buffer = torch.empty(staged_chunk_bytes(src_layout, 2, 3, 2), dtype=torch.uint8)
    gather(src, layers, src_pages, head_start=1, num_heads=2, out=buffer)
    scatter(buffer, dst, layers, dst_pages, head_start=0, num_heads=2)

    for part_index, (s, d) in enumerate(zip(src.tensors(), dst.tensors(), strict=True)):
        expected = as_bytes(dst_before[part_index].view(dtype)).clone()
        for layer in layers:
            for sp, dp in zip(src_pages, dst_pages, strict=True):
                s_tok = slice(sp * 4, sp * 4 + 4)
                d_tok = slice(dp * 4, dp * 4 + 4)
                expected[layer, d_tok, 0:2] = as_bytes(s)[layer, s_tok, 1:3]
        assert torch.equal(as_bytes(d), expected)


def test_scatter_at_head_offset_keeps_other_heads_of_the_page() -> None:
    """Two writers (heads [0,1) and [1,2) of a decode rank) fill the same pages in turn:
    the second must not clobber the first."""
    layout = KVLayout(num_layers=1, num_pages=2, page_size=2, kv_heads=2, head_dim=2,
                      dtype=torch.float32)
    dst = KVPool.allocate(layout)
    one_head = KVLayout(num_layers=1, num_pages=2, page_size=2, kv_heads=1, head_dim=2,
                        dtype=torch.float32)
    first = make_arange_pool(one_head)  # K values 0..7 over tokens 0..3
    second = make_arange_pool(one_head, v_offset=0.0)
    buffer = torch.empty(staged_chunk_bytes(one_head, 1, 1, 1), dtype=torch.uint8)
    gather(first, [0], [1], head_start=0, num_heads=1, out=buffer)
    scatter(buffer, dst, [0], [0], head_start=0, num_heads=1)
    gather(second, [0], [0], head_start=0, num_heads=1, out=buffer)
    scatter(buffer, dst, [0], [0], head_start=1, num_heads=1)
    # token 0 of dst: head 0 <- first's token 2 = [4, 5]; head 1 <- second's token 0 = [0, 1]
    # token 1 of dst: head 0 <- first's token 3 = [6, 7]; head 1 <- second's token 1 = [2, 3]
    assert dst.k[0, 0:2].tolist() == [[[4.0, 5.0], [0.0, 1.0]], [[6.0, 7.0], [2.0, 3.0]]]
    assert dst.k[0, 2:4].eq(0).all()  # page 1 untouched


def test_mla_layout_moves_the_latent_only() -> None:
    layout = KVLayout(num_layers=2, num_pages=2, page_size=2, kv_heads=1, head_dim=3,
                      dtype=torch.float32, has_v=False)
    src = make_arange_pool(layout)
    assert src.v is None
    buffer = torch.empty(staged_chunk_bytes(layout, 2, 1, 1), dtype=torch.uint8)
    gather(src, [0, 1], [1], head_start=0, num_heads=1, out=buffer)
    # layer 0 tokens 2,3: values 6..11 ; layer 1 tokens 4+2, 4+3: values 18..23
    assert buffer.view(torch.float32).tolist() == [float(x) for x in [*range(6, 12),
                                                                     *range(18, 24)]]


# torch 2.11 warns that the profiler "clears events at the end of each cycle": harmless here.
@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")
def test_gather_allocates_nothing_the_size_of_the_data() -> None:
    """The gather must write straight into the staging buffer: an intermediate copy would
    double the memory traffic and allocate per chunk on the hot path. The profiler sees every
    CPU allocation; only the small row-index tensor may be allocated."""
    layout = KVLayout(num_layers=4, num_pages=64, page_size=16, kv_heads=8, head_dim=64,
                      dtype=torch.bfloat16)
    pool = make_random_pool(layout, seed=3)
    pages = list(range(0, 64, 3))
    nbytes = staged_chunk_bytes(layout, 4, len(pages), 2)
    out = torch.empty(nbytes, dtype=torch.uint8)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        gather(pool, range(4), pages, head_start=2, num_heads=2, out=out)
        scatter(out, pool, range(4), pages, head_start=2, num_heads=2)
    allocated = sum(max(0, event.cpu_memory_usage) for event in prof.events())
    index_bytes = 4 * len(pages) * 8  # the int64 row index, built once per call
    assert allocated <= 2 * index_bytes + 1024, (allocated, nbytes)
    assert nbytes > 100 * index_bytes  # so the bound above would catch any data copy


def test_bad_arguments_are_rejected_with_the_reason() -> None:
    layout = KVLayout(num_layers=2, num_pages=3, page_size=2, kv_heads=4, head_dim=2,
                      dtype=torch.float32)
    pool = make_arange_pool(layout)
    small = torch.empty(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="chunk needs 64"):
        gather(pool, [0], [0], head_start=0, num_heads=2, out=small)
    big = torch.empty(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not inside the pool's 4 local heads"):
        gather(pool, [0], [0], head_start=3, num_heads=2, out=big)
    with pytest.raises(IndexError, match="page 3 outside"):
        gather(pool, [0], [3], head_start=0, num_heads=1, out=big)
    with pytest.raises(IndexError, match="layer 2 outside"):
        gather(pool, [2], [0], head_start=0, num_heads=1, out=big)
    with pytest.raises(ValueError, match="distinct page ids"):
        scatter(big, pool, [0], [1, 1], head_start=0, num_heads=1)
    with pytest.raises(ValueError, match="1-D uint8"):
        gather(pool, [0], [0], head_start=0, num_heads=1, out=big.view(torch.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("has_v", [True, False], ids=["mha", "mla"])
def test_cuda_paths_match_cpu_bit_exactly(dtype: torch.dtype, has_v: bool) -> None:
    """The fused Triton kernel and the torch CUDA path produce the CPU path's bytes, for
    gather and scatter, with unsorted pages and an odd head size (word-width fallback)."""
    rng = random.Random(7)
    for head_dim, page_size, heads in [(128, 16, 8), (3, 1, 4), (64, 32, 2)]:
        src_layout = KVLayout(num_layers=5, num_pages=40, page_size=page_size,
                              kv_heads=heads, head_dim=head_dim, dtype=dtype, has_v=has_v)
        cpu = make_random_pool(src_layout, seed=head_dim)
        gpu = KVPool(src_layout, cpu.k.cuda(), cpu.v.cuda() if cpu.v is not None else None)
        pages = rng.sample(range(40), 11)
        layers = [4, 1, 2]
        h0, n = (1, heads - 1)
        nbytes = staged_chunk_bytes(src_layout, 3, 11, n)
        ref = torch.empty(nbytes, dtype=torch.uint8)
        gather(cpu, layers, pages, head_start=h0, num_heads=n, out=ref)
        for force_torch in (False, True):
            out = torch.zeros(nbytes + 256, dtype=torch.uint8, device="cuda")
            gather(gpu, layers, pages, head_start=h0, num_heads=n, out=out,
                   force_torch=force_torch)
            assert torch.equal(out[:nbytes].cpu(), ref)

            dst_cpu = make_random_pool(src_layout, seed=99)
            dst_gpu = KVPool(src_layout, dst_cpu.k.cuda(),
                             dst_cpu.v.cuda() if dst_cpu.v is not None else None)
            dst_pages = rng.sample(range(40), 11)
            scatter(ref, dst_cpu, layers, dst_pages, head_start=h0, num_heads=n)
            scatter(out, dst_gpu, layers, dst_pages, head_start=h0, num_heads=n,
                    force_torch=force_torch)
            for c, g in zip(dst_cpu.tensors(), dst_gpu.tensors(), strict=True):
                assert torch.equal(as_bytes(g).cpu(), as_bytes(c))


@pytest.mark.gpu
def test_triton_is_used_on_cuda_when_available() -> None:
    """Guards against silently benchmarking the torch fallback on the GPU machine."""
    pytest.importorskip("triton")
    assert staging.TRITON_AVAILABLE


@pytest.mark.gpu
@pytest.mark.parametrize(("page_format", "packing"),
                         [(PageFormat.HND, KVPacking.PER_HEAD), (PageFormat.NHD,
                                                                 KVPacking.SEPARATE),
                          (PageFormat.HND, KVPacking.SEPARATE)],
                         ids=["cpu-per-head", "flash-nhd", "hnd"])
def test_cuda_per_layer_pools_match_cpu_bit_exactly(page_format: PageFormat,
                                                    packing: KVPacking) -> None:
    """Per-layer pools (vLLM-shaped tensors) on CUDA: gather and scatter produce the CPU
    path's bytes; registration tensors alias the CUDA memory."""
    rng = random.Random(3)
    layout = KVLayout(num_layers=4, num_pages=30, page_size=16, kv_heads=4, head_dim=64,
                      dtype=torch.bfloat16, page_format=page_format, packing=packing)

    def pools(seed: int) -> tuple[KVPool, KVPool]:
        cpu, gpu = KVPool.allocate_per_layer(layout), KVPool.allocate_per_layer(layout, "cuda")
        gen = torch.Generator().manual_seed(seed)
        for layer in range(layout.num_layers):
            for part in layout.parts:
                raw = torch.randint(0, 256, (layout.layer_bytes,), dtype=torch.uint8,
                                    generator=gen)
                cpu.page_bytes(part, layer).view(-1).copy_(raw)
                gpu.page_bytes(part, layer).view(-1).copy_(raw.cuda())
        return cpu, gpu

    src_cpu, src_gpu = pools(1)
    dst_cpu, dst_gpu = pools(2)
    for item, tensor in zip(src_gpu.registration_ranges(), src_gpu.registration_tensors(),
                            strict=True):
        assert tensor.is_cuda and (tensor.data_ptr(), tensor.numel()) == (item.address,
                                                                            item.length_bytes)
    layers, pages, dst_pages = [3, 0, 2], rng.sample(range(30), 9), rng.sample(range(30), 9)
    nbytes = staged_chunk_bytes(layout, 3, 9, 2)
    ref = torch.empty(nbytes, dtype=torch.uint8)
    gather(src_cpu, layers, pages, head_start=1, num_heads=2, out=ref)
    out = torch.zeros(nbytes + 64, dtype=torch.uint8, device="cuda")
    assert gather(src_gpu, layers, pages, head_start=1, num_heads=2, out=out) == nbytes
    assert torch.equal(out[:nbytes].cpu(), ref)
    scatter(ref, dst_cpu, layers, dst_pages, head_start=2, num_heads=2)
    scatter(out, dst_gpu, layers, dst_pages, head_start=2, num_heads=2)
    for layer in range(layout.num_layers):
        for part in layout.parts:
            assert torch.equal(dst_gpu.page_bytes(part, layer).cpu(),
                               dst_cpu.page_bytes(part, layer))


def test_prepared_page_ids_move_the_same_bytes_as_a_list() -> None:
    """The worker's per-request ``PageIds`` (checked and uploaded once) and a part's
    ``select`` of them must address exactly the pages a plain list names."""
    layout = KVLayout(num_layers=3, num_pages=20, page_size=4, kv_heads=4, head_dim=8,
                      dtype=torch.bfloat16)
    pool = make_random_pool(layout, seed=5)
    request = [17, 3, 9, 0, 12, 6]
    ids = staging.prepare_pages(pool, request)
    part = ids.select(1, 5)  # request pages 1..4 -> pool pages 3, 9, 0, 12
    assert part.host.tolist() == [3, 9, 0, 12] and part.device.tolist() == [3, 9, 0, 12]
    nbytes = staged_chunk_bytes(layout, 2, 4, 2)
    by_list, by_ids = (torch.empty(nbytes, dtype=torch.uint8) for _ in range(2))
    gather(pool, [1, 2], [3, 9, 0, 12], head_start=1, num_heads=2, out=by_list)
    gather(pool, range(1, 3), part, head_start=1, num_heads=2, out=by_ids)
    assert torch.equal(by_list, by_ids)
    twin = KVPool(layout, pool.k.clone(), pool.v.clone() if pool.v is not None else None)
    scatter(by_list, pool, [1, 2], [3, 9, 0, 12], head_start=0, num_heads=2)
    scatter(by_ids, twin, range(1, 3), part, head_start=0, num_heads=2)
    assert all(torch.equal(as_bytes(a), as_bytes(b))
               for a, b in zip(pool.tensors(), twin.tensors(), strict=True))


def test_prepared_page_ids_are_checked_once_against_their_pool() -> None:
    layout = KVLayout(num_layers=2, num_pages=8, page_size=2, kv_heads=2, head_dim=2,
                      dtype=torch.float32)
    pool = make_arange_pool(layout)
    with pytest.raises(IndexError, match="page 8 outside the pool's"):
        staging.prepare_pages(pool, [1, 8])
    repeated = staging.prepare_pages(pool, [1, 1])
    big = torch.empty(4096, dtype=torch.uint8)
    gather(pool, range(2), repeated, head_start=0, num_heads=1, out=big)  # reading twice: fine
    with pytest.raises(ValueError, match="distinct page ids"):
        scatter(big, pool, range(2), repeated, head_start=0, num_heads=1)
    with pytest.raises(IndexError, match="layer 2 outside"):
        gather(pool, range(1, 3), staging.prepare_pages(pool, [0]), head_start=0, num_heads=1,
               out=big)
    other = KVPool.allocate(KVLayout(num_layers=2, num_pages=9, page_size=2, kv_heads=2,
                                     head_dim=2, dtype=torch.float32))
    with pytest.raises(ValueError, match="pool of 8 pages"):
        gather(other, range(2), staging.prepare_pages(pool, [0]), head_start=0, num_heads=1,
               out=big)
    with pytest.raises(IndexError, match=r"\[2, 5\) outside \[0, 4\)"):
        staging.prepare_pages(pool, [0, 1, 2, 3]).select(2, 5)


@pytest.mark.gpu
def test_repeated_cuda_launches_stay_bit_exact() -> None:
    """After its first launch a specialisation is launched through the compiled kernel's own
    launcher (no Triton binding per call): later chunks of the same shape, on other pages and
    at other buffer offsets, must still move exactly the CPU path's bytes."""
    pytest.importorskip("triton")
    from pd_transfer.kv import staging_kernel  # noqa: PLC0415 - needs Triton

    rng = random.Random(11)
    layout = KVLayout(num_layers=4, num_pages=64, page_size=16, kv_heads=4, head_dim=128,
                      dtype=torch.bfloat16)
    cpu = make_random_pool(layout, seed=21)
    gpu = KVPool(layout, cpu.k.cuda(), cpu.v.cuda() if cpu.v is not None else None)
    nbytes = staged_chunk_bytes(layout, 3, 10, 2)
    out = torch.zeros(4 * nbytes, dtype=torch.uint8, device="cuda")
    before = len(staging_kernel._COMPILED)
    for i in range(4):
        pages = rng.sample(range(64), 10)
        ids = staging.prepare_pages(gpu, pages)
        region = out[i * nbytes:(i + 1) * nbytes]
        gather(gpu, range(1, 4), ids, head_start=2, num_heads=2, out=region)
        ref = torch.empty(nbytes, dtype=torch.uint8)
        gather(cpu, [1, 2, 3], pages, head_start=2, num_heads=2, out=ref)
        assert torch.equal(region.cpu(), ref), i
        dst_cpu = make_random_pool(layout, seed=i)
        dst = KVPool(layout, dst_cpu.k.cuda(), dst_cpu.v.cuda() if dst_cpu.v is not None else None)
        scatter(ref, dst_cpu, [1, 2, 3], pages, head_start=0, num_heads=2)
        scatter(region, dst, range(1, 4), ids, head_start=0, num_heads=2)
        assert all(torch.equal(as_bytes(g).cpu(), as_bytes(c))
                   for g, c in zip(dst.tensors(), dst_cpu.tensors(), strict=True)), i
    assert len(staging_kernel._COMPILED) - before <= 2  # one gather, one scatter key


@pytest.mark.gpu(devices=2)
def test_a_pool_on_another_device_than_the_current_one() -> None:
    """A decode rank's pool on cuda:1 while the calling thread's current device is cuda:0
    (a worker thread never set one): repeated launches must still reach the pool's device
    (the compiled kernel's own launcher checks pointers in the current context)."""
    pytest.importorskip("triton")
    layout = KVLayout(num_layers=2, num_pages=16, page_size=16, kv_heads=2, head_dim=128,
                      dtype=torch.bfloat16)
    cpu = make_random_pool(layout, seed=31)
    gpu = KVPool(layout, cpu.k.to("cuda:1"), cpu.v.to("cuda:1") if cpu.v is not None else None)
    torch.cuda.set_device(0)
    nbytes = staged_chunk_bytes(layout, 2, 4, 1)
    for pages in ([3, 1, 7, 0], [9, 4, 12, 2]):
        out = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:1")
        gather(gpu, range(2), staging.prepare_pages(gpu, pages), head_start=1, num_heads=1,
               out=out)
        ref = torch.empty(nbytes, dtype=torch.uint8)
        gather(cpu, [0, 1], pages, head_start=1, num_heads=1, out=ref)
        assert torch.equal(out.cpu(), ref)
