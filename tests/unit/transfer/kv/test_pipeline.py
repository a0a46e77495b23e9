"""Layer-group scheduling, chunk plans and the pipeline driver (no NIXL, no GPU needed).

Expected groups are derived by hand from the formulas in ``pd_transfer.kv.pipeline``'s
docstring; the working is written next to each row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from pd_contract.config import LayerPipelineConfig
from pd_transfer.kv.pipeline import (
    ChunkPlan,
    LayerPipeline,
    compute_chunk_plan,
    compute_group_count,
    compute_layer_groups,
)


def cfg(
    *,
    enabled: bool = True,
    min_tokens: int = 512,
    min_groups: int = 2,
    max_groups: int = 8,
    saturation: float = 16.0,
    group_size: int | None = None,
) -> LayerPipelineConfig:
    return LayerPipelineConfig(
        enabled=enabled, min_tokens=min_tokens, min_groups=min_groups, max_groups=max_groups,
        saturation=saturation, group_size=group_size,
    )


def sizes(groups: tuple[range, ...]) -> tuple[int, ...]:
    return tuple(len(g) for g in groups)


# Group computation ------------------------------------------------------------------------

ADAPTIVE = cfg()  # min_tokens 512, groups 2..8, saturation 16 (the docstring's example)


@pytest.mark.parametrize(
    ("num_layers", "num_tokens", "config", "expected"),
    [
        # Plain path: below min_tokens, or disabled → one group of every layer.
        (32, 256, ADAPTIVE, (32,)),
        (32, 511, ADAPTIVE, (32,)),
        (32, 100_000, cfg(enabled=False), (32,)),
        # t = 0 → N = 8; first = 32 // 15 = 2; 30 over 7: q = 4, r = 2 → 5, 5, then 4 × 5.
        (32, 512, ADAPTIVE, (2, 5, 5, 4, 4, 4, 4, 4)),
        # t = log2(2)/log2(16) = 0.25 → N = floor(8 - 1.5 + 0.5) = 7; first = 32 // 13 = 2;
        # 30 over 6 = 5 each.
        (32, 1024, ADAPTIVE, (2, 5, 5, 5, 5, 5, 5)),
        # t = 0.5 → N = floor(5.5) = 5; first = 32 // 9 = 3; 29 over 4: q = 7, r = 1.
        (32, 2048, ADAPTIVE, (3, 8, 7, 7, 7)),
        # t = 0.75 → N = floor(8 - 4.5 + 0.5) = 4; first = 32 // 7 = 4; 28 over 3: q = 9, r = 1.
        (32, 4096, ADAPTIVE, (4, 10, 9, 9)),
        # t = 1 (saturated) → N = 2; first = 32 // 3 = 10; the other 22 in one group.
        (32, 8192, ADAPTIVE, (10, 22)),
        (32, 1_000_000, ADAPTIVE, (10, 22)),
        # N capped at L = 4; first = max(1, 4 // 7) = 1; 3 over 3 → 1-layer groups.
        (4, 512, ADAPTIVE, (1, 1, 1, 1)),
        # saturation 1 → t = 1 for every n ≥ min_tokens → N = min_groups = 2; first = 8 // 3.
        (8, 600, cfg(saturation=1.0), (2, 6)),
        # min_groups 1 reached → one group (plain shape) at and past saturation.
        (16, 8192, cfg(min_groups=1), (16,)),
        # Fixed size: 3-layer groups, the last one shorter; no progressive first group.
        (8, 512, cfg(group_size=3), (3, 3, 2)),
        (4, 100_000, cfg(group_size=1), (1, 1, 1, 1)),
        (4, 512, cfg(group_size=10), (4,)),
        # Fixed size still honours the plain-path threshold.
        (8, 100, cfg(group_size=1), (8,)),
    ],
)
def test_layer_groups_table(
    num_layers: int, num_tokens: int, config: LayerPipelineConfig, expected: tuple[int, ...]
) -> None:
    groups = compute_layer_groups(num_layers, num_tokens, config)
    assert sizes(groups) == expected
    # Invariant: consecutive, non-empty, covering every layer exactly once.
    assert [layer for g in groups for layer in g] == list(range(num_layers))


@pytest.mark.parametrize("num_layers", [1, 2, 3, 7, 8, 16, 32, 61, 80])
@pytest.mark.parametrize("num_tokens", [512, 700, 1024, 3000, 8192, 65536])
def test_adaptive_groups_are_progressive_and_bounded(num_layers: int, num_tokens: int) -> None:
    """Guards the progressive-first-group contract: the first group is (about) half the
    others, so decode starts receiving early, and the count stays in its bounds."""
    groups = compute_layer_groups(num_layers, num_tokens, ADAPTIVE)
    count = compute_group_count(num_layers, num_tokens, ADAPTIVE)
    assert len(groups) == max(1, count)
    assert min(2, num_layers) <= len(groups) <= min(8, num_layers) or len(groups) == 1
    assert [layer for g in groups for layer in g] == list(range(num_layers))
    if len(groups) > 1:
        first, others = len(groups[0]), [len(g) for g in groups[1:]]
        assert first <= min(others)
        assert 2 * first <= min(others) + 1  # half of the others (integer split)
        assert max(others) - min(others) <= 1  # the rest split evenly, larger ones first
        assert others == sorted(others, reverse=True)


def test_group_count_falls_with_prompt_length() -> None:
    """Many groups just above min_tokens, fewer as the prompt grows, min_groups at
    saturation × min_tokens."""
    counts = [compute_group_count(64, n, ADAPTIVE) for n in (512, 1024, 2048, 4096, 8192, 16384)]
    assert counts == [8, 7, 5, 4, 2, 2]


def test_min_groups_above_max_groups_is_refused() -> None:
    with pytest.raises(ValueError, match="min_groups"):
        compute_layer_groups(8, 4096, cfg(min_groups=5, max_groups=3))
    with pytest.raises(ValueError, match="min_groups"):
        LayerPipeline(cfg(min_groups=5, max_groups=3), 8, RecordingSink())


# Chunk plans ---------------------------------------------------------------------------------


def plan_rows(plans: tuple[ChunkPlan, ...]) -> list[tuple[int, int, range, range, bool]]:
    return [(c.token_start, c.token_stop, c.request_pages, c.part_pages, c.last) for c in plans]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # 10 tokens, pages of 4 → pages 0, 1, 2 (the last one holds 2 tokens). One chunk.
        ({}, [(0, 10, range(0, 3), range(0, 3), True)]),
        # Chunks of 4: page 0 complete at 4, page 1 at 8, the partial page 2 with the last.
        ({"chunk_tokens": 4}, [(0, 4, range(0, 1), range(0, 1), False),
                               (4, 8, range(1, 2), range(1, 2), False),
                               (8, 10, range(2, 3), range(2, 3), True)]),
        # Chunks of 6: 6 // 4 = 1 page complete after chunk 0; page 1 (tokens 4..7) is
        # completed by the last chunk, which also sends page 2.
        ({"chunk_tokens": 6}, [(0, 6, range(0, 1), range(0, 1), False),
                               (6, 10, range(1, 3), range(1, 3), True)]),
        # Chunks of 3: chunk 0 completes no page (3 // 4 = 0) and sends nothing.
        ({"chunk_tokens": 3}, [(0, 3, range(0, 0), range(0, 0), False),
                               (3, 6, range(0, 1), range(0, 1), False),
                               (6, 9, range(1, 2), range(1, 2), False),
                               (9, 10, range(2, 3), range(2, 3), True)]),
        # Decode holds page 0: it is never sent; part pages are shifted by one.
        ({"chunk_tokens": 4, "decode_cached_pages": 1},
         [(0, 4, range(1, 1), range(0, 0), False),
          (4, 8, range(1, 2), range(0, 1), False),
          (8, 10, range(2, 3), range(1, 2), True)]),
        # Prefill's own cache holds tokens 0..3: compute starts at 4, page 0 still goes.
        ({"chunk_tokens": 4, "computed_tokens": 4},
         [(4, 8, range(0, 2), range(0, 2), False), (8, 10, range(2, 3), range(2, 3), True)]),
    ],
)
def test_chunk_plan_table(kwargs: dict[str, int], expected: list[object]) -> None:
    plans = compute_chunk_plan(10, 4, **kwargs)
    assert plan_rows(plans) == expected
    cached = kwargs.get("decode_cached_pages", 0)
    # Invariant: every page decode lacks is sent exactly once, in order; only the final
    # chunk is last and it sends at least one page.
    assert [p for c in plans for p in c.request_pages] == list(range(cached, 3))
    assert [c.last for c in plans] == [False] * (len(plans) - 1) + [True]
    assert plans[-1].request_pages


def test_chunk_plan_refuses_caching_the_last_token_page() -> None:
    """Decode can never hold the page with the last token: it is computed to produce the
    first output token, so a plan without any part for the final chunk would hang decode."""
    with pytest.raises(ValueError, match="last token"):
        compute_chunk_plan(10, 4, decode_cached_pages=3)
    with pytest.raises(ValueError, match="computed_tokens"):
        compute_chunk_plan(10, 4, computed_tokens=10)


# The driver ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    room: str
    pages: range | None
    layers: range | None
    last: bool
    has_event: bool


@dataclass
class RecordingSink:
    """A real, small PartSink: records parts in order, and a shared timeline."""

    parts: list[Part] = field(default_factory=list)
    timeline: list[tuple[str, range | None]] = field(default_factory=list)

    def send_part(
        self,
        room: str,
        pages: range | None = None,
        layers: range | None = None,
        *,
        last: bool = False,
        ready_event: torch.cuda.Event | None = None,
    ) -> object:
        self.parts.append(Part(room, pages, layers, last, ready_event is not None))
        self.timeline.append(("part", layers))
        return None


@dataclass
class CountingForward:
    """A GroupForward that records which layer ranges ran, into the sink's timeline."""

    sink: RecordingSink
    calls: list[range] = field(default_factory=list)

    def __call__(self, layers: range) -> None:
        self.calls.append(layers)
        self.sink.timeline.append(("compute", layers))


@pytest.fixture
def no_device_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any device- or stream-wide synchronisation during the test raises."""

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the layer pipeline must never synchronise the device")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", refuse)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", refuse)


@pytest.mark.usefixtures("no_device_sync")
def test_short_prompt_takes_the_plain_path_with_no_added_work() -> None:
    """docs/failure-modes.md #17: below min_tokens one forward call, one part of every layer
    (layers=None), no event on CPU, no synchronisation: exactly compute-then-transfer."""
    sink = RecordingSink()
    forward = CountingForward(sink)
    pipeline = LayerPipeline(ADAPTIVE, 32, sink)
    run = pipeline.run_chunk("r1", forward, num_tokens=256, pages=range(0, 16), last=True)
    assert forward.calls == [range(32)]
    assert sink.parts == [Part("r1", range(0, 16), None, True, False)]
    assert (run.parts_posted, run.events_recorded) == (1, 0)


@pytest.mark.usefixtures("no_device_sync")
def test_pipelined_chunk_posts_each_group_before_computing_the_next() -> None:
    """Group g's part is handed over before group g+1 computes (that is the overlap); only
    the final part is last."""
    sink = RecordingSink()
    forward = CountingForward(sink)
    pipeline = LayerPipeline(ADAPTIVE, 32, sink)
    run = pipeline.run_chunk("r", forward, num_tokens=2048, pages=range(0, 128), last=True)
    groups = compute_layer_groups(32, 2048, ADAPTIVE)
    assert run.groups == groups and run.parts_posted == 5
    expected: list[tuple[str, range | None]] = []
    for group in groups:
        expected += [("compute", group), ("part", group)]
    assert sink.timeline == expected
    assert [p.last for p in sink.parts] == [False, False, False, False, True]
    assert all(p.pages == range(0, 128) and not p.has_event for p in sink.parts)


def test_chunked_prefill_posts_chunk_by_layer_group_parts() -> None:
    """Incremental: each chunk's pages go out group by group as soon as the chunk's layers
    are done; a chunk that completes no page posts nothing; only the final part is last."""
    config = cfg(min_tokens=4, min_groups=2, max_groups=2)
    sink = RecordingSink()
    pipeline = LayerPipeline(config, 6, sink)
    # 10 tokens, pages of 4, chunks of 3, decode holds page 0.
    for chunk in compute_chunk_plan(10, 4, 3, decode_cached_pages=1):
        pipeline.run_chunk("r", CountingForward(sink), num_tokens=chunk.num_tokens,
                           pages=chunk.part_pages, last=chunk.last)
    # Chunks: [0,3) none, [3,6) page 0 (cached: none), [6,9) page 1, [9,10) page 2.
    # [6,9) has 3 tokens < min_tokens 4 → plain; [9,10) 1 token → plain.
    assert sink.parts == [
        Part("r", range(0, 1), None, False, False),
        Part("r", range(1, 2), None, True, False),
    ]
    sink = RecordingSink()
    pipeline = LayerPipeline(config, 6, sink)
    for chunk in compute_chunk_plan(16, 4, 8):  # two chunks of 8 tokens → 2 groups each
        pipeline.run_chunk("r", CountingForward(sink), num_tokens=chunk.num_tokens,
                           pages=chunk.part_pages, last=chunk.last)
    # N = 2: first = 6 // 3 = 2, then 4.
    assert sink.parts == [
        Part("r", range(0, 2), range(0, 2), False, False),
        Part("r", range(0, 2), range(2, 6), False, False),
        Part("r", range(2, 4), range(0, 2), False, False),
        Part("r", range(2, 4), range(2, 6), True, False),
    ]


def test_last_chunk_without_pages_is_refused_before_any_work() -> None:
    sink = RecordingSink()
    forward = CountingForward(sink)
    with pytest.raises(ValueError, match="at least one page"):
        LayerPipeline(ADAPTIVE, 4, sink).run_chunk(
            "r", forward, num_tokens=600, pages=range(0, 0), last=True
        )
    assert forward.calls == [] and sink.parts == []


@pytest.mark.gpu
@pytest.mark.usefixtures("no_device_sync")
def test_cuda_records_one_event_per_part_and_never_syncs() -> None:
    """On GPU the plain path records exactly one event (what compute-then-transfer needs
    anyway) and the pipelined path one per group, each after that group's kernels."""
    sink = RecordingSink()
    x = torch.zeros(1 << 20, device="cuda")

    def forward(layers: range) -> None:
        x.add_(len(layers))

    pipeline = LayerPipeline(ADAPTIVE, 8, sink, device="cuda")
    plain = pipeline.run_chunk("a", forward, num_tokens=16, pages=range(0, 1), last=True)
    piped = pipeline.run_chunk("b", forward, num_tokens=4096, pages=range(0, 1), last=True)
    assert (plain.parts_posted, plain.events_recorded) == (1, 1)
    assert piped.events_recorded == piped.parts_posted == len(piped.groups) > 1
    assert all(p.has_event for p in sink.parts)
