"""The reference model's paged KV: written where the page table says, sharded like a TP
engine's, and read back by decode exactly as dense attention would (no NIXL, no GPU)."""

from __future__ import annotations

import pytest
import torch

from pd_transfer.kv.layout import KVPart
from pd_transfer.kv.pool import KVPool
from pd_transfer.reference.model import (
    ChunkForward,
    GraphedChunkForward,
    ModelConfig,
    ReferenceModel,
)

CONFIG = ModelConfig(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                     intermediate_size=96, vocab_size=97)
PAGE = 4
NUM_TOKENS = 23  # 6 pages, the last one partial
# Deliberately scattered and out of order: a bug that writes token-contiguously would fail.
PAGE_TABLE = (9, 2, 14, 5, 0, 11, 7)


def tokens(n: int = NUM_TOKENS + 1, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def slots(n: int) -> torch.Tensor:
    """Pool slot of each of the first ``n`` tokens under PAGE_TABLE (worked by hand)."""
    return torch.tensor([PAGE_TABLE[t // PAGE] * PAGE + t % PAGE for t in range(n)])


def test_shapes_and_layouts() -> None:
    model = ReferenceModel(CONFIG, tp_size=2)
    pools = model.allocate_pools(16, PAGE)
    assert [p.layout.kv_heads for p in pools] == [1, 1]
    assert pools[0].k.shape == (3, 64, 1, 16)
    ids = tokens(5)
    hidden = model.forward_layers(model.embed(ids), range(0, 2), pools=pools,
                                  page_table=PAGE_TABLE, start_pos=0)
    assert hidden.shape == (5, 64)
    assert model.logits(hidden).shape == (5, 97)
    with pytest.raises(ValueError, match="page table"):
        model.forward_layers(model.embed(tokens(30)), range(3), pools=pools,
                             page_table=PAGE_TABLE[:2], start_pos=0)
    with pytest.raises(ValueError, match="tp_size"):
        ReferenceModel(CONFIG, tp_size=3)


def test_paged_kv_write_equals_dense_reference() -> None:
    """Every token's K and V land at ``page_table[t // page] * page + t % page``, equal to
    the dense forward's; no other slot is touched."""
    model = ReferenceModel(CONFIG)
    (pool,) = model.allocate_pools(16, PAGE)
    ids = tokens()
    model.prefill(ids[:NUM_TOKENS], pools=(pool,), page_table=PAGE_TABLE)
    _, dense_k, dense_v = model.dense_forward(ids[:NUM_TOKENS])
    used = slots(NUM_TOKENS)
    for layer in range(CONFIG.num_layers):
        torch.testing.assert_close(pool.k[layer, used], dense_k[layer], rtol=0, atol=1e-5)
        torch.testing.assert_close(pool.layer_v(layer)[used], dense_v[layer], rtol=0, atol=1e-5)
    untouched = torch.ones(pool.layout.num_tokens, dtype=torch.bool)
    untouched[used] = False
    assert not any(t[:, untouched].any() for t in pool.tensors())


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_sharded_kv_heads_equal_the_unsharded_models(tp_size: int) -> None:
    """Rank r's pool holds the unsharded model's heads ``compute_local_heads`` gives it:
    heads [r] of 2 for tp 2, and head r // 2 (replicated) for tp 4 (integer division, not
    modulo); and the sharded forward's logits match."""
    ids = tokens()
    full = ReferenceModel(CONFIG)
    (whole,) = full.allocate_pools(16, PAGE)
    full_logits = full.prefill(ids[:NUM_TOKENS], pools=(whole,), page_table=PAGE_TABLE)
    sharded = ReferenceModel(CONFIG, tp_size=tp_size)
    pools = sharded.allocate_pools(16, PAGE)
    logits = sharded.prefill(ids[:NUM_TOKENS], pools=pools, page_table=PAGE_TABLE)
    torch.testing.assert_close(logits, full_logits, rtol=1e-5, atol=1e-5)
    used = slots(NUM_TOKENS)
    for rank, pool in enumerate(pools):
        head = rank * 2 // tp_size  # tp 2: rank r → head r; tp 4: ranks 0,1 → 0; 2,3 → 1
        assert sharded.local_kv_heads(rank).start == head
        torch.testing.assert_close(pool.k[:, used], whole.k[:, used, head : head + 1],
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool.tensor(KVPart.V)[:, used],
                                   whole.tensor(KVPart.V)[:, used, head : head + 1],
                                   rtol=1e-5, atol=1e-5)


def test_decode_step_reading_paged_kv_equals_dense_attention() -> None:
    """Decode attends over KV it never computed (read from the pool) and gets the dense
    forward's next-token logits; a copy of the pool (what a transfer delivers) gives
    bit-identical logits."""
    model = ReferenceModel(CONFIG)
    (pool,) = model.allocate_pools(16, PAGE)
    ids = tokens()
    model.prefill(ids[:NUM_TOKENS], pools=(pool,), page_table=PAGE_TABLE)
    transferred = KVPool(pool.layout, pool.k.clone(), None if pool.v is None else pool.v.clone())
    on_prefill = model.decode_step(int(ids[NUM_TOKENS]), NUM_TOKENS, pools=(pool,),
                                   page_table=PAGE_TABLE)
    on_decode = model.decode_step(int(ids[NUM_TOKENS]), NUM_TOKENS, pools=(transferred,),
                                  page_table=PAGE_TABLE)
    dense_logits, _, _ = model.dense_forward(ids)
    assert torch.equal(on_decode, on_prefill)
    torch.testing.assert_close(on_decode, dense_logits[NUM_TOKENS], rtol=1e-5, atol=1e-5)


def test_chunked_prefill_in_layer_groups_equals_one_shot() -> None:
    """ChunkForward run in layer groups, chunk after chunk (later chunks read earlier
    chunks' KV from the pool), writes the same KV and logits as one whole-prompt call."""
    model = ReferenceModel(CONFIG)
    ids = tokens()
    (one_shot,) = model.allocate_pools(16, PAGE)
    expected = model.prefill(ids[:NUM_TOKENS], pools=(one_shot,), page_table=PAGE_TABLE)
    (chunked,) = model.allocate_pools(16, PAGE)
    for start, stop, groups in ((0, 10, (range(0, 1), range(1, 3))),
                                (10, NUM_TOKENS, (range(0, 2), range(2, 3)))):
        chunk = ChunkForward(model, ids[start:stop], pools=(chunked,), page_table=PAGE_TABLE,
                             start_pos=start)
        for group in groups:
            chunk(group)
    torch.testing.assert_close(chunk.logits(), expected, rtol=1e-5, atol=1e-5)
    used = slots(NUM_TOKENS)
    torch.testing.assert_close(chunked.k[:, used], one_shot.k[:, used], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="in order"):
        ChunkForward(model, ids[:4], pools=(chunked,), page_table=PAGE_TABLE,
                     start_pos=0)(range(1, 2))


def test_bf16_kv_under_float32_compute_is_the_float32_kv_rounded_once() -> None:
    """kv_dtype bf16 with float32 compute (the reference engine on CPU): the pools are bf16
    and hold the float32 model's first-layer K/V rounded to bf16 (a second method: the same
    weights without kv_dtype, cast afterwards); later layers attend over the rounded values,
    so decode from a copied pool gives bit-identical logits, close to the dense forward."""
    model = ReferenceModel(CONFIG, kv_dtype=torch.bfloat16)
    (pool,) = model.allocate_pools(16, PAGE)
    assert pool.k.dtype == torch.bfloat16 and pool.layout.dtype == torch.bfloat16
    ids = tokens()
    model.prefill(ids[:NUM_TOKENS], pools=(pool,), page_table=PAGE_TABLE)
    wide = ReferenceModel(CONFIG)
    (wide_pool,) = wide.allocate_pools(16, PAGE)
    wide.prefill(ids[:NUM_TOKENS], pools=(wide_pool,), page_table=PAGE_TABLE)
    used = slots(NUM_TOKENS)
    assert torch.equal(pool.k[0, used], wide_pool.k[0, used].to(torch.bfloat16))
    assert torch.equal(pool.layer_v(0)[used], wide_pool.layer_v(0)[used].to(torch.bfloat16))
    _, dense_k, _ = model.dense_forward(ids[:NUM_TOKENS])
    assert dense_k[2].dtype == torch.bfloat16
    torch.testing.assert_close(pool.k[2, used], dense_k[2], rtol=0, atol=1e-2)
    transferred = KVPool(pool.layout, pool.k.clone(), None if pool.v is None else pool.v.clone())
    on_prefill = model.decode_step(int(ids[NUM_TOKENS]), NUM_TOKENS, pools=(pool,),
                                   page_table=PAGE_TABLE)
    on_decode = model.decode_step(int(ids[NUM_TOKENS]), NUM_TOKENS, pools=(transferred,),
                                  page_table=PAGE_TABLE)
    assert on_decode.dtype == torch.float32 and torch.equal(on_decode, on_prefill)


def test_graphed_forward_refuses_a_cpu_model() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        GraphedChunkForward(ReferenceModel(CONFIG), 4, pools=ReferenceModel(CONFIG)
                            .allocate_pools(16, PAGE), page_table=PAGE_TABLE)


@pytest.mark.gpu
def test_graphed_forward_in_any_grouping_equals_the_eager_forward() -> None:
    """Guards the benchmark's CUDA-graph path: replaying per-layer graphs (grouped 1, 2 or
    3 layers at a time, with new tokens loaded between runs) writes the same KV bytes and
    gives the same logits as the eager ChunkForward."""
    model = ReferenceModel(CONFIG, device="cuda", dtype=torch.bfloat16)
    (eager_pool,) = model.allocate_pools(16, PAGE)
    (graph_pool,) = model.allocate_pools(16, PAGE)
    graphed = GraphedChunkForward(model, NUM_TOKENS, pools=(graph_pool,),
                                  page_table=PAGE_TABLE)
    for seed, groups in ((1, [range(0, 3)]), (2, [range(0, 1), range(1, 3)]),
                         (3, [range(0, 1), range(1, 2), range(2, 3)])):
        ids = tokens(NUM_TOKENS, seed=seed)
        eager = ChunkForward(model, ids, pools=(eager_pool,), page_table=PAGE_TABLE,
                             start_pos=0)
        eager(range(3))
        replay = graphed.load(ids)
        for layers in groups:
            replay(layers)
        assert torch.equal(replay.logits(), eager.logits()), seed
        for mine, theirs in zip(graph_pool.tensors(), eager_pool.tensors(), strict=True):
            assert torch.equal(mine, theirs), seed
    with pytest.raises(ValueError, match="in order"):
        graphed.load(tokens(NUM_TOKENS))(range(1, 3))
