"""The paged KV pool's geometry (``KVLayout``) and the byte arithmetic of its pages; the
pool's memory itself is ``pool.KVPool``.

A pool holds, for every local layer and every part (K and V; K alone for MLA; one packed
KV part for vLLM's CPU backend), ``num_pages`` pages of ``page_bytes_per_layer`` bytes each,
contiguous in memory. Two kinds of pool hold them:

- stacked (``KVPool(layout, k, v)`` / ``allocate``): two tensors K and V of shape
  ``[num_layers, num_pages * page_size, kv_heads, head_dim]`` (token-major, as SGLang's MHA
  pool). Every per-layer view is contiguous, and a gather across all layers is a single
  indexing op (see ``staging``). Stacked pools use the NHD page format.
- per-layer (``from_layer_tensors``): one contiguous tensor per (layer, part), owned by an
  engine (vLLM allocates its KV cache per layer), addressed in place through a table of
  page-0 base addresses; any page format.

A page of one part, as bytes, is ``[a, kv_heads, b]``: the middle dimension is the head, so
a head slice of a page is ``[a, heads_in_slice, b]`` and is contiguous only when ``a == 1``:

- NHD (token-major; ours, vLLM FlashAttention): a page is ``[page_size, kv_heads, head
  bytes]``, so ``(a, b) = (page_size, head_bytes)``.
- HND (head-major; vLLM's HND layout): a page is ``[kv_heads, page_size, head bytes]``, so
  ``(a, b) = (1, page_size * head_bytes)``.
- HND with PER_HEAD packing (vLLM's CPU backend): one KV part whose page is ``[kv_heads,
  2 * page_size, head bytes]``, each head's slab holding its page_size K rows then its
  page_size V rows, so ``(a, b) = (1, 2 * page_size * head_bytes)``. Row contents may be
  ISA-packed by the engine: bytes are moved as opaque.
- NHD with PER_HEAD packing (vLLM's token-major ``LBNHC`` layout): one KV part whose page is
  ``[page_size, kv_heads, 2 * head bytes]``, each (token, head) row K then V, so
  ``(a, b) = (page_size, 2 * head_bytes)``.

MLA models keep one latent vector per token and no separate V: their layout has
``kv_heads == 1`` and ``has_v == False``, and the pool then holds K only. Nothing here does
I/O or imports a transport.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "ByteRange",
    "KVLayout",
    "KVPacking",
    "KVPart",
    "PageFormat",
    "PageRun",
    "compute_page_runs",
    "merge_byte_ranges",
]


class KVPart(enum.Enum):
    """Which pool of a layer: keys, values, or both packed per head (``KVPacking.PER_HEAD``)."""

    K = "k"
    V = "v"
    KV = "kv"


class PageFormat(enum.Enum):
    """How one page of one part orders its tokens and heads."""

    NHD = "nhd"  # [page_size, kv_heads, head_dim]: token-major
    HND = "hnd"  # [kv_heads, page_size, head_dim]: head-major


class KVPacking(enum.Enum):
    """How K and V of a layer are split into parts."""

    SEPARATE = "separate"  # K and V are separate parts; MLA: K only
    PER_HEAD = "per_head"  # one KV part: each head's slab is page_size K rows then V rows


@dataclass(frozen=True)
class ByteRange:
    """``length_bytes`` bytes starting at device address ``address`` (for descriptors)."""

    address: int
    length_bytes: int

    @property
    def end(self) -> int:
        """One past the last byte."""
        return self.address + self.length_bytes


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
    (K, V or packed KV); ``*_kv_bytes`` count every part the layout has.
    """

    num_layers: int
    num_pages: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    has_v: bool = True
    page_format: PageFormat = PageFormat.NHD
    packing: KVPacking = KVPacking.SEPARATE

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_pages", "page_size", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"KVLayout.dtype must be a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.page_format, PageFormat) or not isinstance(
            self.packing, KVPacking
        ):
            raise ValueError(
                f"KVLayout: page_format must be a PageFormat and packing a KVPacking, got "
                f"{self.page_format!r}, {self.packing!r}"
            )
        if self.packing is KVPacking.PER_HEAD and not self.has_v:
            raise ValueError("KVLayout: PER_HEAD packing needs a V part (has_v)")

    @property
    def parts(self) -> tuple[KVPart, ...]:
        """The parts this layout has, in staging order: (K, V), (K,) for MLA, or (KV,)."""
        if self.packing is KVPacking.PER_HEAD:
            return (KVPart.KV,)
        return (KVPart.K, KVPart.V) if self.has_v else (KVPart.K,)

    @property
    def element_size_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def num_tokens(self) -> int:
        """Token slots per layer: ``num_pages * page_size``."""
        return self.num_pages * self.page_size

    @property
    def bytes_per_token_per_head(self) -> int:
        return self.head_dim * self.element_size_bytes

    @property
    def bytes_per_token_per_layer(self) -> int:
        """One token's row (all local heads) in one layer of one part (K or V)."""
        return self.kv_heads * self.bytes_per_token_per_head

    @property
    def page_view(self) -> tuple[int, int]:
        """``(a, b)``: one page of one part, as bytes, is ``[a, kv_heads, b]``."""
        head_bytes = self.bytes_per_token_per_head
        packed = 2 if self.packing is KVPacking.PER_HEAD else 1
        if self.page_format is PageFormat.NHD:  # PER_HEAD: one (token, head) row is K | V
            return self.page_size, packed * head_bytes
        return 1, packed * self.page_size * head_bytes

    @property
    def page_bytes_per_layer(self) -> int:
        """One page of one layer of one part (for PER_HEAD: K and V of every local head);
        contiguous in memory."""
        a, b = self.page_view
        return a * self.kv_heads * b

    @property
    def layer_bytes(self) -> int:
        """One layer's whole pool of one part."""
        return self.num_pages * self.page_bytes_per_layer

    @property
    def part_bytes(self) -> int:
        """All layers of one part: the size of a stacked pool's K tensor (or V tensor)."""
        return self.num_layers * self.layer_bytes

    @property
    def total_kv_bytes(self) -> int:
        """Everything the pool holds: K and V (or K alone for MLA)."""
        return len(self.parts) * self.part_bytes

    @property
    def is_token_major(self) -> bool:
        """NHD pages with separate K and V: a head slice of one token's row is contiguous."""
        return self.page_format is PageFormat.NHD and self.packing is KVPacking.SEPARATE

    @property
    def tensor_shape(self) -> tuple[int, int, int, int]:
        """Shape of a stacked pool's K (and V) tensor: ``[num_layers, num_tokens, kv_heads,
        head_dim]``."""
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


def merge_byte_ranges(ranges: Sequence[ByteRange]) -> list[ByteRange]:
    """``ranges`` sorted by address, with overlapping or adjacent ones merged."""
    merged: list[ByteRange] = []
    for item in sorted(ranges, key=lambda r: r.address):
        if merged and item.address <= merged[-1].end:
            last = merged[-1]
            merged[-1] = ByteRange(last.address, max(last.end, item.end) - last.address)
        else:
            merged.append(item)
    return merged
