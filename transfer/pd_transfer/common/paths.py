"""Descriptor arithmetic of the three send paths, and the choice between them.

- contiguous: the pair's head slice is every local head on both sides, so one page of one
  layer is one contiguous range on both sides: one descriptor per run of pages consecutive
  on BOTH sides, per layer, per part. Any page format.
- sliced: one descriptor per token per layer per K/V (a head slice of one token's row is
  contiguous, of a page is not). The no-staging fallback; descriptor-bound; token-major
  (NHD, separate K and V) pages only.
- staged: no descriptors here; ``staging.gather``/``scatter`` pack the slice into one
  contiguous region that travels as ONE descriptor.

Addresses come from base tables: ``bases[part_index][layer]`` is the address of page 0 of
that (part, layer) (``KVPool.base_table`` locally, ``RankDocument.layer_bases`` for a peer),
so stacked and per-layer pools are addressed alike. Pure functions over layouts, base tables
and page lists; the results are ``Span`` lists for ``Transport.write``, which still checks
every span against registered regions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from pd_transfer.kv.layout import KVLayout, KVPacking, PageFormat
from pd_transfer.kv.plan import Attention, TransferPlan, compute_local_heads
from pd_transfer.protocol.messages import Path
from pd_transfer.transport.base import Span
from pd_transfer.trust.bootstrap import DTYPES, RankDocument

__all__ = [
    "BaseTable",
    "PathMode",
    "choose_path",
    "compute_contiguous_spans",
    "compute_layout",
    "compute_sliced_spans",
    "is_whole_heads",
]

PathMode = Literal["auto", "staged", "sliced", "contiguous"]
BaseTable = Sequence[Sequence[int]]
"""``bases[part_index][layer]``: the address of page 0 of that (part, layer)."""


def compute_layout(document: RankDocument) -> KVLayout:
    """The local KV layout of the rank ``document`` describes."""
    geometry = document.geometry
    heads = compute_local_heads(geometry.total_kv_heads, document.tp, document.tp_rank)
    return KVLayout(
        num_layers=geometry.num_layers // document.pp,
        num_pages=document.num_pages,
        page_size=geometry.page_size,
        kv_heads=heads.count,
        head_dim=geometry.head_dim,
        dtype=DTYPES[geometry.dtype],
        has_v=geometry.attention == Attention.MHA.value,
        page_format=PageFormat(geometry.page_format),
        packing=KVPacking(geometry.packing),
    )


def is_whole_heads(plan: TransferPlan, src: KVLayout, dst: KVLayout) -> bool:
    """Whether the pair moves every local head of both ranks (pages are then contiguous)."""
    return plan.heads.num_heads == src.kv_heads == dst.kv_heads


def choose_path(mode: PathMode, plan: TransferPlan, src: KVLayout, dst: KVLayout) -> Path:
    """``auto``: contiguous for whole heads on both sides, else staged. Raises ValueError
    for ``contiguous`` when the head split differs (it cannot be contiguous), and for
    ``sliced`` unless both sides have token-major pages."""
    whole = is_whole_heads(plan, src, dst)
    if mode == "auto":
        return "contiguous" if whole else "staged"
    if mode == "sliced":
        _check_token_major(src, dst)
    if mode == "contiguous" and not whole:
        raise ValueError(
            f"path 'contiguous' needs the same whole local heads on both ranks, but prefill "
            f"rank {plan.prefill} sends {plan.heads.num_heads} of its {src.kv_heads} heads "
            f"into {dst.kv_heads} on decode rank {plan.decode}; use 'staged' or 'auto'"
        )
    return mode


def _check_token_major(src: KVLayout, dst: KVLayout) -> None:
    for side, layout in (("prefill", src), ("decode", dst)):
        if not layout.is_token_major:
            raise ValueError(
                f"path 'sliced' needs token-major pages (NHD) with separate K and V, but the "
                f"{side} pool has {layout.page_format.value} pages packed "
                f"{layout.packing.value}; use 'staged' or 'auto'"
            )


def _joint_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_first, dst_first, count)`` runs consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_pages, dst_pages, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def _check_tables(layout: KVLayout, bases: BaseTable, side: str) -> None:
    if len(bases) != len(layout.parts) or any(len(row) != layout.num_layers for row in bases):
        raise ValueError(
            f"{side} base table is {len(bases)} x {[len(row) for row in bases]}, the layout "
            f"needs {len(layout.parts)} parts x {layout.num_layers} layers"
        )


def compute_contiguous_spans(
    src: KVLayout,
    *,
    src_bases: BaseTable,
    dst: KVLayout,
    dst_bases: BaseTable,
    layers: Sequence[tuple[int, int]],
    pages: Sequence[tuple[int, int]],
) -> tuple[list[Span], list[Span]]:
    """Whole pages: ``layers`` and ``pages`` are (src, dst) pairs of local indices."""
    if src.page_bytes_per_layer != dst.page_bytes_per_layer or src.parts != dst.parts:
        raise ValueError(
            f"contiguous path: pages differ ({src.page_bytes_per_layer} vs "
            f"{dst.page_bytes_per_layer} bytes per layer, parts "
            f"{[p.value for p in src.parts]} vs {[p.value for p in dst.parts]})"
        )
    _check_tables(src, src_bases, "prefill")
    _check_tables(dst, dst_bases, "decode")
    page_bytes = src.page_bytes_per_layer
    runs = _joint_runs([p for p, _ in pages], [p for _, p in pages])
    local: list[Span] = []
    remote: list[Span] = []
    for src_row, dst_row in zip(src_bases, dst_bases, strict=True):
        for src_layer, dst_layer in layers:
            src_layer_base, dst_layer_base = src_row[src_layer], dst_row[dst_layer]
            for src_first, dst_first, count in runs:
                local.append((src_layer_base + src_first * page_bytes, count * page_bytes))
                remote.append((dst_layer_base + dst_first * page_bytes, count * page_bytes))
    return local, remote


def compute_sliced_spans(
    src: KVLayout,
    *,
    src_bases: BaseTable,
    dst: KVLayout,
    dst_bases: BaseTable,
    layers: Sequence[tuple[int, int]],
    pages: Sequence[tuple[int, int]],
    plan: TransferPlan,
) -> tuple[list[Span], list[Span]]:
    """One descriptor per token x layer x part for the plan's head slice (token-major pages
    only: raises ValueError otherwise)."""
    if is_whole_heads(plan, src, dst):
        return compute_contiguous_spans(src, src_bases=src_bases, dst=dst, dst_bases=dst_bases,
                                        layers=layers, pages=pages)
    _check_token_major(src, dst)
    _check_tables(src, src_bases, "prefill")
    _check_tables(dst, dst_bases, "decode")
    head_bytes = src.bytes_per_token_per_head
    length = plan.heads.num_heads * head_bytes
    offsets = torch.arange(src.page_size, dtype=torch.int64)

    def addresses(
        layout: KVLayout, row: Sequence[int], layer_ids: list[int], page_ids: list[int],
        head: int,
    ) -> torch.Tensor:
        slots = (torch.tensor(page_ids, dtype=torch.int64)[:, None] * layout.page_size
                 + offsets[None, :]).reshape(1, -1)
        layer_bases = torch.tensor([row[layer] for layer in layer_ids], dtype=torch.int64)
        token_bytes = layout.bytes_per_token_per_layer
        return (layer_bases[:, None] + slots * token_bytes + head * head_bytes).reshape(-1)

    src_layers, dst_layers = [s for s, _ in layers], [d for _, d in layers]
    src_pages, dst_pages = [s for s, _ in pages], [d for _, d in pages]
    local: list[Span] = []
    remote: list[Span] = []
    for src_row, dst_row in zip(src_bases, dst_bases, strict=True):
        local_addr = addresses(src, src_row, src_layers, src_pages, plan.heads.src_head_offset)
        remote_addr = addresses(dst, dst_row, dst_layers, dst_pages, plan.heads.dst_head_offset)
        local.extend((address, length) for address in local_addr.tolist())
        remote.extend((address, length) for address in remote_addr.tolist())
    return local, remote
