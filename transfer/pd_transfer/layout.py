"""The paged KV pool: its geometry, its tensors, and the byte addresses of its pages.

One rank's KV cache is two tensors, K and V, each of shape
``[num_layers, num_pages * page_size, kv_heads, head_dim]`` (token-major, as SGLang's MHA
pool), contiguous. Keeping every local layer in one tensor makes each per-layer view
contiguous (the ``[num_pages * page_size, kv_heads, head_dim]`` pool an attention kernel
expects) and lets a gather across all layers be a single indexing op (see ``staging``).

MLA models keep one latent vector per token and no separate V: their layout has
``kv_heads == 1`` and ``has_v == False``, and the pool then holds K only.

A head slice of a page is not contiguous (heads are the second-innermost dimension), which is
why ``staging`` exists; a whole page of one layer is, which is what the byte address helpers
here serve (descriptor building for the equal-TP path, and registration with the transport).
Nothing here does I/O or imports a transport.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "ByteRange",
    "KVLayout",
    "KVPart",
    "KVPool",
    "PageRun",
    "compute_page_runs",
]


class KVPart(enum.Enum):
    """Which of the two pools of a layer: keys or values."""

    K = "k"
    V = "v"


@dataclass(frozen=True)
class ByteRange:
    """``length_bytes`` bytes starting at device address ``address`` (for descriptors)."""

    address: int
    length_bytes: int


@dataclass(frozen=True)
class PageRun:
    """``num_pages`` consecutive page ids starting at ``first_page``."""

    first_page: int
    num_pages: int


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one rank's paged KV pool; every derived size is in bytes.

    ``kv_heads`` is the number of heads this rank holds (its local heads after the TP
    split), not the model's total. Sizes named ``*_bytes`` without ``_kv`` are for one part
    (K or V); ``*_kv_bytes`` count every part the layout has (two, or one for MLA).
    """

    num_layers: int
    num_pages: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    has_v: bool = True

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_pages", "page_size", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"KVLayout.dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def parts(self) -> tuple[KVPart, ...]:
        """The pools this layout has, in staging order: (K, V), or (K,) for MLA."""
        return (KVPart.K, KVPart.V) if self.has_v else (KVPart.K,)

    @property
    def element_size_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def num_tokens(self) -> int:
        """Token slots per layer: ``num_pages * page_size``."""
        return self.num_pages * self.page_size

    @property
    def bytes_per_token_per_head(self) -> int:
        return self.head_dim * self.element_size_bytes

    @property
    def bytes_per_token_per_layer(self) -> int:
        """One token's row (all local heads) in one layer of one part."""
        return self.kv_heads * self.bytes_per_token_per_head

    @property
    def page_bytes_per_layer(self) -> int:
        """One page of one layer of one part; contiguous in memory."""
        return self.page_size * self.bytes_per_token_per_layer

    @property
    def layer_bytes(self) -> int:
        """One layer's whole pool of one part."""
        return self.num_pages * self.page_bytes_per_layer

    @property
    def part_bytes(self) -> int:
        """All layers of one part: the size of the K tensor (or of the V tensor)."""
        return self.num_layers * self.layer_bytes

    @property
    def total_kv_bytes(self) -> int:
        """Everything the pool holds: K and V (or K alone for MLA)."""
        return len(self.parts) * self.part_bytes

    @property
    def tensor_shape(self) -> tuple[int, int, int, int]:
        """Shape of the K (and V) tensor: ``[num_layers, num_tokens, kv_heads, head_dim]``."""
        return (self.num_layers, self.num_tokens, self.kv_heads, self.head_dim)


def compute_page_runs(page_ids: Sequence[int]) -> tuple[PageRun, ...]:
    """Split ``page_ids`` (in the given order) into maximal runs of consecutive ids.

    Each run is one contiguous byte range per layer and part, hence one transfer descriptor
    instead of one per page when the allocator handed out neighbouring pages.
    """
    runs: list[PageRun] = []
    for page in page_ids:
        if runs and runs[-1].first_page + runs[-1].num_pages == page:
            last = runs[-1]
            runs[-1] = PageRun(last.first_page, last.num_pages + 1)
        else:
            runs.append(PageRun(page, 1))
    return tuple(runs)


class KVPool:
    """The K and V tensors of one rank, with per-layer views and byte address helpers.

    Either ``allocate`` fresh tensors or wrap an engine's existing ones (``KVPool(layout, k,
    v)``). Wrapped tensors must match the layout exactly and be contiguous: the byte address
    helpers compute offsets from the layout, which is only valid for the contiguous layout.
    """

    def __init__(self, layout: KVLayout, k: torch.Tensor, v: torch.Tensor | None) -> None:
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
        self.k = k
        self.v = v

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

    @classmethod
    def allocate(cls, layout: KVLayout, device: torch.device | str = "cpu") -> KVPool:
        """Allocate zero-filled K (and V) tensors for ``layout`` on ``device``."""
        k = torch.zeros(layout.tensor_shape, dtype=layout.dtype, device=device)
        v = (
            torch.zeros(layout.tensor_shape, dtype=layout.dtype, device=device)
            if layout.has_v
            else None
        )
        return cls(layout, k, v)

    @property
    def device(self) -> torch.device:
        return self.k.device

    def tensor(self, part: KVPart) -> torch.Tensor:
        """The whole ``[num_layers, num_tokens, kv_heads, head_dim]`` tensor of ``part``."""
        if part is KVPart.K:
            return self.k
        if self.v is None:
            raise ValueError("KVPool: this layout has no V pool (MLA)")
        return self.v

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors of ``layout.parts``, in staging order."""
        return tuple(self.tensor(part) for part in self.layout.parts)

    def layer(self, part: KVPart, layer: int) -> torch.Tensor:
        """Layer ``layer``'s ``[num_tokens, kv_heads, head_dim]`` pool; a contiguous view."""
        self._check_layer(layer)
        return self.tensor(part)[layer]

    def layer_k(self, layer: int) -> torch.Tensor:
        return self.layer(KVPart.K, layer)

    def layer_v(self, layer: int) -> torch.Tensor:
        return self.layer(KVPart.V, layer)

    def pages_to_tokens(self, page_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Token slot indices of ``page_ids``, page by page in the given order (int64)."""
        pages = torch.as_tensor(page_ids, dtype=torch.int64, device=self.device).reshape(-1)
        self._check_pages_tensor(pages)
        page_size = self.layout.page_size
        offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)
        return (pages[:, None] * page_size + offsets[None, :]).reshape(-1)

    def page_address(self, part: KVPart, layer: int, page: int) -> ByteRange:
        """Address and length of page ``page`` of layer ``layer`` of ``part``."""
        return self.page_run_address(part, layer, PageRun(page, 1))

    def page_run_address(self, part: KVPart, layer: int, run: PageRun) -> ByteRange:
        """Address and length of a run of consecutive pages of one layer of ``part``."""
        self._check_layer(layer)
        if run.num_pages <= 0:
            raise ValueError(f"KVPool: a page run needs at least one page, got {run}")
        self._check_page(run.first_page)
        self._check_page(run.first_page + run.num_pages - 1)
        lay = self.layout
        offset = layer * lay.layer_bytes + run.first_page * lay.page_bytes_per_layer
        return ByteRange(
            self.tensor(part).data_ptr() + offset, run.num_pages * lay.page_bytes_per_layer
        )

    def region(self, part: KVPart) -> ByteRange:
        """The whole tensor of ``part`` as one byte range (for transport registration)."""
        return ByteRange(self.tensor(part).data_ptr(), self.layout.part_bytes)

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
