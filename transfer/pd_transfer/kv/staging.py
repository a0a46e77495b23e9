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

Host cost per call (the transfer worker enqueues one gather or scatter per part): page ids
given as a list are checked and copied to the device on every call, which costs the host
O(pages) (milliseconds for 32K one-token pages). ``PageIds`` does that once per request:
``prepare_pages(pool, ids)`` checks them against the pool and copies them to its device
(CUDA: pinned, non-blocking); ``ids.select(start, stop)`` is a part's slice of them, and
layers given as a ``range`` index a device table of layer ids held per device. A call with
both then does O(1) host work besides the kernel launch.
"""

from __future__ import annotations

import array
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pd_transfer.kv.layout import KVLayout
from pd_transfer.kv.pool import KVPool

__all__ = [
    "TRITON_AVAILABLE",
    "PageIds",
    "PreparedMove",
    "StagingStream",
    "gather",
    "prepare_gather",
    "prepare_pages",
    "prepare_scatter",
    "scatter",
    "staged_chunk_bytes",
]

try:  # Triton is optional: CPU builds and images without it take the torch path.
    from pd_transfer.kv import staging_kernel
    from pd_transfer.kv.staging_kernel import Launch as _Launch

    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the installation
    TRITON_AVAILABLE = False

# (device, pool layers, start, stop) -> layer ids [start, stop) (views of arange(n)); at
# most n(n+1)/2 + 1 small views per device and layer count.
_LAYER_IDS: dict[tuple[torch.device, int, int, int], torch.Tensor] = {}


@dataclass(frozen=True, eq=False)
class PageIds:
    """Page ids checked against one pool and held on its device (``prepare_pages``).

    ``host`` keeps them as an int64 array (per-layer pools and errors read it), ``device``
    is the int64 tensor the kernels index; ``distinct`` says whether scatter may use them.
    """

    host: array.array[int]
    device: torch.Tensor
    distinct: bool
    pool_pages: int  # the pool's page count they were checked against

    def __len__(self) -> int:
        return len(self.host)

    def select(self, start: int, stop: int) -> PageIds:
        """Ids ``[start, stop)`` (a view of the device tensor; no copy, no upload)."""
        if not 0 <= start <= stop <= len(self.host):
            raise IndexError(f"page ids [{start}, {stop}) outside [0, {len(self.host)})")
        return PageIds(self.host[start:stop], self.device[start:stop], self.distinct,
                       self.pool_pages)


class StagingStream:
    """The CUDA stream an endpoint's gathers or scatters run on, off the engine's stream.

    The kernels are launched on ``stream`` directly (``gather(..., stream=)``), so no stream
    switch is needed per chunk. ``order()`` makes the stream wait for everything queued so
    far on the device's default stream (decode, once per request: the last kernels of the
    pages' previous owner), with no device sync. ``mark_default()`` is the event a prefill
    part sent without a ready event waits for; ``record()`` marks this stream's own work.
    """

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._device = self.stream.device_index
        self._default = torch.cuda.default_stream(device)

    def bind(self) -> None:
        """Make the calling thread (the endpoint's worker, once at its start) use the
        stream's device (a pool on cuda:1 needs no switch per launch) and enqueue all its
        CUDA work on ``stream``: the page-id uploads and layer tables a gather or scatter
        reads then run before it on the same stream, not on the engine's stream behind its
        queued work. The engine's threads keep their own current stream."""
        torch.cuda.set_device(self._device)
        torch.cuda.set_stream(self.stream)

    def order(self) -> None:
        """Make ``stream`` wait for the default stream's queued work (no device sync)."""
        self.stream.wait_event(self.mark_default())

    def mark_default(self) -> torch.cuda.Event:
        """An event that fires when the work queued so far on the device's default stream
        has run (any thread may call it)."""
        return _event_after(self._default)

    def record(self) -> torch.cuda.Event:
        """An event that fires when the work queued so far on ``stream`` has run."""
        return _event_after(self.stream)


def _event_after(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)
    return event


def prepare_pages(pool: KVPool, page_ids: Sequence[int]) -> PageIds:
    """Check ``page_ids`` against ``pool`` and copy them to its device, once per request."""
    host = array.array("q", page_ids)  # converts (and type-checks) at C speed
    num_pages = pool.layout.num_pages
    # min/max rather than a Python loop: a 32K-token chunk has 2048 pages per call.
    if host and not (min(host) >= 0 and max(host) < num_pages):
        bad = next(x for x in host if not 0 <= x < num_pages)
        raise IndexError(f"page {bad} outside the pool's [0, {num_pages})")
    device = _device_index(torch.frombuffer(host, dtype=torch.int64) if host else
                           torch.empty(0, dtype=torch.int64), pool.device)
    return PageIds(host, device, len(set(host)) == len(host), num_pages)


def staged_chunk_bytes(layout: KVLayout, num_layers: int, num_pages: int, num_heads: int) -> int:
    """Bytes of one staged chunk: parts x layers x pages x a x heads x b, i.e. the head
    slice's share of every page of every layer and part (K and V)."""
    a, b = layout.page_view
    return len(layout.parts) * num_layers * num_pages * a * num_heads * b


def gather(
    pool: KVPool,
    layers: Sequence[int],
    page_ids: Sequence[int] | PageIds,
    *,
    head_start: int,
    num_heads: int,
    out: torch.Tensor,
    force_torch: bool = False,
    stream: torch.cuda.Stream | None = None,
) -> int:
    """Pack heads ``[head_start, head_start+num_heads)`` of ``page_ids`` x ``layers`` into
    ``out`` (a 1-D uint8 tensor on the pool's device, at least ``staged_chunk_bytes`` long)
    in the module's staging layout. Returns the number of bytes written (from ``out[0]``).

    Asynchronous on CUDA: enqueued on ``stream`` (default: the current stream), like any
    torch op.
    """
    return prepare_gather(pool, layers, page_ids, head_start=head_start, num_heads=num_heads,
                          out=out, force_torch=force_torch).launch(stream)


def scatter(
    buffer: torch.Tensor,
    pool: KVPool,
    layers: Sequence[int],
    page_ids: Sequence[int] | PageIds,
    *,
    head_start: int,
    num_heads: int,
    force_torch: bool = False,
    stream: torch.cuda.Stream | None = None,
) -> int:
    """The inverse of ``gather``: unpack ``buffer`` (staging layout) into ``page_ids`` x
    ``layers`` of ``pool`` at local heads ``[head_start, head_start+num_heads)``. Other heads
    of those pages, and every other page, are left untouched. Page ids must be distinct.
    Returns the number of bytes read. ``stream`` as for ``gather``.
    """
    return prepare_scatter(buffer, pool, layers, page_ids, head_start=head_start,
                           num_heads=num_heads, force_torch=force_torch).launch(stream)


@dataclass(frozen=True, eq=False)
class PreparedMove:
    """A gather or scatter whose arguments are checked and whose index tensors are on the
    device (``prepare_gather``, ``prepare_scatter``): ``launch`` only enqueues it, so it costs
    the host O(1) and any thread may call it (a prefill engine's, inside ``send_part``)."""

    pool: KVPool
    layers: Sequence[int]
    layer_ids: torch.Tensor
    pages: PageIds
    head_start: int
    num_heads: int
    staged: torch.Tensor
    nbytes: int
    scatter: bool = False
    kernel: _Launch | None = None  # the fused kernel's bound launch (CUDA with Triton)

    @property
    def compiled(self) -> bool:
        """Whether ``launch`` runs without compiling a kernel first (seconds, on the
        calling thread)."""
        return self.kernel is None or self.kernel.compiled

    def launch(self, stream: torch.cuda.Stream | None = None) -> int:
        """Enqueue the move on ``stream`` (default: the calling thread's current stream);
        the number of bytes it moves."""
        if self.nbytes == 0:
            return 0
        pool, staged = self.pool, self.staged
        if self.kernel is not None:
            self.kernel.run(stream)
            return self.nbytes
        with (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            if not pool.is_stacked:
                _move_layers(pool, self.layers, self.pages, self.head_start, self.num_heads,
                             staged[:self.nbytes], self.scatter)
            else:
                _move_torch(pool, self.layer_ids, self.pages.device, self.head_start,
                            self.num_heads, staged[:self.nbytes], self.scatter)
        return self.nbytes


def prepare_gather(
    pool: KVPool,
    layers: Sequence[int],
    page_ids: Sequence[int] | PageIds,
    *,
    head_start: int,
    num_heads: int,
    out: torch.Tensor,
    force_torch: bool = False,
) -> PreparedMove:
    """``gather``'s checks and index uploads now (on the calling thread's current stream),
    its launch later (``PreparedMove.launch``)."""
    return _prepare(pool, layers, page_ids, head_start, num_heads, out, force_torch, False)


def prepare_scatter(
    buffer: torch.Tensor,
    pool: KVPool,
    layers: Sequence[int],
    page_ids: Sequence[int] | PageIds,
    *,
    head_start: int,
    num_heads: int,
    force_torch: bool = False,
) -> PreparedMove:
    """``scatter``'s checks and index uploads now, its launch later (``PreparedMove.launch``):
    decode prepares a pre-granted region's scatter with the grant."""
    return _prepare(pool, layers, page_ids, head_start, num_heads, buffer, force_torch, True)


def _prepare(  # noqa: PLR0917 - private; gather/scatter name every argument
    pool: KVPool,
    layers: Sequence[int],
    page_ids: Sequence[int] | PageIds,
    head_start: int,
    num_heads: int,
    staged: torch.Tensor,
    force_torch: bool,
    scatter: bool,
) -> PreparedMove:
    pages = page_ids if isinstance(page_ids, PageIds) else prepare_pages(pool, page_ids)
    layer_ids = _layer_ids(pool, layers, scatter)
    nbytes = _validate(pool.layout, len(layers), pages, head_start, num_heads, staged, pool,
                       scatter)
    kernel = None
    if nbytes and pool.is_stacked and not force_torch and TRITON_AVAILABLE and staged.is_cuda:
        kernel = staging_kernel.plan(pool, layer_ids, pages.device, head_start=head_start,
                                      num_heads=num_heads, staged=staged, scatter=scatter)
    return PreparedMove(pool, layers, layer_ids, pages, head_start, num_heads, staged,
                        nbytes, scatter, kernel)


def _layer_ids(pool: KVPool, layers: Sequence[int], scatter: bool) -> torch.Tensor:
    """``layers`` as an int64 tensor on the pool's device, checked. A ``range`` of step 1 is
    a view of a per-device table (no host work per call); other sequences are uploaded."""
    num_layers = pool.layout.num_layers
    if isinstance(layers, range) and layers.step == 1:
        if layers and not (layers.start >= 0 and layers.stop <= num_layers):
            bad = layers.start if layers.start < 0 else layers.stop - 1
            raise IndexError(f"layer {bad} outside the pool's [0, {num_layers})")
        key = (pool.device, num_layers, layers.start, layers.stop)
        view = _LAYER_IDS.get(key)
        if view is None:
            table = _LAYER_IDS.get((pool.device, num_layers, 0, num_layers))
            if table is None:
                table = torch.arange(num_layers, dtype=torch.int64, device=pool.device)
                _LAYER_IDS[pool.device, num_layers, 0, num_layers] = table
            view = table[layers.start : max(layers.start, layers.stop)]
            _LAYER_IDS[key] = view
        return view
    ids = array.array("q", layers)
    if ids and not (min(ids) >= 0 and max(ids) < num_layers):
        bad = next(x for x in ids if not 0 <= x < num_layers)
        raise IndexError(f"layer {bad} outside the pool's [0, {num_layers})")
    if scatter and len(set(ids)) != len(ids):
        raise ValueError("scatter needs distinct page ids and layers (a page written twice "
                         "would take an arbitrary one of the values)")
    return _device_index(torch.frombuffer(ids, dtype=torch.int64) if ids else
                         torch.empty(0, dtype=torch.int64), pool.device)


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


def _validate(  # noqa: PLR0917 - private, called once with _prepare's arguments
    layout: KVLayout,
    num_layers: int,
    pages: PageIds,
    head_start: int,
    num_heads: int,
    staged: torch.Tensor,
    pool: KVPool,
    scatter: bool,
) -> int:
    """Raises ValueError naming what is wrong; returns the chunk's bytes."""
    if staged.dtype != torch.uint8 or staged.dim() != 1 or not staged.is_contiguous():
        raise ValueError(
            f"staging buffer must be a contiguous 1-D uint8 tensor, got dtype {staged.dtype}, "
            f"shape {tuple(staged.shape)}"
        )
    if staged.device != pool.device or pages.device.device != pool.device:
        raise ValueError(f"staging buffer is on {staged.device}, page ids on "
                         f"{pages.device.device}, the pool on {pool.device}")
    if pages.pool_pages != layout.num_pages:
        raise ValueError(f"page ids were checked against a pool of {pages.pool_pages} pages, "
                         f"this one has {layout.num_pages}")
    if num_heads <= 0 or head_start < 0 or head_start + num_heads > layout.kv_heads:
        raise ValueError(
            f"head slice [{head_start}, {head_start + num_heads}) is not inside the pool's "
            f"{layout.kv_heads} local heads"
        )
    if scatter and not pages.distinct:
        raise ValueError("scatter needs distinct page ids and layers (a page written twice "
                         "would take an arbitrary one of the values)")
    needed = staged_chunk_bytes(layout, num_layers, len(pages), num_heads)
    if staged.numel() < needed:
        raise ValueError(
            f"staging buffer holds {staged.numel()} bytes, the chunk needs {needed} "
            f"({num_layers} layers x {len(pages)} pages x {num_heads} heads)"
        )
    return needed


def _pool_rows(
    tensor: torch.Tensor, layout: KVLayout, head_start: int, num_heads: int
) -> torch.Tensor:
    """Byte view ``[num_layers * num_pages, page_size, heads_in_slice, head_bytes]`` of one
    part; row ``layer * num_pages + page`` is that page of that layer. No copy."""
    as_bytes = tensor.view(torch.uint8).view(
        layout.num_layers * layout.num_pages,
        layout.page_size,
        layout.kv_heads,
        layout.bytes_per_token_per_head,
    )
    return as_bytes[:, :, head_start : head_start + num_heads, :]


def _move_torch(  # noqa: PLR0917 - private, called once with _prepare's arguments
    pool: KVPool,
    layers: torch.Tensor,
    pages: torch.Tensor,
    head_start: int,
    num_heads: int,
    staged: torch.Tensor,
    scatter: bool,
) -> None:
    layout = pool.layout
    rows = (layers[:, None] * layout.num_pages + pages[None, :]).flatten()
    staged_parts = staged.view(
        len(layout.parts),
        rows.numel(),
        layout.page_size,
        num_heads,
        layout.bytes_per_token_per_head,
    )
    for index, tensor in enumerate(pool.tensors()):
        source = _pool_rows(tensor, layout, head_start, num_heads)
        if scatter:
            source.index_copy_(0, rows, staged_parts[index])
        else:
            torch.index_select(source, 0, rows, out=staged_parts[index])


def _move_layers(  # noqa: PLR0917 - private, called once with _prepare's arguments
    pool: KVPool,
    layers: Sequence[int],
    pages: PageIds,
    head_start: int,
    num_heads: int,
    staged: torch.Tensor,
    scatter: bool,
) -> None:
    """Per-layer pools: one op per (part, layer) over its ``[num_pages, a, heads, b]`` view."""
    layout = pool.layout
    a, b = layout.page_view
    staged_view = staged.view(len(layout.parts), len(layers), len(pages), a, num_heads, b)
    for part_index, part in enumerate(layout.parts):
        for layer_index, layer in enumerate(layers):
            source = pool.page_bytes(part, layer)[:, :, head_start : head_start + num_heads]
            chunk = staged_view[part_index, layer_index]
            if scatter:
                source.index_copy_(0, pages.device, chunk)
            else:
                torch.index_select(source, 0, pages.device, out=chunk)
