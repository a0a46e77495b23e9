"""Gather a chunk's head slice out of the paged KV pool into one contiguous buffer, and back.

A head slice of a page is not contiguous in the pool in general (see ``layout``: a page of
one part is the byte array ``[a, kv_heads, b]``), so a prefill rank sending a subset of its
heads first packs them, for every layer of the chunk, into one staging buffer that travels
as a single bulk WRITE; the decode rank unpacks it into its own pages at its own head offset.

Staging buffer layout for one chunk of one (prefill rank → decode rank) pair: raw bytes, a
C-contiguous array of shape::

    [num_parts][num_layers][num_pages][a][num_heads][b]

with ``(a, b) = layout.page_view``: ``(page_size, head_bytes)`` for NHD pages (so the buffer
is ``[parts][layers][pages][page_size][heads][head_dim * element_size]``), ``(1, page_size
* head_bytes)`` for HND, ``(1, 2 * page_size * head_bytes)`` for HND with PER_HEAD packing.

- parts follow ``layout.parts``: K then V (MLA: K only; PER_HEAD: the one packed KV part);
- layer ``i`` is ``layers[i]`` (an index into the pool's local layers), in the given order;
- page ``j`` is ``page_ids[j]``, in the given order (ids need not be sorted or contiguous);
- heads are the pool's local heads ``[head_start, head_start + num_heads)``;
- ``b`` is raw bytes of one head within one row of the page, so any dtype (bf16, fp16,
  fp32, fp8) moves bit-exactly and fp8 needs no arithmetic.

Both sides of a transfer have the same page format and packing (a geometry field, checked
at the handshake), so the buffer means the same thing to both. Its size is
``staged_chunk_bytes``.

Stacked pools: on CPU, and on CUDA when Triton is missing or ``force_torch`` is set, each
part is one ``index_select(out=...)`` (gather) or ``index_copy_`` (scatter) over a ``[layers
* pages, page_size, heads, bytes]`` byte view of the pool: one op per part across every
layer; on CUDA with Triton, one fused kernel launch moves K and V for every layer and page.
Per-layer pools: one ``index_select``/``index_copy_`` per (layer, part) over that layer's
``[num_pages, a, heads, b]`` byte view. Either way data is read and written in place with no
intermediate copy (only the small index tensor is allocated).
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch

from pd_transfer.layout import KVLayout, KVPool

__all__ = [
    "TRITON_AVAILABLE",
    "gather",
    "scatter",
    "staged_chunk_bytes",
]

try:  # Triton is optional: CPU builds and images without it take the torch path.
    from pd_transfer import _staging_kernel

    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the installation
    TRITON_AVAILABLE = False


def staged_chunk_bytes(layout: KVLayout, num_layers: int, num_pages: int, num_heads: int) -> int:
    """Bytes of one staged chunk: parts x layers x pages x a x heads x b, i.e. the head
    slice's share of every page of every layer and part (K and V)."""
    a, b = layout.page_view
    return len(layout.parts) * num_layers * num_pages * a * num_heads * b


def _head_bytes(layout: KVLayout) -> int:
    """``layout.bytes_per_token_per_head`` without the tensor allocation that property makes
    (a few µs, several times per call, on the transfer worker's hot path)."""
    return layout.head_dim * layout.dtype.itemsize


def gather(
    pool: KVPool,
    layers: Sequence[int],
    page_ids: Sequence[int],
    *,
    head_start: int,
    num_heads: int,
    out: torch.Tensor,
    force_torch: bool = False,
) -> int:
    """Pack heads ``[head_start, head_start+num_heads)`` of ``page_ids`` x ``layers`` into
    ``out`` (a 1-D uint8 tensor on the pool's device, at least ``staged_chunk_bytes`` long)
    in the module's staging layout. Returns the number of bytes written (from ``out[0]``).

    Asynchronous on CUDA (enqueued on the current stream), like any torch op.
    """
    return _move(pool, layers, page_ids, head_start, num_heads, out, force_torch, False)


def scatter(
    buffer: torch.Tensor,
    pool: KVPool,
    layers: Sequence[int],
    page_ids: Sequence[int],
    *,
    head_start: int,
    num_heads: int,
    force_torch: bool = False,
) -> int:
    """The inverse of ``gather``: unpack ``buffer`` (staging layout) into ``page_ids`` x
    ``layers`` of ``pool`` at local heads ``[head_start, head_start+num_heads)``. Other heads
    of those pages, and every other page, are left untouched. Page ids must be distinct.
    Returns the number of bytes read.
    """
    return _move(pool, layers, page_ids, head_start, num_heads, buffer, force_torch, True)


def _move(  # noqa: PLR0917 - private; gather/scatter name every argument
    pool: KVPool,
    layers: Sequence[int],
    page_ids: Sequence[int],
    head_start: int,
    num_heads: int,
    staged: torch.Tensor,
    force_torch: bool,
    scatter: bool,
) -> int:
    layout = pool.layout
    # One int64 array of layers then pages: converts (and type-checks) the ids at C speed,
    # and becomes the kernel's index tensor without another pass.
    ids = array.array("q", layers)
    num_layers = len(ids)
    ids.extend(page_ids)
    layer_list, page_list = ids[:num_layers], ids[num_layers:]
    _validate(layout, layer_list, page_list, head_start, num_heads, staged, pool, scatter)
    nbytes = staged_chunk_bytes(layout, len(layer_list), len(page_list), num_heads)
    if nbytes == 0:
        return 0
    if not pool.is_stacked:
        _move_layers(pool, layer_list, page_list, head_start, num_heads, staged[:nbytes], scatter)
    elif not force_torch and TRITON_AVAILABLE and staged.is_cuda:
        _staging_kernel.launch(
            pool.tensors(),
            layout,
            _device_index(torch.frombuffer(ids, dtype=torch.int64), pool.device),
            len(layer_list),
            len(page_list),
            head_start=head_start,
            num_heads=num_heads,
            staged=staged[:nbytes],
            scatter=scatter,
        )
    else:
        _move_torch(pool, layer_list, page_list, head_start, num_heads, staged[:nbytes], scatter)
    return nbytes


def _device_index(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``values`` (a CPU int64 tensor) on ``device``, without blocking the host on CUDA.

    ``torch.tensor(..., device=cuda)`` copies from pageable memory and then synchronises the
    current stream, which would block the caller (the transfer worker) until every kernel
    queued before it (the engine's forward pass, say) has finished. A pinned source and a
    non-blocking copy stay asynchronous; torch's pinned-memory allocator keeps the source
    alive until the copy has run.
    """
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


def _validate(  # noqa: PLR0917 - private, called once with _move's arguments
    layout: KVLayout,
    layers: Sequence[int],
    pages: Sequence[int],
    head_start: int,
    num_heads: int,
    staged: torch.Tensor,
    pool: KVPool,
    scatter: bool,
) -> None:
    if staged.dtype != torch.uint8 or staged.dim() != 1 or not staged.is_contiguous():
        raise ValueError(
            f"staging buffer must be a contiguous 1-D uint8 tensor, got dtype {staged.dtype}, "
            f"shape {tuple(staged.shape)}"
        )
    if staged.device != pool.device:
        raise ValueError(f"staging buffer is on {staged.device}, the pool on {pool.device}")
    if num_heads <= 0 or head_start < 0 or head_start + num_heads > layout.kv_heads:
        raise ValueError(
            f"head slice [{head_start}, {head_start + num_heads}) is not inside the pool's "
            f"{layout.kv_heads} local heads"
        )
    # min/max rather than a Python loop: a 32K-token chunk has 2048 pages per call.
    if layers and not (min(layers) >= 0 and max(layers) < layout.num_layers):
        bad = next(x for x in layers if not 0 <= x < layout.num_layers)
        raise IndexError(f"layer {bad} outside the pool's [0, {layout.num_layers})")
    if pages and not (min(pages) >= 0 and max(pages) < layout.num_pages):
        bad = next(x for x in pages if not 0 <= x < layout.num_pages)
        raise IndexError(f"page {bad} outside the pool's [0, {layout.num_pages})")
    if scatter and (len(set(pages)) != len(pages) or len(set(layers)) != len(layers)):
        raise ValueError("scatter needs distinct page ids and layers (a page written twice "
                         "would take an arbitrary one of the values)")
    needed = staged_chunk_bytes(layout, len(layers), len(pages), num_heads)
    if staged.numel() < needed:
        raise ValueError(
            f"staging buffer holds {staged.numel()} bytes, the chunk needs {needed} "
            f"({len(layers)} layers x {len(pages)} pages x {num_heads} heads)"
        )


def _pool_rows(
    tensor: torch.Tensor, layout: KVLayout, head_start: int, num_heads: int
) -> torch.Tensor:
    """Byte view ``[num_layers * num_pages, page_size, heads_in_slice, head_bytes]`` of one
    part; row ``layer * num_pages + page`` is that page of that layer. No copy."""
    as_bytes = tensor.view(torch.uint8).view(
        layout.num_layers * layout.num_pages,
        layout.page_size,
        layout.kv_heads,
        _head_bytes(layout),
    )
    return as_bytes[:, :, head_start : head_start + num_heads, :]


def _move_torch(  # noqa: PLR0917 - private, called once with _move's arguments
    pool: KVPool,
    layers: Sequence[int],
    pages: Sequence[int],
    head_start: int,
    num_heads: int,
    staged: torch.Tensor,
    scatter: bool,
) -> None:
    layout = pool.layout
    layer_rows = torch.tensor(layers, dtype=torch.int64)[:, None] * layout.num_pages
    rows = _device_index(
        (layer_rows + torch.tensor(pages, dtype=torch.int64)[None, :]).flatten(), pool.device
    )
    staged_parts = staged.view(
        len(layout.parts),
        len(layers) * len(pages),
        layout.page_size,
        num_heads,
        _head_bytes(layout),
    )
    for index, tensor in enumerate(pool.tensors()):
        source = _pool_rows(tensor, layout, head_start, num_heads)
        if scatter:
            source.index_copy_(0, rows, staged_parts[index])
        else:
            torch.index_select(source, 0, rows, out=staged_parts[index])


def _move_layers(  # noqa: PLR0917 - private, called once with _move's arguments
    pool: KVPool,
    layers: Sequence[int],
    pages: Sequence[int],
    head_start: int,
    num_heads: int,
    staged: torch.Tensor,
    scatter: bool,
) -> None:
    """Per-layer pools: one op per (part, layer) over its ``[num_pages, a, heads, b]`` view."""
    layout = pool.layout
    a, b = layout.page_view
    index = _device_index(torch.tensor(pages, dtype=torch.int64), pool.device)
    staged_view = staged.view(len(layout.parts), len(layers), len(pages), a, num_heads, b)
    for part_index, part in enumerate(layout.parts):
        for layer_index, layer in enumerate(layers):
            source = pool.page_bytes(part, layer)[:, :, head_start : head_start + num_heads]
            chunk = staged_view[part_index, layer_index]
            if scatter:
                source.index_copy_(0, index, chunk)
            else:
                torch.index_select(source, 0, index, out=chunk)
