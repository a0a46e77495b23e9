"""``KVPool``: one rank's KV memory laid out as its ``KVLayout`` says (``layout``), stacked
or per layer, with the byte addresses of its pages. Nothing here does I/O or imports a
transport.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pd_transfer.kv.layout import (
    ByteRange,
    KVLayout,
    KVPacking,
    KVPart,
    PageFormat,
    PageRun,
    merge_byte_ranges,
)

__all__ = ["KVPool"]


class KVPool:
    """One rank's KV memory, stacked or per layer, with byte address helpers.

    Stacked: ``allocate`` fresh tensors or wrap an engine's existing ones (``KVPool(layout,
    k, v)``); they must match ``layout.tensor_shape`` exactly and be contiguous. Per-layer:
    ``from_layer_tensors`` (no copy). Either way every page address comes from the table of
    per-(part, layer) page-0 bases, which only holds for contiguous memory.
    """

    def __init__(self, layout: KVLayout, k: torch.Tensor, v: torch.Tensor | None) -> None:
        if not layout.is_token_major:
            raise ValueError(
                f"KVPool: a stacked pool has NHD pages with separate K and V, the layout has "
                f"{layout.page_format.value}/{layout.packing.value}; use "
                f"KVPool.from_layer_tensors"
            )
        self._check_tensor(layout, "k", k)
        if layout.has_v:
            if v is None:
                raise ValueError("KVPool: the layout has V (has_v=True) but no V tensor was given")
            self._check_tensor(layout, "v", v)
            if v.device != k.device:
                raise ValueError(f"KVPool: K is on {k.device} but V is on {v.device}")
        elif v is not None:
            raise ValueError("KVPool: the layout has no V (has_v=False, MLA) but V was given")
        self.layout = layout
        self._stacked: tuple[torch.Tensor, ...] | None = (k,) if v is None else (k, v)
        self._layers: tuple[tuple[torch.Tensor, ...], ...] = tuple(
            tuple(tensor[layer] for tensor in self._stacked) for layer in range(layout.num_layers)
        )
        self._device = k.device
        self._bases = self._base_table()

    @classmethod
    def from_layer_tensors(
        cls, layout: KVLayout, tensors: Sequence[Sequence[torch.Tensor]]
    ) -> KVPool:
        """A pool over an engine's per-layer tensors, addressed in place (no copy).

        ``tensors[layer][i]`` is the ``i``-th part of ``layout.parts`` for that layer: a
        contiguous tensor (any dtype and shape) whose bytes are exactly ``num_pages`` pages
        of ``layout.page_bytes_per_layer``; all on one device.
        """
        checked = _check_layer_tensors(layout, tensors)
        pool = cls.__new__(cls)
        pool.layout = layout
        pool._stacked = None
        pool._layers = checked
        pool._device = checked[0][0].device
        pool._bases = pool._base_table()
        return pool

    @classmethod
    def allocate(cls, layout: KVLayout, device: torch.device | str = "cpu") -> KVPool:
        """Allocate zero-filled stacked K (and V) tensors for ``layout`` on ``device``."""
        k = torch.zeros(layout.tensor_shape, dtype=layout.dtype, device=device)
        v = (
            torch.zeros(layout.tensor_shape, dtype=layout.dtype, device=device)
            if layout.has_v
            else None
        )
        return cls(layout, k, v)

    @classmethod
    def allocate_per_layer(cls, layout: KVLayout, device: torch.device | str = "cpu") -> KVPool:
        """A zero-filled per-layer pool whose tensors are shaped as vLLM allocates them.

        NHD (FlashAttention): per layer ``[2, num_pages, page_size, kv_heads, head_dim]``
        (``[num_pages, page_size, 1, head_dim]`` for MLA), parts its K and V halves. HND:
        per layer ``[2, num_pages, kv_heads, page_size, head_dim]``. PER_HEAD (CPU backend):
        one allocation shared by every layer, layer ``l`` its ``[num_pages, kv_heads,
        page_size, 2 * head_dim]`` slice (``[num_pages, page_size, kv_heads, 2 * head_dim]``
        with NHD).
        """
        pages, heads, size, dim = (layout.num_pages, layout.kv_heads, layout.page_size,
                                   layout.head_dim)
        if layout.packing is KVPacking.PER_HEAD:
            inner = ((heads, size) if layout.page_format is PageFormat.HND else (size, heads))
            whole = torch.zeros((layout.num_layers, pages, *inner, 2 * dim),
                                dtype=layout.dtype, device=device)
            return cls.from_layer_tensors(layout, [(layer,) for layer in whole])
        page = (size, heads, dim) if layout.page_format is PageFormat.NHD else (heads, size, dim)
        count = len(layout.parts)
        tensors = [torch.zeros((count, pages, *page), dtype=layout.dtype, device=device)
                   for _ in range(layout.num_layers)]
        return cls.from_layer_tensors(layout, [tuple(t) for t in tensors])

    @staticmethod
    def _check_tensor(layout: KVLayout, name: str, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != layout.tensor_shape:
            raise ValueError(
                f"KVPool: {name} has shape {tuple(tensor.shape)}, the layout needs "
                f"{layout.tensor_shape} ([num_layers, num_pages*page_size, kv_heads, head_dim])"
            )
        if tensor.dtype != layout.dtype:
            raise ValueError(f"KVPool: {name} has dtype {tensor.dtype}, layout has {layout.dtype}")
        if not tensor.is_contiguous():
            raise ValueError(f"KVPool: {name} must be contiguous (byte addressing relies on it)")

    def _base_table(self) -> tuple[tuple[int, ...], ...]:
        """Page-0 address of each (part, layer): ``[part_index][layer]``."""
        parts = range(len(self.layout.parts))
        return tuple(tuple(layer[i].data_ptr() for layer in self._layers) for i in parts)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def is_stacked(self) -> bool:
        """Whether the pool is two stacked tensors (``tensors``, ``layer`` and
        ``pages_to_tokens`` work only then)."""
        return self._stacked is not None

    @property
    def k(self) -> torch.Tensor:
        """A stacked pool's K tensor."""
        return self.tensor(KVPart.K)

    @property
    def v(self) -> torch.Tensor | None:
        """A stacked pool's V tensor; None for MLA."""
        stacked = self._require_stacked("v")
        return stacked[1] if len(stacked) == 2 else None

    def _require_stacked(self, what: str) -> tuple[torch.Tensor, ...]:
        if self._stacked is None:
            raise TypeError(
                f"KVPool.{what} needs a stacked pool; this pool is per layer: use "
                f"layer_tensor(part, layer), page_bytes(part, layer) or layer_page_base"
            )
        return self._stacked

    def tensor(self, part: KVPart) -> torch.Tensor:
        """A stacked pool's whole ``[num_layers, num_tokens, kv_heads, head_dim]`` tensor."""
        stacked = self._require_stacked("tensor")
        if part is KVPart.K:
            return stacked[0]
        if part is KVPart.V and len(stacked) == 2:
            return stacked[1]
        raise ValueError(f"KVPool: this layout has no {part.value.upper()} pool (parts "
                         f"{[p.value for p in self.layout.parts]})")

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """A stacked pool's tensors of ``layout.parts``, in staging order."""
        return self._require_stacked("tensors")

    def layer(self, part: KVPart, layer: int) -> torch.Tensor:
        """A stacked pool's ``[num_tokens, kv_heads, head_dim]`` view of one layer."""
        self._check_layer(layer)
        return self.tensor(part)[layer]

    def layer_k(self, layer: int) -> torch.Tensor:
        return self.layer(KVPart.K, layer)

    def layer_v(self, layer: int) -> torch.Tensor:
        return self.layer(KVPart.V, layer)

    def layer_tensor(self, part: KVPart, layer: int) -> torch.Tensor:
        """The tensor holding ``(part, layer)`` (either pool kind): the engine's own tensor
        of a per-layer pool, a layer view of a stacked one."""
        self._check_layer(layer)
        return self._layers[layer][self._part_index(part)]

    def page_bytes(self, part: KVPart, layer: int) -> torch.Tensor:
        """Byte view ``[num_pages, a, kv_heads, b]`` of ``(part, layer)`` (``layout.page_view``
        gives ``(a, b)``); aliases the pool, no copy."""
        a, b = self.layout.page_view
        tensor = self.layer_tensor(part, layer)
        return tensor.view(torch.uint8).view(self.layout.num_pages, a, self.layout.kv_heads, b)

    def token_bytes(self, part: KVPart, layer: int) -> torch.Tensor:
        """Byte view ``[num_pages, page_size, kv_heads, head_bytes]`` of the keys (``part``
        K) or values (V) of ``layer``, whatever the page format and packing; aliases the
        pool (not contiguous unless the pages are NHD)."""
        layout = self.layout
        if part is KVPart.KV or (part is KVPart.V and not layout.has_v):
            raise ValueError(f"KVPool.token_bytes: part must be K or V (V only with has_v), "
                             f"got {part.value}")
        head_bytes = layout.bytes_per_token_per_head
        shape = (layout.num_pages, layout.kv_heads, layout.page_size, head_bytes)
        index = 0 if part is KVPart.K else 1
        if layout.packing is KVPacking.PER_HEAD and layout.page_format is PageFormat.NHD:
            rows = self.page_bytes(KVPart.KV, layer).view(
                layout.num_pages, layout.page_size, layout.kv_heads, 2, head_bytes
            )
            return rows[:, :, :, index]
        if layout.packing is KVPacking.PER_HEAD:
            packed = self.page_bytes(KVPart.KV, layer).view(
                layout.num_pages, layout.kv_heads, 2, layout.page_size, head_bytes
            )
            return packed[:, :, index].transpose(1, 2)
        pages = self.page_bytes(part, layer)
        if layout.page_format is PageFormat.HND:
            return pages.view(shape).transpose(1, 2)
        return pages

    def pages_to_tokens(self, page_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Token slot indices of ``page_ids`` in a stacked pool, page by page in the given
        order (int64)."""
        self._require_stacked("pages_to_tokens")
        pages = torch.as_tensor(page_ids, dtype=torch.int64, device=self.device).reshape(-1)
        self._check_pages_tensor(pages)
        page_size = self.layout.page_size
        offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)
        return (pages[:, None] * page_size + offsets[None, :]).reshape(-1)

    def layer_page_base(self, part: KVPart, layer: int) -> int:
        """Address of page 0 of ``(part, layer)``."""
        self._check_layer(layer)
        return self._bases[self._part_index(part)][layer]

    def base_table(self) -> tuple[tuple[int, ...], ...]:
        """Every page-0 address, ``[part_index][layer]`` in ``layout.parts`` order."""
        return self._bases

    def page_address(self, part: KVPart, layer: int, page: int) -> ByteRange:
        """Address and length of page ``page`` of layer ``layer`` of ``part``."""
        return self.page_run_address(part, layer, PageRun(page, 1))

    def page_run_address(self, part: KVPart, layer: int, run: PageRun) -> ByteRange:
        """Address and length of a run of consecutive pages of one layer of ``part``."""
        if run.num_pages <= 0:
            raise ValueError(f"KVPool: a page run needs at least one page, got {run}")
        self._check_page(run.first_page)
        self._check_page(run.first_page + run.num_pages - 1)
        page_bytes = self.layout.page_bytes_per_layer
        base = self.layer_page_base(part, layer)
        return ByteRange(base + run.first_page * page_bytes, run.num_pages * page_bytes)

    def region(self, part: KVPart) -> ByteRange:
        """A stacked pool's whole tensor of ``part`` as one byte range."""
        return ByteRange(self.tensor(part).data_ptr(), self.layout.part_bytes)

    def registration_ranges(self) -> list[ByteRange]:
        """The byte ranges to register with the transport, by address: each tensor's bytes,
        overlapping or adjacent ranges of one allocation merged (a FlashAttention layer
        tensor's K and V halves become one range)."""
        return [r for r, _ in self._registration()]

    def registration_tensors(self) -> list[torch.Tensor]:
        """``registration_ranges`` as 1-D uint8 tensors aliasing the pool (what
        ``Transport.register`` takes), in the same order."""
        return [t for _, t in self._registration()]

    def _registration(self) -> list[tuple[ByteRange, torch.Tensor]]:
        tensors = self._stacked or tuple(t for layer in self._layers for t in layer)
        by_storage: dict[int, list[torch.Tensor]] = {}
        for tensor in tensors:
            by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
        out: list[tuple[ByteRange, torch.Tensor]] = []
        for group in by_storage.values():
            whole = group[0].view(torch.uint8).reshape(-1)
            storage_base = group[0].untyped_storage().data_ptr()
            ranges = [ByteRange(t.data_ptr(), t.numel() * t.element_size()) for t in group]
            for item in merge_byte_ranges(ranges):
                view = whole.as_strided((item.length_bytes,), (1,), item.address - storage_base)
                out.append((item, view))
        return sorted(out, key=lambda pair: pair[0].address)

    def _part_index(self, part: KVPart) -> int:
        try:
            return self.layout.parts.index(part)
        except ValueError:
            raise ValueError(
                f"KVPool: this layout has no {part.value.upper()} pool (parts "
                f"{[p.value for p in self.layout.parts]})"
            ) from None

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.layout.num_layers:
            raise IndexError(f"KVPool: layer {layer} outside [0, {self.layout.num_layers})")

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self.layout.num_pages:
            raise IndexError(f"KVPool: page {page} outside [0, {self.layout.num_pages})")

    def _check_pages_tensor(self, pages: torch.Tensor) -> None:
        if pages.numel() and (
            int(pages.min()) < 0 or int(pages.max()) >= self.layout.num_pages
        ):
            raise IndexError(
                f"KVPool: page ids must lie in [0, {self.layout.num_pages}), got "
                f"min {int(pages.min())}, max {int(pages.max())}"
            )


def _check_layer_tensors(
    layout: KVLayout, tensors: Sequence[Sequence[torch.Tensor]]
) -> tuple[tuple[torch.Tensor, ...], ...]:
    """``tensors`` as a tuple table, after checking counts, sizes, contiguity and device."""
    if len(tensors) != layout.num_layers:
        raise ValueError(
            f"KVPool: {len(tensors)} layers of tensors given, the layout has {layout.num_layers}"
        )
    parts = [p.value for p in layout.parts]
    device: torch.device | None = None
    for layer, row in enumerate(tensors):
        if len(row) != len(parts):
            raise ValueError(
                f"KVPool: layer {layer} has {len(row)} tensors, the layout's parts are {parts}"
            )
        for part, tensor in zip(parts, row, strict=True):
            _check_layer_tensor(layout, f"layer {layer} part {part}", tensor)
            if device is None:
                device = tensor.device
            if tensor.device != device:
                raise ValueError(
                    f"KVPool: layer {layer} part {part} is on {tensor.device}, the first "
                    f"tensor on {device}; a pool lives on one device"
                )
    return tuple(tuple(row) for row in tensors)


def _check_layer_tensor(layout: KVLayout, name: str, tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes != layout.layer_bytes:
        raise ValueError(
            f"KVPool: {name} holds {nbytes} bytes, the layout needs {layout.layer_bytes} "
            f"({layout.num_pages} pages x {layout.page_bytes_per_layer} bytes)"
        )
    if not tensor.is_contiguous():
        raise ValueError(f"KVPool: {name} must be contiguous (byte addressing relies on it)")
