"""The fused Triton kernel behind ``staging.gather``/``staging.scatter`` on CUDA.

Importing this module raises ImportError when Triton is missing; ``staging`` catches that
and takes the torch path. No ``from __future__ import annotations`` here: Triton reads the
``tl.constexpr`` annotations at decoration time. Kernel parameters other than constexprs
are deliberately unannotated (Triton would treat annotations as type specialisations).

One launch moves every part (K and V), layer and page of a chunk. The unit of work is a
token row: the head slice of one token of one layer of one part, ``num_heads * head_bytes``
contiguous bytes in the pool (at a stride of the pool's whole token row) and contiguous in
the staging buffer, where consecutive rows of a layer follow each other. Grid
``(row_blocks, layers, parts)``: each program moves ``BLOCK_R`` consecutive token rows
(spanning pages: a page boundary only changes the source address) of one layer of one part,
about 16 KiB, as a ``[BLOCK_R, row_words]`` tile of integer words. Data moves as the widest
of 8/4/2/1-byte words that divides a head's bytes and every base address, so every dtype
(fp8 included) is copied bit-exactly and no arithmetic touches the values; where the head
offset and strides are multiples of 16 bytes (Triton specialises integer arguments divisible
by 16), the loads and stores compile to 16-byte vector accesses. Offsets are int64 words.
"""

from collections.abc import Sequence

import torch
import triton  # type: ignore[import-not-found,unused-ignore]
import triton.language as tl  # type: ignore[import-not-found,unused-ignore]

from pd_transfer.layout import KVLayout

__all__ = ["launch"]

#: Bytes one program moves (a tile of token rows); 16 KiB keeps several programs resident
#: per SM and thousands in flight from 1K-token chunks up (tuned on an H100, see
#: benchmarks/staging_gpu.py).
TILE_BYTES = 16384
#: Widest column block (words) of one tile; wider rows loop over column blocks.
MAX_BLOCK_C = 1024
NUM_WARPS = 4


# Triton is untyped, and its kernels must stay unannotated (see the module docstring).
@triton.jit  # type: ignore[untyped-decorator,misc,unused-ignore]
def _staging_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    k_ptr,
    v_ptr,
    staged_ptr,
    index_ptr,
    pool_pages,
    chunk_pages,
    chunk_layers,
    token_words,
    head_start_words,
    PAGE_SIZE: tl.constexpr,  # noqa: N803 - Triton constexpr convention
    ROW_WORDS: tl.constexpr,  # noqa: N803
    BLOCK_R: tl.constexpr,  # noqa: N803
    BLOCK_C: tl.constexpr,  # noqa: N803
    EVEN_ROWS: tl.constexpr,  # noqa: N803
    SCATTER: tl.constexpr,  # noqa: N803
):
    # index_ptr holds the chunk's layers, then its pages (int64).
    block = tl.program_id(0)
    layer_index = tl.program_id(1)
    part = tl.program_id(2)
    chunk_tokens = chunk_pages * PAGE_SIZE
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)  # token rows of this layer's chunk
    row_mask = rows < chunk_tokens
    page_index = rows // PAGE_SIZE
    if EVEN_ROWS:
        page = tl.load(index_ptr + chunk_layers + page_index)
    else:
        page = tl.load(index_ptr + chunk_layers + page_index, mask=row_mask, other=0)
    layer = tl.load(index_ptr + layer_index)
    token = (rows - page_index * PAGE_SIZE).to(tl.int64)
    pool_rows = (layer * pool_pages + page) * PAGE_SIZE + token
    pool_base = pool_rows * token_words + head_start_words
    staged_rows = (part * chunk_layers + layer_index).to(tl.int64) * chunk_tokens + rows
    staged_base = staged_rows * ROW_WORDS
    # A runtime branch (program_id is not constexpr): keep the if/else Triton lowers.
    if part == 0:  # noqa: SIM108
        part_ptr = k_ptr
    else:
        part_ptr = v_ptr
    for c0 in tl.static_range(0, ROW_WORDS, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        pool_offsets = pool_base[:, None] + cols[None, :]
        staged_offsets = staged_base[:, None] + cols[None, :]
        if EVEN_ROWS and ROW_WORDS % BLOCK_C == 0:
            if SCATTER:
                tl.store(part_ptr + pool_offsets, tl.load(staged_ptr + staged_offsets))
            else:
                tl.store(staged_ptr + staged_offsets, tl.load(part_ptr + pool_offsets))
        else:
            mask = row_mask[:, None] & (cols[None, :] < ROW_WORDS)
            if SCATTER:
                values = tl.load(staged_ptr + staged_offsets, mask=mask)
                tl.store(part_ptr + pool_offsets, values, mask=mask)
            else:
                values = tl.load(part_ptr + pool_offsets, mask=mask)
                tl.store(staged_ptr + staged_offsets, values, mask=mask)


def _word(head_bytes: int, tensors: Sequence[torch.Tensor]) -> tuple[torch.dtype, int]:
    """Widest integer word dividing a head's bytes and every base address."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if head_bytes % size == 0 and all(
            t.data_ptr() % size == 0 for t in tensors
        ):
            return dtype, size
    return torch.uint8, 1


def _next_power_of_2(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


def launch(
    parts: Sequence[torch.Tensor],
    layout: KVLayout,
    index: torch.Tensor,
    num_layers: int,
    num_pages: int,
    *,
    head_start: int,
    num_heads: int,
    staged: torch.Tensor,
    scatter: bool,
    tile_bytes: int = TILE_BYTES,
    num_warps: int = NUM_WARPS,
) -> None:
    """Enqueue one kernel on the current stream; arguments already validated by staging.

    ``index`` is an int64 tensor on the staging buffer's device holding the chunk's
    ``num_layers`` layer ids, then its ``num_pages`` page ids. ``tile_bytes`` and
    ``num_warps`` exist for the benchmark's tuning sweep.
    """
    head_bytes = layout.head_dim * layout.dtype.itemsize  # the property allocates a tensor
    word_dtype, word_bytes = _word(head_bytes, (*parts, staged))
    head_words = head_bytes // word_bytes
    as_words = [t.view(torch.uint8).view(word_dtype) for t in parts]
    row_words = num_heads * head_words
    block_c = min(_next_power_of_2(row_words), MAX_BLOCK_C)
    block_r = _next_power_of_2(max(1, tile_bytes // (block_c * word_bytes)))
    chunk_tokens = num_pages * layout.page_size
    block_r = min(block_r, _next_power_of_2(chunk_tokens))
    grid = (triton.cdiv(chunk_tokens, block_r), num_layers, len(parts))
    _staging_kernel[grid](
        as_words[0],
        as_words[-1],  # V, or K again for MLA (never read: the grid has one part)
        staged.view(word_dtype),
        index,
        layout.num_pages,
        num_pages,
        num_layers,
        layout.kv_heads * head_words,
        head_start * head_words,
        PAGE_SIZE=layout.page_size,
        ROW_WORDS=row_words,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        EVEN_ROWS=chunk_tokens % block_r == 0,
        SCATTER=scatter,
        num_warps=num_warps,
    )
