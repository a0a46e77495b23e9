"""Who sends which KV heads and layers to whom: plans computed once per peer, as data.

Read this first for ``prefill TP != decode TP`` or PP work. Everything here is integer
arithmetic on the parallel configuration; the hot path only reads the frozen results.

Heads (tensor parallelism, MHA/GQA with ``H`` KV heads over ``tp`` ranks):

- ``tp <= H`` (``tp`` divides ``H``): rank ``r`` holds heads ``[r*H/tp, (r+1)*H/tp)``.
- ``tp > H`` (``H`` divides ``tp``): heads are replicated ``tp/H`` times and rank ``r`` holds
  exactly one head, ``r // (tp // H)``. Integer division, never modulo: with modulo, ranks
  0 and 1 of tp=4, H=2 would hold heads 0 and 1 instead of 0 and 0 (a public bug that
  delivered the wrong heads).

Replica choice (the rule that spreads the sending load): for each global head ``h``, list
the prefill ranks holding ``h`` (its replicas, ascending) and the decode ranks needing ``h``
(its consumers, ascending). The ``k``-th consumer reads ``h`` from replica ``k mod R`` where
``R`` is the replica count. Every decode rank thus receives each of its heads exactly once,
and no prefill rank serves more than ``ceil(consumers/R)`` decode ranks for a head, which is
the least possible. Consecutive heads from the same prefill rank merge into one slice; a
(prefill rank, decode rank) pair never needs more than one slice (both sides hold contiguous
head blocks), which the construction asserts.

MLA: one latent "head" replicated on every rank (``H = 1``); the rule above makes decode rank
``d`` read it from prefill rank ``d mod P``.

Layers (pipeline parallelism): stage ``s`` of ``pp`` holds layers ``[s*L/pp, (s+1)*L/pp)``;
a prefill stage sends to a decode stage the intersection of their layer ranges.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from pd_transfer.errors import PlanError

__all__ = [
    "Attention",
    "HeadPlan",
    "HeadRange",
    "HeadSlice",
    "KVGeometry",
    "LayerPlan",
    "LayerRange",
    "LayerSegment",
    "Parallelism",
    "RankCoord",
    "TransferPlan",
    "TransferTopology",
    "compute_head_plan",
    "compute_layer_plan",
    "compute_local_heads",
    "compute_sender_id",
    "compute_stage_layers",
    "compute_transfer_plan",
    "compute_transfer_topology",
]


class Attention(enum.Enum):
    MHA = "MHA"  # also GQA/MQA: K and V pools, H KV heads
    MLA = "MLA"  # one latent per token, replicated on every TP rank, no V pool


@dataclass(frozen=True)
class HeadRange:
    """Global KV heads ``[start, start + count)``."""

    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count


@dataclass(frozen=True)
class HeadSlice:
    """``num_heads`` heads that prefill rank ``prefill_rank`` writes into ``decode_rank``.

    ``src_head_offset`` indexes the prefill rank's local heads, ``dst_head_offset`` the decode
    rank's local heads; ``global_head_start`` is the model-wide id of the first head.
    """

    prefill_rank: int
    decode_rank: int
    src_head_offset: int
    dst_head_offset: int
    num_heads: int
    global_head_start: int


@dataclass(frozen=True)
class HeadPlan:
    """The head slices between every prefill TP rank and every decode TP rank.

    ``by_decode[d]`` lists, by ``dst_head_offset``, the slices written into decode rank
    ``d``; they cover its local heads exactly once. ``by_prefill[p]`` lists, by decode rank,
    the slices prefill rank ``p`` sends (empty for a replica that serves nobody).
    """

    total_kv_heads: int
    prefill_tp: int
    decode_tp: int
    by_decode: tuple[tuple[HeadSlice, ...], ...]
    by_prefill: tuple[tuple[HeadSlice, ...], ...]

    def writers(self, decode_rank: int) -> tuple[int, ...]:
        """Prefill TP ranks that write into ``decode_rank`` (sizes its staging)."""
        return tuple(s.prefill_rank for s in self.by_decode[decode_rank])

    def targets(self, prefill_rank: int) -> tuple[int, ...]:
        """Decode TP ranks that ``prefill_rank`` sends to."""
        return tuple(s.decode_rank for s in self.by_prefill[prefill_rank])

    @property
    def max_writers_per_decode_rank(self) -> int:
        return max(len(slices) for slices in self.by_decode)

    def slice_between(self, prefill_rank: int, decode_rank: int) -> HeadSlice | None:
        """The one slice from ``prefill_rank`` to ``decode_rank``, or None if they pair not."""
        for head_slice in self.by_decode[decode_rank]:
            if head_slice.prefill_rank == prefill_rank:
                return head_slice
        return None


def _check_tp(total_kv_heads: int, tp: int, side: str) -> None:
    if total_kv_heads <= 0 or tp <= 0:
        raise PlanError(
            f"{side} TP size ({tp}) and KV head count ({total_kv_heads}) must be positive"
        )
    if total_kv_heads % tp and tp % total_kv_heads:
        raise PlanError(
            f"{side} TP size {tp} and the model's {total_kv_heads} KV heads: one must divide "
            f"the other. Choose a {side} tensor parallelism that divides {total_kv_heads} "
            f"or is a multiple of it."
        )


def compute_local_heads(total_kv_heads: int, tp: int, tp_rank: int) -> HeadRange:
    """The global KV heads TP rank ``tp_rank`` of ``tp`` holds (module docstring's rule)."""
    _check_tp(total_kv_heads, tp, "the")
    if not 0 <= tp_rank < tp:
        raise PlanError(f"TP rank {tp_rank} outside [0, {tp})")
    if tp <= total_kv_heads:
        per_rank = total_kv_heads // tp
        return HeadRange(tp_rank * per_rank, per_rank)
    # Replicated: tp // H consecutive ranks share one head. Integer division, not modulo.
    return HeadRange(tp_rank // (tp // total_kv_heads), 1)


def compute_head_plan(
    total_kv_heads: int,
    prefill_tp: int,
    decode_tp: int,
    attention: Attention = Attention.MHA,
) -> HeadPlan:
    """Head slices for prefill TP ``prefill_tp`` → decode TP ``decode_tp`` (see module doc).

    Raises PlanError when a TP size and the head count do not divide one another, or when an
    MLA model is given more than one KV head.
    """
    if attention is Attention.MLA and total_kv_heads != 1:
        raise PlanError(
            f"MLA keeps one latent head replicated on every rank, got {total_kv_heads} KV "
            f"heads. Set the model's KV head count to 1 for MLA."
        )
    _check_tp(total_kv_heads, prefill_tp, "prefill")
    _check_tp(total_kv_heads, decode_tp, "decode")
    prefill_heads = [compute_local_heads(total_kv_heads, prefill_tp, p) for p in range(prefill_tp)]
    decode_heads = [compute_local_heads(total_kv_heads, decode_tp, d) for d in range(decode_tp)]
    replicas = [
        [p for p in range(prefill_tp) if prefill_heads[p].start <= h < prefill_heads[p].stop]
        for h in range(total_kv_heads)
    ]
    consumers = [
        [d for d in range(decode_tp) if decode_heads[d].start <= h < decode_heads[d].stop]
        for h in range(total_kv_heads)
    ]

    by_decode: list[tuple[HeadSlice, ...]] = []
    for d in range(decode_tp):
        slices: list[HeadSlice] = []
        mine = decode_heads[d]
        for h in range(mine.start, mine.stop):
            k = consumers[h].index(d)
            src = replicas[h][k % len(replicas[h])]
            src_off = h - prefill_heads[src].start
            dst_off = h - mine.start
            last = slices[-1] if slices else None
            if (
                last is not None
                and last.prefill_rank == src
                and last.src_head_offset + last.num_heads == src_off
                and last.dst_head_offset + last.num_heads == dst_off
            ):
                slices[-1] = HeadSlice(
                    src, d, last.src_head_offset, last.dst_head_offset,
                    last.num_heads + 1, last.global_head_start,
                )
            else:
                slices.append(HeadSlice(src, d, src_off, dst_off, 1, h))
        senders = [s.prefill_rank for s in slices]
        # Both sides hold contiguous head blocks, so one pair never needs two slices.
        assert len(senders) == len(set(senders)), f"decode rank {d}: split slices {slices}"
        by_decode.append(tuple(slices))

    by_prefill = tuple(
        tuple(s for slices in by_decode for s in slices if s.prefill_rank == p)
        for p in range(prefill_tp)
    )
    return HeadPlan(total_kv_heads, prefill_tp, decode_tp, tuple(by_decode), by_prefill)


@dataclass(frozen=True)
class LayerRange:
    """Global layers ``[start, stop)``."""

    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start


def compute_stage_layers(num_layers: int, pp: int, stage: int) -> LayerRange:
    """Layers held by PP stage ``stage`` of ``pp``: ``[s*L/pp, (s+1)*L/pp)``."""
    if pp <= 0 or num_layers <= 0 or num_layers % pp:
        raise PlanError(
            f"{num_layers} layers cannot be split evenly over {pp} pipeline stages. "
            f"Choose a pipeline parallelism that divides {num_layers}."
        )
    if not 0 <= stage < pp:
        raise PlanError(f"PP stage {stage} outside [0, {pp})")
    per_stage = num_layers // pp
    return LayerRange(stage * per_stage, (stage + 1) * per_stage)


@dataclass(frozen=True)
class LayerSegment:
    """Layers ``layers`` go from prefill PP stage ``prefill_stage`` to ``decode_stage``."""

    prefill_stage: int
    decode_stage: int
    layers: LayerRange


@dataclass(frozen=True)
class LayerPlan:
    """Every (prefill stage, decode stage) pair that shares layers, ordered by layer."""

    num_layers: int
    prefill_pp: int
    decode_pp: int
    segments: tuple[LayerSegment, ...]

    def segment_between(self, prefill_stage: int, decode_stage: int) -> LayerSegment | None:
        for segment in self.segments:
            if (segment.prefill_stage, segment.decode_stage) == (prefill_stage, decode_stage):
                return segment
        return None


def compute_layer_plan(num_layers: int, prefill_pp: int, decode_pp: int) -> LayerPlan:
    """Intersect prefill and decode stage layer ranges; raises PlanError if uneven."""
    compute_stage_layers(num_layers, prefill_pp, 0)  # validates: raises PlanError if uneven
    compute_stage_layers(num_layers, decode_pp, 0)
    segments: list[LayerSegment] = []
    for ps in range(prefill_pp):
        src = compute_stage_layers(num_layers, prefill_pp, ps)
        for ds in range(decode_pp):
            dst = compute_stage_layers(num_layers, decode_pp, ds)
            start, stop = max(src.start, dst.start), min(src.stop, dst.stop)
            if start < stop:
                segments.append(LayerSegment(ps, ds, LayerRange(start, stop)))
    return LayerPlan(num_layers, prefill_pp, decode_pp, tuple(segments))


@dataclass(frozen=True)
class Parallelism:
    """One role's parallel configuration: ``tp`` ranks per stage, ``pp`` stages."""

    tp: int
    pp: int = 1


@dataclass(frozen=True)
class RankCoord:
    """A rank on the PP x TP grid of one role."""

    pp_rank: int
    tp_rank: int


def compute_sender_id(coord: RankCoord, parallelism: Parallelism) -> int:
    """``pp_rank * tp + tp_rank``: unique over the whole PP x TP grid.

    A TP rank alone is not unique once PP > 1: two stages' rank 0 would share an id and their
    notifications would be counted as one writer.
    """
    if not 0 <= coord.tp_rank < parallelism.tp or not 0 <= coord.pp_rank < parallelism.pp:
        raise PlanError(f"rank {coord} outside the grid pp={parallelism.pp} x tp={parallelism.tp}")
    return coord.pp_rank * parallelism.tp + coord.tp_rank


@dataclass(frozen=True)
class KVGeometry:
    """The model's KV geometry (whole model, not per rank)."""

    num_layers: int
    total_kv_heads: int
    head_dim: int
    element_size_bytes: int
    attention: Attention = Attention.MHA

    @property
    def num_parts(self) -> int:
        """K and V for MHA, the latent alone for MLA."""
        return 2 if self.attention is Attention.MHA else 1


@dataclass(frozen=True)
class TransferPlan:
    """What one prefill rank sends to one decode rank: layers x one head slice.

    Layer indices: ``layers`` is global; ``src_layer_start``/``dst_layer_start`` are where
    that range starts in the prefill and decode pools (each holds only its stage's layers).
    """

    sender_id: int
    receiver_id: int
    prefill: RankCoord
    decode: RankCoord
    layers: LayerRange
    src_layer_start: int
    dst_layer_start: int
    heads: HeadSlice
    num_parts: int
    bytes_per_token_per_head: int

    @property
    def bytes_per_token_per_layer(self) -> int:
        """One token, one layer, one part, the slice's heads."""
        return self.heads.num_heads * self.bytes_per_token_per_head

    @property
    def bytes_per_token(self) -> int:
        """One token over every part and layer of the plan: what staging needs per token."""
        return self.num_parts * self.layers.count * self.bytes_per_token_per_layer


def compute_transfer_plan(
    geometry: KVGeometry,
    prefill: Parallelism,
    decode: Parallelism,
    prefill_rank: RankCoord,
    decode_rank: RankCoord,
) -> TransferPlan | None:
    """The plan for one (prefill rank, decode rank) pair, or None if they exchange nothing."""
    return compute_transfer_topology(geometry, prefill, decode).plan_between(
        prefill_rank, decode_rank
    )


@dataclass(frozen=True)
class TransferTopology:
    """Every non-empty TransferPlan between a prefill and a decode deployment."""

    heads: HeadPlan
    layers: LayerPlan
    plans: tuple[TransferPlan, ...]

    def plans_from(self, prefill_rank: RankCoord) -> tuple[TransferPlan, ...]:
        return tuple(p for p in self.plans if p.prefill == prefill_rank)

    def plans_into(self, decode_rank: RankCoord) -> tuple[TransferPlan, ...]:
        return tuple(p for p in self.plans if p.decode == decode_rank)

    def plan_between(self, prefill_rank: RankCoord, decode_rank: RankCoord) -> TransferPlan | None:
        for plan in self.plans:
            if plan.prefill == prefill_rank and plan.decode == decode_rank:
                return plan
        return None

    @property
    def max_writers_per_decode_rank(self) -> int:
        """Most sender ids writing into one decode rank: staging must fit that many chunks."""
        counts: dict[RankCoord, int] = {}
        for plan in self.plans:
            counts[plan.decode] = counts.get(plan.decode, 0) + 1
        return max(counts.values())


# A process meets a few (geometry, prefill, decode) triples, and decode asks for each
# request's: every part of a topology is frozen, so one object serves them all.
@functools.lru_cache(maxsize=64)
def compute_transfer_topology(
    geometry: KVGeometry, prefill: Parallelism, decode: Parallelism
) -> TransferTopology:
    """Combine the head plan (TP) and the layer plan (PP) into per-pair TransferPlans."""
    head_plan = compute_head_plan(
        geometry.total_kv_heads, prefill.tp, decode.tp, geometry.attention
    )
    layer_plan = compute_layer_plan(geometry.num_layers, prefill.pp, decode.pp)
    plans: list[TransferPlan] = []
    for segment in layer_plan.segments:
        src_stage = compute_stage_layers(geometry.num_layers, prefill.pp, segment.prefill_stage)
        dst_stage = compute_stage_layers(geometry.num_layers, decode.pp, segment.decode_stage)
        for slices in head_plan.by_decode:
            for head_slice in slices:
                src = RankCoord(segment.prefill_stage, head_slice.prefill_rank)
                dst = RankCoord(segment.decode_stage, head_slice.decode_rank)
                plans.append(
                    TransferPlan(
                        sender_id=compute_sender_id(src, prefill),
                        receiver_id=compute_sender_id(dst, decode),
                        prefill=src,
                        decode=dst,
                        layers=segment.layers,
                        src_layer_start=segment.layers.start - src_stage.start,
                        dst_layer_start=segment.layers.start - dst_stage.start,
                        heads=head_slice,
                        num_parts=geometry.num_parts,
                        bytes_per_token_per_head=geometry.head_dim * geometry.element_size_bytes,
                    )
                )
    return TransferTopology(head_plan, layer_plan, tuple(plans))
