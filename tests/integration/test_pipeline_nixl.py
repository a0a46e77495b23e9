"""Layer-pipelined and incremental transfers between real processes over NIXL (UCX on lo).

Prefill (TP 1, this process) runs the reference model through ``LayerPipeline`` into a real
``PrefillSender``; decode runs real ``DecodeReceiver``s in a spawned process: TP 1 (the
contiguous path, pages straight into decode's pool) and TP 2 (the staged path: each part is
gathered per layer group into the staging buffer, written into decode's ring, scattered).
Every grouping (one group, adaptive, fixed 1-layer groups) runs whole and chunked with a
prefix hit. Asserted each time: decode's KV equals prefill's head slices bit for bit (SHA-256
over every layer, token and head), pages decode already held are untouched, both sides end
Succeeded; and decode's next-token logits computed from the transferred KV equal prefill's.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pd_contract.config import LayerPipelineConfig
from pd_transfer.bench.peers import DecodeProcess, DecodeSpec, PrefillPeer, kv_digest
from pd_transfer.kv.pipeline import LayerPipeline, compute_chunk_plan
from pd_transfer.kv.pool import KVPool
from pd_transfer.reference.model import ChunkForward, ModelConfig, ReferenceModel

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]

MODEL = ModelConfig(num_layers=6, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate_size=96, vocab_size=101)
PAGE = 4
NUM_TOKENS = 38  # 10 pages, the last one half full
NUM_PAGES = 32
# Scattered, partly consecutive: exercises descriptor runs on both sides. One extra page
# each for the decode step's own token.
SRC_PAGES = (3, 4, 5, 9, 10, 11, 12, 0, 1, 2, 30)
DST_PAGES = (20, 21, 7, 8, 9, 10, 2, 3, 4, 31, 15)
GROUPINGS = {
    "one-group": LayerPipelineConfig(enabled=False, min_tokens=1, min_groups=1, max_groups=1,
                                     saturation=1.0),
    "adaptive": LayerPipelineConfig(enabled=True, min_tokens=8, min_groups=2, max_groups=4,
                                    saturation=4.0),
    "fixed-1": LayerPipelineConfig(enabled=True, min_tokens=1, min_groups=1, max_groups=1,
                                   saturation=1.0, group_size=1),
}
ROOMS = itertools.count()


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel(MODEL, seed=7)


@pytest.fixture(scope="module", params=[1, 2], ids=["decode-tp1-contiguous", "decode-tp2-staged"])
def peers(
    request: pytest.FixtureRequest, model: ReferenceModel
) -> Iterator[tuple[PrefillPeer, DecodeProcess, int]]:
    decode_tp: int = request.param
    torch.set_num_threads(1)
    decode = DecodeProcess(DecodeSpec(
        model=MODEL, dtype=torch.float32, page_size=PAGE, num_pages=NUM_PAGES, tp=decode_tp,
        device="cpu", link="dram", ring_bytes=1 << 20, mode="auto", seed=7, torch_threads=1,
    ))
    prefill = PrefillPeer(model, num_pages=NUM_PAGES, page_size=PAGE, staging_bytes=1 << 20,
                          auth=decode.auth)
    try:
        prefill.connect(decode)
        yield prefill, decode, decode_tp
    finally:
        prefill.close()
        decode.close()


def transfer(
    model: ReferenceModel,
    prefill: PrefillPeer,
    decode: DecodeProcess,
    config: LayerPipelineConfig,
    token_ids: torch.Tensor,
    *,
    chunk_tokens: int | None,
    cached: int,
) -> int:
    """Prefill ``token_ids`` through the pipeline while decode receives; returns the number
    of parts posted."""
    room = f"room-{next(ROOMS)}"
    src, dst = list(SRC_PAGES[:10]), list(DST_PAGES[:10])
    sent_tokens = NUM_TOKENS - cached * PAGE
    prefill.sender.register_request(room, src[cached:], sent_tokens).result(10.0)
    assert decode.ask("expect", room, dst[cached:], sent_tokens) == "ok"
    prefill.wait_transferring(room)
    pipeline = LayerPipeline(config, MODEL.num_layers, prefill.sender)
    parts = 0
    for chunk in compute_chunk_plan(NUM_TOKENS, PAGE, chunk_tokens, decode_cached_pages=cached):
        forward = ChunkForward(model, token_ids[chunk.token_start : chunk.token_stop],
                               pools=(prefill.pool,), page_table=src,
                               start_pos=chunk.token_start)
        parts += pipeline.run_chunk(room, forward, num_tokens=chunk.num_tokens,
                                    pages=chunk.part_pages, last=chunk.last).parts_posted
    result = decode.ask("wait", room, dst[cached:], 30.0)
    assert result["states"] == ["Succeeded"] * len(decode.documents), result
    assert prefill.wait_finished(room) == "Succeeded"
    assert all(len(a) == parts for a in result["arrivals"])  # one notification per part
    return parts


@pytest.mark.parametrize("grouping", list(GROUPINGS))
@pytest.mark.parametrize(("chunk_tokens", "cached"), [(None, 0), (12, 2)],
                         ids=["whole", "chunked-prefix-hit"])
def test_pipelined_transfer_is_bit_exact(
    peers: tuple[PrefillPeer, DecodeProcess, int],
    model: ReferenceModel,
    grouping: str,
    chunk_tokens: int | None,
    cached: int,
) -> None:
    prefill, decode, decode_tp = peers
    seed = list(GROUPINGS).index(grouping) * 10 + cached + decode_tp  # distinct per case
    token_ids = torch.randint(0, MODEL.vocab_size, (NUM_TOKENS + 1,),
                              generator=torch.Generator().manual_seed(seed))
    before = decode.ask("peek", list(DST_PAGES[:cached]), 0) if cached else None
    parts = transfer(model, prefill, decode, GROUPINGS[grouping], token_ids,
                     chunk_tokens=chunk_tokens, cached=cached)

    # Parts: one group → one part per chunk that sends pages; fixed-1 → 6 per such chunk.
    # Chunked (12 tokens, pages of 4, decode holds pages 0-1): chunks [0,12) pages 2,
    # [12,24) pages 3-5, [24,36) pages 6-8, [36,38) page 9 → 4 chunks with pages.
    chunks = 1 if chunk_tokens is None else 4
    expected_parts = {"one-group": chunks, "fixed-1": 6 * chunks}.get(grouping)
    if expected_parts is not None:
        assert parts == expected_parts
    else:  # adaptive: 38-token and 12-token chunks pipeline (≥ 8 tokens), the 2-token one not
        assert parts > chunks

    digests = decode.ask("digest", list(DST_PAGES[cached:10]))
    for rank, digest in enumerate(digests):
        heads = model_heads(decode_tp, rank)
        assert digest == kv_digest(prefill.pool, SRC_PAGES[cached:10], heads), f"rank {rank}"
    if before is not None:  # the prefix decode already held was not written
        after = decode.ask("peek", list(DST_PAGES[:cached]), 0)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        return
    # Decode attends over the transferred KV: same next-token logits as prefill-side.
    expected = model.decode_step(
        int(token_ids[NUM_TOKENS]), NUM_TOKENS, pools=(clone(prefill.pool),),
        page_table=SRC_PAGES)
    got = decode.ask("decode_step", int(token_ids[NUM_TOKENS]), NUM_TOKENS, list(DST_PAGES))
    if decode_tp == 1:
        assert torch.equal(got, expected)
    else:  # decode TP 2 sums two partial attention outputs: equal up to rounding
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def model_heads(decode_tp: int, rank: int) -> range:
    per_rank = MODEL.num_kv_heads // decode_tp
    return range(rank * per_rank, (rank + 1) * per_rank)


def clone(pool: KVPool) -> KVPool:
    """A copy: the decode step writes its own token's KV, which must not alter the source."""
    return KVPool(pool.layout, pool.k.clone(), None if pool.v is None else pool.v.clone())


SRC, DST = list(SRC_PAGES[:10]), list(DST_PAGES[:10])


@contextlib.contextmanager
def gpu_pair(decode_tp: int) -> Iterator[tuple[PrefillPeer, DecodeProcess]]:
    """Prefill (this process) and decode (TP 1: contiguous path; TP 2: staged) on the GPU,
    connected, prefill's pages SRC holding one forward's KV."""
    gpu_model = ReferenceModel(MODEL, seed=7, device="cuda")
    decode = DecodeProcess(DecodeSpec(
        model=MODEL, dtype=torch.float32, page_size=PAGE, num_pages=NUM_PAGES, tp=decode_tp,
        device="cuda", link="nvlink", ring_bytes=1 << 20,
        mode="auto" if decode_tp == 1 else "staged", seed=7,
        torch_threads=1,
    ))
    prefill = PrefillPeer(gpu_model, num_pages=NUM_PAGES, page_size=PAGE,
                          staging_bytes=1 << 20, auth=decode.auth)
    try:
        prefill.connect(decode)
        token_ids = torch.randint(0, MODEL.vocab_size, (NUM_TOKENS,),
                                  generator=torch.Generator().manual_seed(3))
        ChunkForward(gpu_model, token_ids, pools=(prefill.pool,), page_table=SRC,
                     start_pos=0)(range(MODEL.num_layers))
        torch.cuda.synchronize()
        yield prefill, decode
    finally:
        torch.cuda.synchronize()
        prefill.close()
        decode.close()


@pytest.fixture
def gpu_staged() -> Iterator[tuple[PrefillPeer, DecodeProcess]]:
    with gpu_pair(decode_tp=2) as pair:
        yield pair


def engine_gathers(prefill: PrefillPeer) -> int:
    """Gathers prefill's ``send_part`` launched on the calling thread (prefill/gathers.py)."""
    return int(prefill.sender.metrics.gathers.labels("engine")._value.get())


def wait_armed(prefill: PrefillPeer, shares: int, timeout_s: float = 30.0) -> None:
    """Until prefill has set staging space aside for ``shares`` decode ranks (their
    pre-granted RequestKVs arrived): the next whole part is gathered in ``send_part``."""
    deadline = time.monotonic() + timeout_s
    while prefill.sender.debug_counts()["armed_gathers"] < shares:
        assert time.monotonic() < deadline, "prefill set no staging space aside"
        time.sleep(100e-6)


def send_whole(prefill: PrefillPeer, decode: DecodeProcess, room: str) -> None:
    """One request of prefill's pages SRC into decode's DST, as one part; Succeeded."""
    prefill.sender.register_request(room, SRC, NUM_TOKENS).result(10.0)
    assert decode.ask("expect", room, DST, NUM_TOKENS) == "ok"
    prefill.wait_transferring(room)
    prefill.send_part(room, last=True)
    result = decode.ask("wait", room, DST, 60.0)
    assert result["states"] == ["Succeeded"] * len(decode.documents), (room, result)
    assert prefill.wait_finished(room) == "Succeeded"


def assert_decode_holds_prefill_kv(prefill: PrefillPeer, decode: DecodeProcess,
                                   room: str) -> None:
    digests = decode.ask("digest", DST)
    for rank, digest in enumerate(digests):
        expected = kv_digest(prefill.pool, SRC, model_heads(len(digests), rank))
        assert digest == expected, f"{room}: rank {rank}'s KV differs from prefill's"


@pytest.mark.gpu
def test_staged_part_is_written_while_the_engine_stream_runs_later_work(
    gpu_staged: tuple[PrefillPeer, DecodeProcess],
) -> None:
    """A part whose ready event has fired is gathered, written and scattered while the
    engine's stream still runs later work (here a long sleep kernel standing in for the next
    layers' forward). Ordered after that stream's tail instead, every part of a
    layer-pipelined forward waited for the whole forward (docs/failure-modes.md #35)."""
    prefill, decode = gpu_staged

    def send(room: str, busy: bool) -> tuple[dict[str, Any], bool]:
        """One request's KV, its part given a fired-by-then ready event; with ``busy``, a
        10-20 s kernel queued on the engine's stream after that event. Returns decode's
        result and whether that kernel still ran when decode had everything."""
        prefill.sender.register_request(room, SRC, NUM_TOKENS).result(10.0)
        assert decode.ask("expect", room, DST, NUM_TOKENS) == "ok"
        prefill.wait_transferring(room)
        if busy:  # (the warm-up compiled the kernel: the worker compiles, never send_part)
            wait_armed(prefill, 2)
        before = engine_gathers(prefill)
        writes = prefill.sender.transport.stats.transfers_posted
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()
        if busy:
            torch.cuda._sleep(40_000_000_000)  # type: ignore[no-untyped-call]
        prefill.send_part(room, last=True, ready_event=ready)
        assert engine_gathers(prefill) == before + (2 if busy else 0)
        result = decode.ask("wait", room, DST, 60.0)
        still_busy = not torch.cuda.default_stream().query()
        torch.cuda.synchronize()
        assert prefill.wait_finished(room) == "Succeeded"
        assert prefill.sender.transport.stats.transfers_posted - writes == 2  # one per rank
        return result, still_busy

    # The first staged transfer compiles the staging kernels and maps the peer's memory.
    warm, _ = send("warm-up", busy=False)
    assert warm["states"] == ["Succeeded", "Succeeded"], warm
    result, still_busy = send("busy-engine-stream", busy=True)
    assert result["states"] == ["Succeeded", "Succeeded"], result
    assert still_busy, "the part waited for later work on the engine's stream"
    assert_decode_holds_prefill_kv(prefill, decode, "busy-engine-stream")


@pytest.mark.gpu
def test_staged_scatter_waits_for_engine_work_queued_on_its_pages_before_the_request(
    gpu_staged: tuple[PrefillPeer, DecodeProcess],
) -> None:
    """Decode's scatters run after whatever the engine queued on its default stream before
    the request started (there: the last kernels of the pages' previous owner). Here decode
    queues a ~1 s kernel and then zeroes the request's pages on that stream just before
    ``expect``: a scatter that did not wait would be overwritten by the zeros, and the KV
    would not match. The stream is ordered once per request, when it starts; the scatters,
    of a pre-granted whole request, were prepared then too (decode/__init__.py)."""
    prefill, decode = gpu_staged
    for room, busy_cycles in (("warm-up", 0), ("busy-decode-stream", 2_000_000_000)):
        before = decode.ask("scatters")
        prefill.sender.register_request(room, SRC, NUM_TOKENS).result(10.0)
        assert decode.ask("expect", room, DST, NUM_TOKENS, busy_cycles) == "ok"
        prefill.wait_transferring(room)
        prefill.send_part(room, last=True)
        result = decode.ask("wait", room, DST, 60.0)
        assert result["states"] == ["Succeeded", "Succeeded"], (room, result)
        assert prefill.wait_finished(room) == "Succeeded"
        assert_decode_holds_prefill_kv(prefill, decode, room)
        after = decode.ask("scatters")
        assert [a["grant"] - b["grant"] for a, b in zip(after, before, strict=True)] == [1, 1]


@pytest.mark.gpu
@pytest.mark.parametrize("decode_tp", [1, 2], ids=["contiguous", "staged"])
def test_a_part_without_ready_event_waits_for_the_default_streams_earlier_work(
    decode_tp: int,
) -> None:
    """A part sent without a ready event is read after what the device's default stream held
    at ``send_part``. Here prefill queues a ~1 s kernel and then overwrites its pages on that
    stream just before ``send_part``: the contiguous path's WRITE, posted at once, read the
    pages before the overwrite (decode got the old KV); the staged gather waited
    (docs/failure-modes.md #37)."""
    with gpu_pair(decode_tp) as (prefill, decode):
        if decode_tp == 2:  # staged: the kernel compiles on the worker's first gather
            send_whole(prefill, decode, "warm-up")
        room = f"late-write-{decode_tp}"
        prefill.sender.register_request(room, SRC, NUM_TOKENS).result(10.0)
        assert decode.ask("expect", room, DST, NUM_TOKENS) == "ok"
        prefill.wait_transferring(room)
        if decode_tp == 2:  # staged: gathered on this thread, behind a device-side wait
            wait_armed(prefill, 2)
        slots = prefill.pool.pages_to_tokens(SRC)  # before the kernel: its upload would wait
        torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call]
        for tensor in prefill.pool.tensors():
            tensor.index_fill_(1, slots, 0.25)
        before = engine_gathers(prefill)
        prefill.send_part(room, last=True)
        assert engine_gathers(prefill) - before == (2 if decode_tp == 2 else 0)
        result = decode.ask("wait", room, DST, 60.0)
        assert result["states"] == ["Succeeded"] * decode_tp, result
        assert prefill.wait_finished(room) == "Succeeded"
        torch.cuda.synchronize()
        assert_decode_holds_prefill_kv(prefill, decode, room)
