"""Descriptor arithmetic of the three send paths, and the choice between them.

- contiguous: the pair's head slice is every local head on both sides, so one page of one
  layer is one contiguous range on both sides: one descriptor per run of pages consecutive
  on BOTH sides, per layer, per K/V.
- sliced: one descriptor per token per layer per K/V (a head slice of one token's row is
  contiguous, of a page is not). The no-staging fallback; descriptor-bound.
- staged: no descriptors here; ``staging.gather``/``scatter`` pack the slice into one
  contiguous region that travels as ONE descriptor.

Pure functions over layouts, base addresses and page lists; the results are ``Span`` lists
for ``Transport.write``, which still checks every span against registered regions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from pd_transfer.bootstrap import DTYPES, RankDocument
from pd_transfer.layout import KVLayout
from pd_transfer.plan import Attention, TransferPlan, compute_local_heads
from pd_transfer.protocol.messages import Path
from pd_transfer.transport.base import Span

__all__ = [
    "PathMode",
    "choose_path",
    "compute_contiguous_spans",
    "compute_layout",
    "compute_sliced_spans",
    "is_whole_heads",
]

PathMode = Literal["auto", "staged", "sliced", "contiguous"]


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
    )


def is_whole_heads(plan: TransferPlan, src: KVLayout, dst: KVLayout) -> bool:
    """Whether the pair moves every local head of both ranks (pages are then contiguous)."""
    return plan.heads.num_heads == src.kv_heads == dst.kv_heads


def choose_path(mode: PathMode, plan: TransferPlan, src: KVLayout, dst: KVLayout) -> Path:
    """``auto``: contiguous for whole heads on both sides, else staged. Raises ValueError
    for ``contiguous`` when the head split differs (it cannot be contiguous)."""
    whole = is_whole_heads(plan, src, dst)
    if mode == "auto":
        return "contiguous" if whole else "staged"
    if mode == "contiguous" and not whole:
        raise ValueError(
            f"path 'contiguous' needs the same whole local heads on both ranks, but prefill "
            f"rank {plan.prefill} sends {plan.heads.num_heads} of its {src.kv_heads} heads "
            f"into {dst.kv_heads} on decode rank {plan.decode}; use 'staged' or 'auto'"
        )
    return mode


def _joint_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_first, dst_first, count)`` runs consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_pages, dst_pages, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def compute_contiguous_spans(
    src: KVLayout,
    *,
    src_bases: Sequence[int],
    dst: KVLayout,
    dst_bases: Sequence[int],
    layers: Sequence[tuple[int, int]],
    pages: Sequence[tuple[int, int]],
) -> tuple[list[Span], list[Span]]:
    """Whole pages: ``layers`` and ``pages`` are (src, dst) pairs of local indices."""
    if src.page_bytes_per_layer != dst.page_bytes_per_layer:
        raise ValueError(
            f"contiguous path: page sizes differ ({src.page_bytes_per_layer} vs "
            f"{dst.page_bytes_per_layer} bytes per layer)"
        )
    page_bytes = src.page_bytes_per_layer
    runs = _joint_runs([p for p, _ in pages], [p for _, p in pages])
    local: list[Span] = []
    remote: list[Span] = []
    for src_base, dst_base in zip(src_bases, dst_bases, strict=True):
        for src_layer, dst_layer in layers:
            src_layer_base = src_base + src_layer * src.layer_bytes
            dst_layer_base = dst_base + dst_layer * dst.layer_bytes
            for src_first, dst_first, count in runs:
                local.append((src_layer_base + src_first * page_bytes, count * page_bytes))
                remote.append((dst_layer_base + dst_first * page_bytes, count * page_bytes))
    return local, remote


def compute_sliced_spans(
    src: KVLayout,
    *,
    src_bases: Sequence[int],
    dst: KVLayout,
    dst_bases: Sequence[int],
    layers: Sequence[tuple[int, int]],
    pages: Sequence[tuple[int, int]],
    plan: TransferPlan,
) -> tuple[list[Span], list[Span]]:
    """One descriptor per token x layer x part for the plan's head slice."""
    if is_whole_heads(plan, src, dst):
        return compute_contiguous_spans(src, src_bases=src_bases, dst=dst, dst_bases=dst_bases,
                                        layers=layers, pages=pages)
    head_bytes = src.bytes_per_token_per_head
    length = plan.heads.num_heads * head_bytes
    offsets = torch.arange(src.page_size, dtype=torch.int64)

    def addresses(
        layout: KVLayout, base: int, layer_ids: list[int], page_ids: list[int], head: int
    ) -> torch.Tensor:
        slots = (torch.tensor(page_ids, dtype=torch.int64)[:, None] * layout.page_size
                 + offsets[None, :]).reshape(1, -1)
        layer_t = torch.tensor(layer_ids, dtype=torch.int64)[:, None]
        rows = layer_t * layout.num_tokens + slots
        return (base + (rows * layout.kv_heads + head) * head_bytes).reshape(-1)

    src_layers, dst_layers = [s for s, _ in layers], [d for _, d in layers]
    src_pages, dst_pages = [s for s, _ in pages], [d for _, d in pages]
    local: list[Span] = []
    remote: list[Span] = []
    for src_base, dst_base in zip(src_bases, dst_bases, strict=True):
        local_addr = addresses(src, src_base, src_layers, src_pages, plan.heads.src_head_offset)
        remote_addr = addresses(dst, dst_base, dst_layers, dst_pages, plan.heads.dst_head_offset)
        local.extend((address, length) for address in local_addr.tolist())
        remote.extend((address, length) for address in remote_addr.tolist())
    return local, remote
