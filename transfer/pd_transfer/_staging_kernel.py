"""The fused Triton kernel behind ``staging.gather``/``staging.scatter`` on CUDA.

Importing this module raises ImportError when Triton is missing; ``staging`` catches that
and takes the torch path. No ``from __future__ import annotations`` here: Triton reads the
``tl.constexpr`` annotations at decoration time. Kernel parameters other than constexprs
are deliberately unannotated (Triton would treat annotations as type specialisations).

One launch moves every part (K and V), layer and page of a chunk: grid (pages, layers,
parts), one program per page of one layer of one part. Data moves as integer words, the
widest of 8/4/2/1 bytes that divides a head's bytes and every base address, so every dtype
(fp8 included) is copied bit-exactly and no arithmetic touches the values.
"""

from collections.abc import Sequence

import torch
import triton  # type: ignore[import-not-found,unused-ignore]
import triton.language as tl  # type: ignore[import-not-found,unused-ignore]

from pd_transfer.layout import KVLayout

__all__ = ["launch"]

_TILE_WORDS = 2048


# Triton is untyped, and its kernels must stay unannotated (see the module docstring).
@triton.jit  # type: ignore[untyped-decorator,misc,unused-ignore]
def _staging_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    k_ptr,
    v_ptr,
    staged_ptr,
    layer_ptr,
    page_ptr,
    pool_pages,
    chunk_pages,
    chunk_layers,
    token_words,
    head_start_words,
    row_words,
    PAGE_SIZE: tl.constexpr,  # noqa: N803 - Triton constexpr convention
    BLOCK_T: tl.constexpr,  # noqa: N803
    BLOCK_C: tl.constexpr,  # noqa: N803
    SCATTER: tl.constexpr,  # noqa: N803
):
    # All offsets in int64 words: pools over 2 GiB must address correctly.
    page_index = tl.program_id(0)
    layer_index = tl.program_id(1)
    part = tl.program_id(2)
    page = tl.load(page_ptr + page_index).to(tl.int64)
    layer = tl.load(layer_ptr + layer_index).to(tl.int64)
    pool_base = (layer * pool_pages + page) * PAGE_SIZE * token_words + head_start_words
    staged_row = (part * chunk_layers + layer_index).to(tl.int64) * chunk_pages + page_index
    staged_base = staged_row * PAGE_SIZE * row_words
    # A runtime branch (program_id is not constexpr): keep the if/else Triton lowers.
    if part == 0:  # noqa: SIM108
        part_ptr = k_ptr
    else:
        part_ptr = v_ptr
    for t0 in range(0, PAGE_SIZE, BLOCK_T):
        tokens = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        for c0 in range(0, row_words, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = (tokens[:, None] < PAGE_SIZE) & (cols[None, :] < row_words)
            pool_offsets = pool_base + tokens[:, None] * token_words + cols[None, :]
            staged_offsets = staged_base + tokens[:, None] * row_words + cols[None, :]
            if SCATTER:
                values = tl.load(staged_ptr + staged_offsets, mask=mask)
                tl.store(part_ptr + pool_offsets, values, mask=mask)
            else:
                values = tl.load(part_ptr + pool_offsets, mask=mask)
                tl.store(staged_ptr + staged_offsets, values, mask=mask)


def _word(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> tuple[torch.dtype, int]:
    """Widest integer word dividing a head's bytes and every base address."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if layout.bytes_per_token_per_head % size == 0 and all(
            t.data_ptr() % size == 0 for t in tensors
        ):
            return dtype, size
    return torch.uint8, 1


def _next_power_of_2(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


def launch(
    parts: Sequence[torch.Tensor],
    layout: KVLayout,
    layers: Sequence[int],
    pages: Sequence[int],
    *,
    head_start: int,
    num_heads: int,
    staged: torch.Tensor,
    scatter: bool,
) -> None:
    """Enqueue one kernel on the current stream; arguments already validated by staging."""
    word_dtype, word_bytes = _word(layout, (*parts, staged))
    head_words = layout.bytes_per_token_per_head // word_bytes
    as_words = [t.view(torch.uint8).view(word_dtype) for t in parts]
    device = staged.device
    row_words = num_heads * head_words
    block_c = min(_next_power_of_2(row_words), _TILE_WORDS)
    block_t = max(1, min(_next_power_of_2(layout.page_size), _TILE_WORDS // block_c))
    _staging_kernel[(len(pages), len(layers), len(parts))](
        as_words[0],
        as_words[-1],  # V, or K again for MLA (never read: the grid has one part)
        staged.view(word_dtype),
        torch.tensor(list(layers), dtype=torch.int64, device=device),
        torch.tensor(list(pages), dtype=torch.int64, device=device),
        layout.num_pages,
        len(pages),
        len(layers),
        layout.kv_heads * head_words,
        head_start * head_words,
        row_words,
        PAGE_SIZE=layout.page_size,
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        SCATTER=scatter,
        num_warps=4,
    )
