"""Head-slice (TP), layer (PP) and per-pair transfer plans, with hand-derived expectations.

Unit tests: no NIXL, no GPU. Notation in the working: pN = prefill TP rank N, dN = decode TP
rank N, hN = global KV head N; a slice is (prefill, decode, src offset, dst offset, heads).
"""

from __future__ import annotations

import itertools

import pytest

from pd_transfer.errors import PlanError
from pd_transfer.kv.plan import (
    Attention,
    HeadRange,
    HeadSlice,
    KVGeometry,
    LayerRange,
    LayerSegment,
    Parallelism,
    RankCoord,
    compute_head_plan,
    compute_layer_plan,
    compute_local_heads,
    compute_sender_id,
    compute_stage_layers,
    compute_transfer_plan,
    compute_transfer_topology,
)


def slices_of(total: int, p: int, d: int, attention: Attention = Attention.MHA) -> list[
    list[tuple[int, int, int, int]]
]:
    """Per decode rank: (prefill rank, src offset, dst offset, heads)."""
    plan = compute_head_plan(total, p, d, attention)
    return [
        [(s.prefill_rank, s.src_head_offset, s.dst_head_offset, s.num_heads) for s in ranks]
        for ranks in plan.by_decode
    ]


def test_replicated_heads_use_integer_division_not_modulo() -> None:
    """Guards docs/failure-modes.md #13: with tp=4, H=2, modulo gives ranks heads 0,1,0,1 (wrong
    KV)."""
    # tp > H: rank r holds head r // (tp // H) = r // 2
    assert [compute_local_heads(2, 4, r) for r in range(4)] == [
        HeadRange(0, 1), HeadRange(0, 1), HeadRange(1, 1), HeadRange(1, 1),
    ]
    # tp <= H: rank r holds [r*H/tp, (r+1)*H/tp) = [2r, 2r+2) for H=8, tp=4
    assert [compute_local_heads(8, 4, r) for r in range(4)] == [
        HeadRange(0, 2), HeadRange(2, 2), HeadRange(4, 2), HeadRange(6, 2),
    ]


HEAD_CASES = [
    pytest.param(
        # H < P < D. p r holds h(r//2): p0,p1 -> h0; p2,p3 -> h1. d holds h(d//4).
        # consumers of h0: d0..d3 (k=0..3), replicas p0,p1 -> k%2: p0,p1,p0,p1; h1 likewise.
        2, 4, 8,
        [[(0, 0, 0, 1)], [(1, 0, 0, 1)], [(0, 0, 0, 1)], [(1, 0, 0, 1)],
         [(2, 0, 0, 1)], [(3, 0, 0, 1)], [(2, 0, 0, 1)], [(3, 0, 0, 1)]],
        id="H2-P4-D8",
    ),
    pytest.param(
        # P > D, P == H: p r holds h r; d holds [4d, 4d+4): four one-head writers each.
        8, 8, 2,
        [[(0, 0, 0, 1), (1, 0, 1, 1), (2, 0, 2, 1), (3, 0, 3, 1)],
         [(4, 0, 0, 1), (5, 0, 1, 1), (6, 0, 2, 1), (7, 0, 3, 1)]],
        id="H8-P8-D2",
    ),
    pytest.param(
        # P < D < H: p r holds [4r, 4r+4); d holds [2d, 2d+2).
        # d0 = h0,h1 = p0 offsets 0-1; d1 = h2,h3 = p0 offsets 2-3; d2, d3 likewise from p1.
        8, 2, 4,
        [[(0, 0, 0, 2)], [(0, 2, 0, 2)], [(1, 0, 0, 2)], [(1, 2, 0, 2)]],
        id="H8-P2-D4",
    ),
    pytest.param(
        # P == D: rank r to rank r, all of its two heads.
        8, 4, 4,
        [[(0, 0, 0, 2)], [(1, 0, 0, 2)], [(2, 0, 0, 2)], [(3, 0, 0, 2)]],
        id="H8-P4-D4",
    ),
    pytest.param(
        # D < H < P: p0..p3 hold h0, p4..p7 hold h1; d0 holds h0,h1; its only (k=0)
        # consumer slot takes replica 0 of each head: p0 -> dst 0, p4 -> dst 1.
        2, 8, 1,
        [[(0, 0, 0, 1), (4, 0, 1, 1)]],
        id="H2-P8-D1",
    ),
    pytest.param(
        # P < H < D: p0 holds h0,h1; p1 holds h2,h3; d holds h(d//2), no prefill replicas.
        # d0,d1 <- p0 off 0; d2,d3 <- p0 off 1; d4,d5 <- p1 off 0; d6,d7 <- p1 off 1.
        4, 2, 8,
        [[(0, 0, 0, 1)], [(0, 0, 0, 1)], [(0, 1, 0, 1)], [(0, 1, 0, 1)],
         [(1, 0, 0, 1)], [(1, 0, 0, 1)], [(1, 1, 0, 1)], [(1, 1, 0, 1)]],
        id="H4-P2-D8",
    ),
    pytest.param(
        # H < D < P: p r holds h(r//4); d holds h(d//2). h0: consumers d0,d1, replicas
        # p0..p3 -> d0<-p0, d1<-p1. h1: consumers d2,d3, replicas p4..p7 -> p4, p5.
        2, 8, 4,
        [[(0, 0, 0, 1)], [(1, 0, 0, 1)], [(4, 0, 0, 1)], [(5, 0, 0, 1)]],
        id="H2-P8-D4",
    ),
]


@pytest.mark.parametrize(("heads", "prefill_tp", "decode_tp", "expected"), HEAD_CASES)
def test_head_slices_match_hand_derivation(
    heads: int, prefill_tp: int, decode_tp: int, expected: list[list[tuple[int, int, int, int]]]
) -> None:
    assert slices_of(heads, prefill_tp, decode_tp) == expected


def test_both_views_agree_for_p4_d8_h2() -> None:
    plan = compute_head_plan(2, 4, 8)
    # from the H2-P4-D8 derivation: p0 -> d0, d2; p1 -> d1, d3; p2 -> d4, d6; p3 -> d5, d7
    assert [plan.targets(p) for p in range(4)] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert [plan.writers(d) for d in range(8)] == [(0,), (1,), (0,), (1,), (2,), (3,), (2,), (3,)]
    assert plan.max_writers_per_decode_rank == 1
    assert plan.slice_between(1, 3) == HeadSlice(1, 3, 0, 0, 1, 0)
    assert plan.slice_between(0, 1) is None


def test_mla_latent_comes_from_one_prefill_rank_spread_round_robin() -> None:
    # H = 1 on every rank; consumers of h0 are d0..d(D-1): d reads from replica d % P.
    assert slices_of(1, 2, 8, Attention.MLA) == [[(d % 2, 0, 0, 1)] for d in range(8)]
    assert slices_of(1, 4, 2, Attention.MLA) == [[(0, 0, 0, 1)], [(1, 0, 0, 1)]]
    with pytest.raises(PlanError, match="Set the model's KV head count to 1 for MLA"):
        compute_head_plan(8, 2, 2, Attention.MLA)


@pytest.mark.parametrize(("heads", "tp"), [(8, 3), (6, 4), (2, 3)])
def test_non_dividing_tp_is_rejected_with_the_fix(heads: int, tp: int) -> None:
    with pytest.raises(PlanError, match=f"divides {heads} or is a multiple of it"):
        compute_head_plan(heads, tp, 1)
    with pytest.raises(PlanError, match="decode tensor parallelism"):
        compute_head_plan(heads, 1, tp)


def test_every_topology_delivers_each_head_exactly_once_with_minimal_sender_load() -> None:
    """Invariant over all divisible (H, P, D) up to 32: decode rank d receives each of its
    global heads exactly once from a prefill rank that holds it, at the right offsets; no
    prefill rank serves a head to more than ceil(consumers / replicas) decode ranks."""
    sizes = [1, 2, 4, 8, 16, 32]
    for heads, p, d in itertools.product([1, 2, 4, 8, 16], sizes, sizes):
        plan = compute_head_plan(heads, p, d)
        served: dict[tuple[int, int], int] = {}
        for rank in range(d):
            mine = compute_local_heads(heads, d, rank)
            received: list[int] = []
            for s in plan.by_decode[rank]:
                src = compute_local_heads(heads, p, s.prefill_rank)
                for i in range(s.num_heads):
                    head = s.global_head_start + i
                    assert src.start + s.src_head_offset + i == head
                    assert mine.start + s.dst_head_offset + i == head
                    received.append(head)
                    served[(s.prefill_rank, head)] = served.get((s.prefill_rank, head), 0) + 1
            assert sorted(received) == list(range(mine.start, mine.stop)), (heads, p, d, rank)
        replicas = max(1, p // heads)
        consumers = max(1, d // heads)
        assert max(served.values()) == -(-consumers // replicas), (heads, p, d)
        assert sum(len(v) for v in plan.by_prefill) == sum(len(v) for v in plan.by_decode)


def test_stage_layers_and_uneven_split() -> None:
    # L=80, pp=4: stage s holds [20s, 20s+20)
    assert compute_stage_layers(80, 4, 3) == LayerRange(60, 80)
    with pytest.raises(PlanError, match="Choose a pipeline parallelism that divides 30"):
        compute_stage_layers(30, 4, 0)
    with pytest.raises(PlanError, match="divides 30"):
        compute_layer_plan(30, 1, 4)


def test_layer_plan_prefill_pp_to_decode_pp() -> None:
    # L=8, prefill pp=2: [0,4), [4,8); decode pp=4: [0,2), [2,4), [4,6), [6,8)
    plan = compute_layer_plan(8, 2, 4)
    assert plan.segments == (
        LayerSegment(0, 0, LayerRange(0, 2)),
        LayerSegment(0, 1, LayerRange(2, 4)),
        LayerSegment(1, 2, LayerRange(4, 6)),
        LayerSegment(1, 3, LayerRange(6, 8)),
    )
    # the usual case: prefill pp=4 into decode pp=1, stage s sends [2s, 2s+2)
    assert [seg.layers for seg in compute_layer_plan(8, 4, 1).segments] == [
        LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 6), LayerRange(6, 8),
    ]
    assert compute_layer_plan(8, 2, 4).segment_between(0, 2) is None


def test_sender_ids_are_unique_over_the_pp_tp_grid() -> None:
    """Guards docs/failure-modes.md #14: a TP rank alone repeats across stages."""
    grid = Parallelism(tp=4, pp=3)
    ids = [compute_sender_id(RankCoord(s, r), grid) for s in range(3) for r in range(4)]
    assert ids == list(range(12))  # pp_rank * 4 + tp_rank
    assert compute_sender_id(RankCoord(1, 3), Parallelism(tp=4, pp=2)) == 7  # 1*4 + 3
    with pytest.raises(PlanError, match="outside the grid"):
        compute_sender_id(RankCoord(0, 4), grid)


def test_transfer_plan_combines_pp_and_tp() -> None:
    """L=8, H=2, head_dim 128, bf16; prefill tp=4 pp=2 into decode tp=8 pp=1."""
    geometry = KVGeometry(num_layers=8, total_kv_heads=2, head_dim=128, element_size_bytes=2)
    prefill, decode = Parallelism(tp=4, pp=2), Parallelism(tp=8, pp=1)
    # prefill (1, 3) holds head 3//2 = 1 and layers [4, 8); decode (0, 7) holds head 7//4 = 1,
    # it is h1's consumer k=3 of d4..d7, replicas p2, p3 -> 3 % 2 = 1 -> p3. So they pair.
    plan = compute_transfer_plan(geometry, prefill, decode, RankCoord(1, 3), RankCoord(0, 7))
    assert plan is not None
    assert plan.sender_id == 7  # 1*4 + 3
    assert plan.receiver_id == 7  # 0*8 + 7
    assert plan.layers == LayerRange(4, 8)
    assert (plan.src_layer_start, plan.dst_layer_start) == (0, 4)
    assert plan.heads == HeadSlice(3, 7, 0, 0, 1, 1)
    assert plan.bytes_per_token_per_layer == 256  # 1 head x 128 x 2 B
    assert plan.bytes_per_token == 2048  # 2 parts x 4 layers x 256
    # decode (0, 6) is h1's consumer k=2 -> replica 0 = p2: nothing from p3.
    assert compute_transfer_plan(
        geometry, prefill, decode, RankCoord(1, 3), RankCoord(0, 6)
    ) is None

    topology = compute_transfer_topology(geometry, prefill, decode)
    # 8 decode ranks x one writer per stage x 2 stages
    assert len(topology.plans) == 16
    assert topology.max_writers_per_decode_rank == 2
    assert {p.sender_id for p in topology.plans_into(RankCoord(0, 7))} == {3, 7}  # p3 each stage
    assert [p.decode.tp_rank for p in topology.plans_from(RankCoord(0, 0))] == [0, 2]


def test_mla_transfer_plan_has_one_part() -> None:
    geometry = KVGeometry(num_layers=4, total_kv_heads=1, head_dim=576, element_size_bytes=2,
                          attention=Attention.MLA)
    topology = compute_transfer_topology(geometry, Parallelism(tp=2), Parallelism(tp=4))
    # decode d reads the latent from prefill d % 2; 1 part x 4 layers x 576 x 2 B = 4608
    assert [(p.prefill.tp_rank, p.decode.tp_rank) for p in topology.plans] == [
        (0, 0), (1, 1), (0, 2), (1, 3),
    ]
    assert {p.bytes_per_token for p in topology.plans} == {4608}


def test_a_topology_is_computed_once_per_geometry_and_parallelism() -> None:
    """Decode plans every request with it: the same triple is the same (frozen) object, and a
    geometry that differs in any field (here attention alone) gets its own."""
    mha = KVGeometry(num_layers=4, total_kv_heads=1, head_dim=576, element_size_bytes=2)
    mla = KVGeometry(num_layers=4, total_kv_heads=1, head_dim=576, element_size_bytes=2,
                     attention=Attention.MLA)
    first = compute_transfer_topology(mha, Parallelism(tp=2), Parallelism(tp=4))
    again = compute_transfer_topology(KVGeometry(4, 1, 576, 2), Parallelism(2), Parallelism(4))
    assert again is first
    other = compute_transfer_topology(mla, Parallelism(tp=2), Parallelism(tp=4))
    assert {p.num_parts for p in first.plans} == {2} and {p.num_parts for p in other.plans} == {1}
    with pytest.raises(AttributeError):
        first.plans = ()  # type: ignore[misc]
