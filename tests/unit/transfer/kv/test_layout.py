"""KV pool geometry, views and byte addresses. Unit tests: no NIXL, no GPU."""

from __future__ import annotations

import pytest
import torch

from pd_transfer.kv.layout import ByteRange, KVLayout, KVPart, PageRun, compute_page_runs
from pd_transfer.kv.pool import KVPool


def small_layout(dtype: torch.dtype = torch.bfloat16) -> KVLayout:
    return KVLayout(num_layers=3, num_pages=5, page_size=4, kv_heads=2, head_dim=8, dtype=dtype)


def test_derived_sizes_in_bytes() -> None:
    layout = small_layout()
    assert layout.element_size_bytes == 2
    assert layout.bytes_per_token_per_head == 16  # 8 dims x 2 B
    assert layout.bytes_per_token_per_layer == 32  # 2 heads x 16
    assert layout.page_bytes_per_layer == 128  # 4 tokens x 32
    assert layout.layer_bytes == 640  # 5 pages x 128
    assert layout.part_bytes == 1920  # 3 layers x 640
    assert layout.total_kv_bytes == 3840  # K and V
    assert layout.tensor_shape == (3, 20, 2, 8)
    fp8 = small_layout(torch.float8_e4m3fn)
    assert fp8.page_bytes_per_layer == 64  # 4 tokens x 2 heads x 8 dims x 1 B
    mla = KVLayout(3, 5, 4, 1, 576, torch.bfloat16, has_v=False)
    assert mla.parts == (KVPart.K,) and mla.total_kv_bytes == mla.part_bytes


def test_invalid_layout_is_rejected() -> None:
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        KVLayout(3, 5, 0, 2, 8, torch.bfloat16)


def test_per_layer_views_are_contiguous_and_alias_the_pool() -> None:
    pool = KVPool.allocate(small_layout(torch.float32))
    view = pool.layer_v(1)
    assert view.shape == (20, 2, 8) and view.is_contiguous()
    view[7, 1, 3] = 42.0
    assert pool.v is not None and pool.v[1, 7, 1, 3] == 42.0
    assert pool.layer_k(2).data_ptr() == pool.k.data_ptr() + 2 * 640 * 2  # fp32: 1280 B/layer
    with pytest.raises(IndexError, match="layer 3 outside"):
        pool.layer_k(3)


def test_pages_to_tokens_keeps_page_order() -> None:
    pool = KVPool.allocate(small_layout())
    # page p covers tokens [4p, 4p+4): pages 3, 0 -> 12..15, 0..3
    assert pool.pages_to_tokens([3, 0]).tolist() == [12, 13, 14, 15, 0, 1, 2, 3]
    with pytest.raises(IndexError, match=r"page ids must lie in \[0, 5\)"):
        pool.pages_to_tokens([5])


def test_byte_addresses_of_pages_and_runs() -> None:
    pool = KVPool.allocate(small_layout())
    base = pool.tensor(KVPart.V).data_ptr()
    # layer 2, page 3 of V: 2 x 640 + 3 x 128 = 1664 bytes in, 128 long
    assert pool.page_address(KVPart.V, 2, 3) == ByteRange(base + 1664, 128)
    # pages 1..3 of layer 1 of K: 640 + 128 in, 3 x 128 long
    assert pool.page_run_address(KVPart.K, 1, PageRun(1, 3)) == ByteRange(
        pool.k.data_ptr() + 768, 384
    )
    with pytest.raises(IndexError, match="page 5 outside"):
        pool.page_run_address(KVPart.K, 0, PageRun(3, 3))
    assert pool.region(KVPart.K) == ByteRange(pool.k.data_ptr(), 1920)
    # the address matches what torch sees for that page
    page = pool.layer_v(2)[12:16]
    assert page.data_ptr() == base + 1664


def test_page_runs_coalesce_neighbours_in_given_order() -> None:
    assert compute_page_runs([4, 5, 6, 9, 2, 3, 10]) == (
        PageRun(4, 3), PageRun(9, 1), PageRun(2, 2), PageRun(10, 1),
    )
    assert compute_page_runs([]) == ()


def test_wrapping_checks_shape_dtype_contiguity_and_v() -> None:
    layout = small_layout()
    k = torch.zeros(layout.tensor_shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs"):
        KVPool(layout, k[:, :10], k)
    with pytest.raises(ValueError, match="dtype"):
        KVPool(layout, k.float(), k)
    with pytest.raises(ValueError, match="contiguous"):
        KVPool(layout, k.transpose(2, 3).contiguous().transpose(2, 3), k)
    with pytest.raises(ValueError, match="no V tensor was given"):
        KVPool(layout, k, None)
    mla = KVLayout(3, 5, 4, 2, 8, torch.bfloat16, has_v=False)
    with pytest.raises(ValueError, match="has no V"):
        KVPool(mla, k, k)
    with pytest.raises(ValueError, match="no V pool"):
        KVPool(mla, k, None).tensor(KVPart.V)
