"""Seeded request KV for self-tests: fill prefill pools, and check decode pools bit-exactly.

The expected bytes are computed from first principles, independently of the transfer code
path: a request's KV is one seeded random byte array indexed by (global layer, part, token,
global head); a rank holds the layers of its PP stage and the heads ``compute_local_heads``
gives its TP rank (replicas of a head hold identical bytes, as in a real TP group). Decode
is then correct iff every local head of every local layer at every destination token equals
that array, whichever prefill rank sent it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pd_transfer.layout import KVPool
from pd_transfer.plan import (
    KVGeometry,
    Parallelism,
    RankCoord,
    compute_local_heads,
    compute_stage_layers,
)

__all__ = ["compute_request_source", "fill_pool", "verify_pool"]


def compute_request_source(seed: int, geometry: KVGeometry, num_slots: int) -> torch.Tensor:
    """``[num_layers, num_parts, num_slots, total_kv_heads, head_bytes]`` seeded bytes."""
    generator = torch.Generator().manual_seed(seed)
    shape = (geometry.num_layers, geometry.num_parts, num_slots, geometry.total_kv_heads,
             geometry.head_dim * geometry.element_size_bytes)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


def _rank_view(
    pool: KVPool, geometry: KVGeometry, parallelism: Parallelism, coord: RankCoord,
    pages: Sequence[int],
) -> tuple[list[torch.Tensor], torch.Tensor, range, range]:
    layout = pool.layout
    slots = pool.pages_to_tokens(list(pages)).cpu()
    stage = compute_stage_layers(geometry.num_layers, parallelism.pp, coord.pp_rank)
    heads = compute_local_heads(geometry.total_kv_heads, parallelism.tp, coord.tp_rank)
    views = [
        t.view(torch.uint8).view(layout.num_layers, layout.num_tokens, layout.kv_heads, -1)
        for t in pool.tensors()
    ]
    return views, slots, range(stage.start, stage.stop), range(heads.start, heads.stop)


def fill_pool(
    pool: KVPool,
    *,
    geometry: KVGeometry, parallelism: Parallelism, coord: RankCoord,
    pages: Sequence[int], source: torch.Tensor,
) -> None:
    """Write this rank's share of ``source`` into ``pages`` of ``pool`` (whole pages)."""
    views, slots, layers, heads = _rank_view(pool, geometry, parallelism, coord, pages)
    mine = source[layers.start : layers.stop, :, : len(slots), heads.start : heads.stop]
    device_slots = slots.to(pool.device)
    for part, view in enumerate(views):
        view[:, device_slots] = mine[:, part].to(pool.device)


def verify_pool(
    pool: KVPool,
    *,
    geometry: KVGeometry, parallelism: Parallelism, coord: RankCoord,
    pages: Sequence[int], source: torch.Tensor, num_tokens: int,
) -> bool:
    """Whether the first ``num_tokens`` tokens in ``pages`` hold exactly this rank's share."""
    views, slots, layers, heads = _rank_view(pool, geometry, parallelism, coord, pages)
    slots = slots[:num_tokens]
    expected = source[layers.start : layers.stop, :, :num_tokens, heads.start : heads.stop]
    return all(
        torch.equal(view[:, slots.to(pool.device)].cpu(), expected[:, part])
        for part, view in enumerate(views)
    )
