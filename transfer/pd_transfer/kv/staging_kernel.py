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

Host cost: the chunk's layer and page ids come as device tensors (``staging.PageIds``), so a
launch does no per-page work. Triton's launcher binds and specialises every argument on
each call (~15-25 µs on an H100 host); ``Launch.run`` keeps the compiled kernel of each
specialisation and calls its launcher directly after the first launch (~10 µs). The cache key
is finer than Triton's own: every pointer's 16-byte alignment, every integer's 32-bit range,
equality to 1 and divisibility by 16, the constexprs, the word type, warps and the device.
The page count, layer count and pool page count vary per request and are not specialised
(``do_not_specialize``), so a new request size never compiles a new kernel.
"""

import contextlib
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton  # type: ignore[import-not-found,unused-ignore]
import triton.language as tl  # type: ignore[import-not-found,unused-ignore]

from pd_transfer.kv.pool import KVPool

__all__ = ["Launch", "plan"]

#: Bytes one program moves (a tile of token rows); 16 KiB keeps several programs resident
#: per SM and thousands in flight from 1K-token chunks up (tuned on an H100, see
#: benchmarks/staging_gpu.py).
TILE_BYTES = 16384
#: Widest column block (words) of one tile; wider rows loop over column blocks.
MAX_BLOCK_C = 1024
NUM_WARPS = 4
_COMPILED: dict[tuple[Any, ...], Any] = {}  # specialisation key -> Triton CompiledKernel


# Triton is untyped, and its kernels must stay unannotated (see the module docstring).
@triton.jit(do_not_specialize=["pool_pages", "chunk_pages", "chunk_layers"])  # type: ignore[untyped-decorator,misc,unused-ignore]
def staging_kernel(  # type: ignore[no-untyped-def]  # noqa: PLR0917
    k_ptr,
    v_ptr,
    staged_ptr,
    layers_ptr,
    pages_ptr,
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
    # layers_ptr / pages_ptr: the chunk's layer and page ids (int64).
    block = tl.program_id(0)
    layer_index = tl.program_id(1)
    part = tl.program_id(2)
    chunk_tokens = chunk_pages * PAGE_SIZE
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)  # token rows of this layer's chunk
    row_mask = rows < chunk_tokens
    page_index = rows // PAGE_SIZE
    if EVEN_ROWS:
        page = tl.load(pages_ptr + page_index)
    else:
        page = tl.load(pages_ptr + page_index, mask=row_mask, other=0)
    layer = tl.load(layers_ptr + layer_index)
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


_WORDS = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2))


def _word(head_bytes: int, addresses: Sequence[int]) -> tuple[torch.dtype, int]:
    """Widest integer word dividing a head's bytes and every base address."""
    for dtype, size in _WORDS:
        if head_bytes % size == 0 and all(address % size == 0 for address in addresses):
            return dtype, size
    return torch.uint8, 1


def _next_power_of_2(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


def _int_spec(value: int) -> tuple[bool, bool, bool]:
    """What Triton specialises an integer argument on: 1, divisible by 16, 32-bit."""
    return value == 1, value % 16 == 0, -(1 << 31) <= value < (1 << 31)


class _PoolWords:
    """A stacked pool's K and V viewed as integer words, per word type, made once per pool
    (views are cheap, but a launch is counted in microseconds), with the pool's constants."""

    def __init__(self, pool: KVPool) -> None:
        parts = pool.tensors()
        layout = pool.layout
        self.k, self.v = parts[0], parts[-1]  # MLA: K twice (V is never read)
        self.addresses = (self.k.data_ptr(), self.v.data_ptr())
        self.head_bytes = layout.bytes_per_token_per_head
        self.num_parts = len(parts)
        self.device = self.k.device.index
        self._views: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def views(self, word: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        views = self._views.get(word)
        if views is None:
            views = (self.k.view(torch.uint8).view(word), self.v.view(torch.uint8).view(word))
            self._views[word] = views
        return views


# A pool -> its words (dropped with the pool; the views keep only its tensors alive).
_POOL_WORDS: weakref.WeakKeyDictionary[KVPool, _PoolWords] = weakref.WeakKeyDictionary()


def _words_of(pool: KVPool) -> _PoolWords:
    words = _POOL_WORDS.get(pool)
    if words is None:
        words = _PoolWords(pool)
        _POOL_WORDS[pool] = words
    return words


@dataclass(frozen=True, eq=False)
class Launch:
    """One kernel launch with its arguments bound and its specialisation known (``plan``):
    ``run`` enqueues it; ``compiled`` says whether that costs a compilation first."""

    device: int
    grid: tuple[int, int, int]
    tensors: tuple[torch.Tensor, ...]
    ints: tuple[int, ...]
    constexprs: tuple[Any, ...]
    key: tuple[Any, ...]
    num_warps: int

    @property
    def compiled(self) -> bool:
        return self.key in _COMPILED

    def run(self, stream: torch.cuda.Stream | None = None) -> None:
        kernel = _COMPILED.get(self.key) if _DIRECT_LAUNCH and not _launch_hooks() else None
        # Either launcher checks the pointers in the current device's context: a pool on
        # cuda:1 needs cuda:1 current (the endpoints' worker makes it so once:
        # Endpoint.thread_started).
        device = self.device
        grid = self.grid
        with (contextlib.nullcontext() if torch.cuda.current_device() == device
              else torch.cuda.device(device)):
            if kernel is None:  # Triton's own launch: binds, compiles if new, launches
                page_size, row, rows, cols, even, scatter_ = self.constexprs
                with (torch.cuda.stream(stream) if stream is not None
                      else contextlib.nullcontext()):
                    _COMPILED[self.key] = staging_kernel[grid](
                        *self.tensors, *self.ints, PAGE_SIZE=page_size, ROW_WORDS=row,
                        BLOCK_R=rows, BLOCK_C=cols, EVEN_ROWS=even, SCATTER=scatter_,
                        num_warps=self.num_warps)
                return
            # The compiled kernel's launcher takes every parameter in order, constexprs too.
            handle = (stream or torch.cuda.current_stream(self.tensors[2].device)).cuda_stream
            kernel.run(grid[0], grid[1], grid[2], handle, kernel.function,
                       kernel.packed_metadata, None, None, None, *self.tensors, *self.ints,
                       *self.constexprs)


def plan(
    pool: KVPool,
    layers: torch.Tensor,
    pages: torch.Tensor,
    *,
    head_start: int,
    num_heads: int,
    staged: torch.Tensor,
    scatter: bool,
    tile_bytes: int = TILE_BYTES,
    num_warps: int = NUM_WARPS,
) -> Launch:
    """One kernel launch on a chunk, bound for ``Launch.run``; arguments already validated
    by staging.

    ``layers`` and ``pages`` are int64 tensors on the staging buffer's device holding the
    chunk's layer ids and page ids; the chunk is written from (scatter: read from) the start
    of ``staged``, which may be longer. ``tile_bytes`` and ``num_warps`` exist for the
    benchmark's tuning sweep.
    """
    layout = pool.layout
    words = _words_of(pool)
    staged_address = staged.data_ptr()
    word_dtype, word_bytes = _word(words.head_bytes, (*words.addresses, staged_address))
    pool_k, pool_v = words.views(word_dtype)
    head_words = words.head_bytes // word_bytes
    row_words = num_heads * head_words
    block_c = min(_next_power_of_2(row_words), MAX_BLOCK_C)
    block_r = _next_power_of_2(max(1, tile_bytes // (block_c * word_bytes)))
    num_pages, num_layers = pages.numel(), layers.numel()
    chunk_tokens = num_pages * layout.page_size
    block_r = min(block_r, _next_power_of_2(chunk_tokens))
    grid = (triton.cdiv(chunk_tokens, block_r), num_layers, words.num_parts)
    tensors = (pool_k, pool_v, staged.view(word_dtype), layers, pages)
    ints = (layout.num_pages, num_pages, num_layers, layout.kv_heads * head_words,
            head_start * head_words)
    constexprs = (layout.page_size, row_words, block_r, block_c, chunk_tokens % block_r == 0,
                  scatter)
    key = (words.device, word_dtype, num_warps, constexprs,
           words.addresses[0] % 16 == 0, words.addresses[1] % 16 == 0,
           staged_address % 16 == 0, layers.data_ptr() % 16 == 0, pages.data_ptr() % 16 == 0,
           *map(_int_spec, ints))
    return Launch(words.device, grid, tensors, ints, constexprs, key, num_warps)


#: The direct launch relies on Triton's CompiledKernel.run signature, checked on 3.6.
_DIRECT_LAUNCH = triton.__version__.split(".")[:2] == ["3", "6"]


def _launch_hooks() -> bool:
    """Whether a launch hook is registered (a profiler): then Triton's own launch path runs.
    Triton 3.6 keeps them as chains (never None), each with its list of ``calls``."""
    runtime = triton.knobs.runtime
    return bool(runtime.launch_enter_hook.calls or runtime.launch_exit_hook.calls)
