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

from pd_transfer.kv.layout import KVPart
from pd_transfer.kv.plan import (
    KVGeometry,
    Parallelism,
    RankCoord,
    compute_local_heads,
    compute_stage_layers,
)
from pd_transfer.kv.pool import KVPool

__all__ = ["compute_request_source", "fill_pool", "verify_pool"]


def compute_request_source(seed: int, geometry: KVGeometry, num_slots: int) -> torch.Tensor:
    """``[num_layers, num_parts, num_slots, total_kv_heads, head_bytes]`` seeded bytes."""
    generator = torch.Generator().manual_seed(seed)
    shape = (geometry.num_layers, geometry.num_parts, num_slots, geometry.total_kv_heads,
             geometry.head_dim * geometry.element_size_bytes)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


def _rank_share(
    pool: KVPool, geometry: KVGeometry, parallelism: Parallelism, coord: RankCoord,
    source: torch.Tensor,
) -> tuple[list[KVPart], torch.Tensor]:
    """The pool's logical parts (K, V) and the slice of ``source`` this rank holds:
    ``[local_layers, parts, slots, local_heads, head_bytes]``."""
    stage = compute_stage_layers(geometry.num_layers, parallelism.pp, coord.pp_rank)
    heads = compute_local_heads(geometry.total_kv_heads, parallelism.tp, coord.tp_rank)
    parts = [KVPart.K, KVPart.V] if pool.layout.has_v else [KVPart.K]
    return parts, source[stage.start : stage.stop, :, :, heads.start : heads.stop]


def fill_pool(
    pool: KVPool,
    *,
    geometry: KVGeometry, parallelism: Parallelism, coord: RankCoord,
    pages: Sequence[int], source: torch.Tensor,
) -> None:
    """Write this rank's share of ``source`` into ``pages`` of ``pool`` (whole pages)."""
    parts, mine = _rank_share(pool, geometry, parallelism, coord, source)
    layout = pool.layout
    index = torch.tensor(list(pages), dtype=torch.int64, device=pool.device)
    shape = (len(index), layout.page_size, layout.kv_heads, -1)
    for layer in range(layout.num_layers):
        for part_index, part in enumerate(parts):
            values = mine[layer, part_index, : len(index) * layout.page_size]
            pool.token_bytes(part, layer)[index] = values.reshape(shape).to(pool.device)


def verify_pool(
    pool: KVPool,
    *,
    geometry: KVGeometry, parallelism: Parallelism, coord: RankCoord,
    pages: Sequence[int], source: torch.Tensor, num_tokens: int,
) -> bool:
    """Whether the first ``num_tokens`` tokens in ``pages`` hold exactly this rank's share."""
    parts, mine = _rank_share(pool, geometry, parallelism, coord, source)
    layout = pool.layout
    index = torch.tensor(list(pages), dtype=torch.int64, device=pool.device)
    for layer in range(layout.num_layers):
        for part_index, part in enumerate(parts):
            held = pool.token_bytes(part, layer)[index].reshape(
                -1, layout.kv_heads, layout.head_dim * layout.dtype.itemsize)
            if not torch.equal(held[:num_tokens].cpu(), mine[layer, part_index, :num_tokens]):
                return False
    return True
