"""The vLLM connector's scheduler side: which pages each step sends, what decode loads,
when blocks stay held. Pure bookkeeping; the expected tables are worked out by hand from
the page size (4 tokens a page here)."""

from __future__ import annotations

import pytest

from pd_transfer.agent.report import RequestCounts
from pd_transfer.protocol.handoff import ParamsError
from pd_transfer.vllm.scheduler import ScheduledPrompt, SchedulerSide
from pd_transfer.vllm.steps import DecodeLoad, PrefillChunk

PAGE = 4
SEND = {"pd_transfer": {"room": "r1", "decode": "10.0.0.2:8998"}}
LOAD = {"pd_transfer": {"room": "r1", "prefill": "10.0.0.1:8998"}}


def test_prefill_chunks_send_each_page_once_the_last_with_the_partial_page() -> None:
    side = SchedulerSide("prefill", PAGE)
    side.track("a", SEND, 14)  # pages 0-3, page 3 partial (tokens 12, 13)
    assert side.matched_tokens("a", 0) == (0, False)
    plans = [
        side.build([ScheduledPrompt("a", 0, 6, (7, 8))]),      # tokens [0, 6): page 0 done
        side.build([ScheduledPrompt("a", 6, 2, ())]),          # [6, 8): page 1 done
        side.build([ScheduledPrompt("a", 8, 6, (9, 11))]),     # [8, 14): pages 2, 3 (last)
        side.build([ScheduledPrompt("a", 14, 1, ())]),         # a generation step: nothing
    ]
    assert [p.chunks for p in plans] == [
        (PrefillChunk("a", "r1", "10.0.0.2:8998", 14, 0, 6, 0, 1, (7, 8)),),
        (PrefillChunk("a", "r1", "10.0.0.2:8998", 14, 6, 8, 1, 2, ()),),
        (PrefillChunk("a", "r1", "10.0.0.2:8998", 14, 8, 14, 2, 4, (9, 11)),),
        (),
    ]
    assert plans[2].chunks[0].last and not plans[1].chunks[0].last


def test_prefill_chunk_that_completes_no_page_sends_nothing_yet() -> None:
    side = SchedulerSide("prefill", PAGE)
    side.track("a", SEND, 10)
    first = side.build([ScheduledPrompt("a", 0, 3, (5,))]).chunks[0]
    assert (first.page_start, first.page_stop) == (0, 0)
    second = side.build([ScheduledPrompt("a", 3, 7, (6, 7))]).chunks[0]
    assert (second.page_start, second.page_stop, second.last) == (0, 3, True)


def test_prefill_prefix_hit_of_its_own_starts_later_but_sends_from_page_zero() -> None:
    side = SchedulerSide("prefill", PAGE)
    side.track("a", SEND, 10)
    chunk = side.build([ScheduledPrompt("a", 8, 2, (1, 2, 3))]).chunks[0]
    assert (chunk.token_start, chunk.page_start, chunk.page_stop, chunk.new_pages) == (
        8, 0, 3, (1, 2, 3))


def test_prefill_blocks_held_until_the_worker_reports_the_send() -> None:
    side = SchedulerSide("prefill", PAGE)
    side.track("a", SEND, 8)
    side.build([ScheduledPrompt("a", 0, 8, (1, 2))])
    assert side.finished("a", completed_prompt=True) is True
    assert side.has_pending_sends()
    side.transfers_done(["a"], [])
    assert not side.has_pending_sends()
    assert side.live_requests() == 0


def test_prefill_request_ended_before_any_chunk_is_not_held() -> None:
    side = SchedulerSide("prefill", PAGE)
    side.track("a", SEND, 8)
    assert side.finished("a", completed_prompt=False) is False
    assert side.live_requests() == 0


def test_prefill_abort_mid_prompt_aborts_the_room_and_holds_blocks() -> None:
    side = SchedulerSide("prefill", PAGE)
    side.track("a", SEND, 16)
    side.build([ScheduledPrompt("a", 0, 8, (1, 2))])
    assert side.finished("a", completed_prompt=False) is True
    assert side.build([]).aborts == ("r1",)


def test_prefill_preempted_request_aborts_its_room_once() -> None:
    side = SchedulerSide("prefill", PAGE)
    side.track("a", SEND, 16)
    side.build([ScheduledPrompt("a", 0, 8, (1, 2))])
    plan = side.build([ScheduledPrompt("a", 0, 8, (5, 6), resumed=True)])
    assert (plan.chunks, plan.aborts) == ((), ("r1",))
    assert side.build([ScheduledPrompt("a", 8, 8, (7, 8))]).chunks == ()


def test_request_without_params_is_local() -> None:
    for role in ("prefill", "decode"):
        side = SchedulerSide(role, PAGE)  # type: ignore[arg-type]
        side.track("a", None, 8)
        side.track("b", {"other": 1}, 8)
        assert side.matched_tokens("a", 0) == (0, False)
        assert side.build([ScheduledPrompt("a", 0, 8, (1, 2))]).chunks == ()
        assert side.finished("a", completed_prompt=True) is False


@pytest.mark.parametrize("params", [
    {"pd_transfer": {"room": "r1"}},
    {"pd_transfer": {"room": "r 1", "decode": "h:1"}},
    {"pd_transfer": {"room": "r1", "decode": "no-port"}},
    {"pd_transfer": {"room": "r1", "decode": "h:70000"}},
    {"pd_transfer": {"room": "r1", "decode": "h:1", "extra": True}},
    {"pd_transfer": "r1"},
])
def test_malformed_params_are_refused_naming_the_key(params: dict[str, object]) -> None:
    side = SchedulerSide("prefill", PAGE)
    with pytest.raises(ParamsError, match=r"kv_transfer_params\['pd_transfer'\]"):
        side.track("a", params, 8)


def test_decode_loads_everything_past_its_prefix_hit() -> None:
    side = SchedulerSide("decode", PAGE)
    side.track("a", LOAD, 14)
    assert side.matched_tokens("a", 8) == (6, True)  # local hit: pages 0, 1
    assert side.build([]).loads == ()
    side.after_alloc("a", [3, 4, 9, 12], 6)
    assert side.build([]).loads == (DecodeLoad("a", "r1", "10.0.0.1:8998", 14, 2, (9, 12)),)
    assert side.matched_tokens("a", 14) == (0, False)  # loading: never matched twice
    side.transfers_done([], ["a"])
    assert side.finished("a", completed_prompt=True) is False
    assert side.live_requests() == 0


def test_decode_request_ended_during_its_load_holds_blocks_until_it_ends() -> None:
    side = SchedulerSide("decode", PAGE)
    side.track("a", LOAD, 8)
    side.matched_tokens("a", 0)
    side.after_alloc("a", [1, 2], 8)
    side.build([])
    assert side.finished("a", completed_prompt=False) is True
    assert side.build([]).aborts == ("r1",)
    side.transfers_done(["a"], [])
    assert side.live_requests() == 0


def test_decode_load_that_failed_as_vllm_finished_the_request_leaves_no_state() -> None:
    # vLLM's "fail" policy: the step that reports the load failed (finished_recving with
    # failed_recving) first finishes the request with an error (request_finished while the
    # load is live), then hands the connector the report; vLLM frees the blocks on it.
    side = SchedulerSide("decode", PAGE)
    side.track("a", LOAD, 8)
    side.matched_tokens("a", 0)
    side.after_alloc("a", [1, 2], 8)
    side.build([])
    assert side.finished("a", completed_prompt=False) is True
    side.transfers_done([], ["a"])
    assert side.live_requests() == 0


def test_decode_load_with_fewer_blocks_than_the_prompt_needs_fails_alone() -> None:
    side = SchedulerSide("decode", PAGE)
    side.track("a", LOAD, 9)
    side.matched_tokens("a", 0)
    side.after_alloc("a", [1, 2], 9)  # never raises into vLLM's scheduler
    (load,) = side.build([]).loads
    assert load.error == "2 blocks allocated for a 9-token prompt that needs 3"


def test_every_request_vllm_ends_is_counted_and_its_errors_apart() -> None:
    """Guards the request counts an engine rollout judges new pods by: every request vLLM
    ends passes through `finished` (with or without a transfer), an error only when vLLM
    ended it FINISHED_ERROR."""
    side = SchedulerSide("decode", PAGE)
    assert side.request_counts() == RequestCounts(0, 0)
    side.track("local", None, 10)  # no kv_transfer_params: no connector state
    side.finished("local", completed_prompt=True)
    side.finished("failed-load", completed_prompt=False, errored=True)
    side.finished("aborted", completed_prompt=False)  # a client that left: no error
    assert side.request_counts() == RequestCounts(3, 1)
