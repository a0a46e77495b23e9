"""The router's Prometheus metrics after a known mix of requests, read back through its own
`GET /metrics` as a scraper would. Stand-in engines (`pd_testbed.router_engines`) answer;
real vLLM is exercised by the e2e tests. Needs neither NIXL, torch nor a GPU."""

from __future__ import annotations

import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pd_contract.transferagent import Role
from pd_testbed.polling import wait_for
from pd_testbed.router_engines import Answer, StandInEngine, call, closed_port, sse
from pd_transfer.router import Endpoint, EndpointTable, Router, RouterSettings
from pd_transfer.router.tokens import StreamClock, prompt_tokens

pytestmark = pytest.mark.timeout(30)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
COMPLETIONS = "/v1/completions"


def _scrape(url: str) -> Samples:
    status, headers, body = call(url, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples}


def _get(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def _endpoint(role: Role, engine: StandInEngine | None, port: int | None = None) -> Endpoint:
    return Endpoint(role, "127.0.0.1", engine.port if engine else int(port or 0),
                    f"10.0.0.{int(role is Role.DECODE)}:8998")


def test_metrics_count_requests_latencies_errors_endpoints_and_load() -> None:
    """4 completions (2 streamed) and 1 held stream answered 200, 1 answered 502 by an
    unreachable decode, 1 health probe, 1 unknown route; the in-flight gauge shows the held
    stream on its engine and has no series for it once it ended."""
    held = threading.Event()
    prefill = StandInEngine("p")
    decode = StandInEngine("d", lambda r: Answer(chunks=sse({"t": 1}), stream=True,
                                                 between=held if r.body["prompt"] == "hold"
                                                 else None))
    table = EndpointTable()
    live = _endpoint(Role.DECODE, decode)
    table.replace(Role.PREFILL, [_endpoint(Role.PREFILL, prefill)])
    table.replace(Role.DECODE, [live])
    router = Router(RouterSettings(host="127.0.0.1", port=0, prefill=("http://p:1@p:2",),
                                   decode=("http://d:1@d:2",)), table)
    url = router.url
    holder = threading.Thread(target=call, args=(url, "POST", COMPLETIONS,
                                                 {"prompt": "hold", "stream": True}))
    try:
        for i in range(4):
            assert call(url, "POST", COMPLETIONS, {"prompt": f"q{i}", "stream": i % 2 == 0}
                        )[0] == 200
        table.replace(Role.DECODE, [_endpoint(Role.DECODE, None, closed_port())])
        assert call(url, "POST", COMPLETIONS, {"prompt": "lost"})[0] == 502
        table.replace(Role.DECODE, [live])
        assert call(url, "GET", "/health")[0] == 200
        assert call(url, "GET", "/nowhere")[0] == 404
        holder.start()
        assert wait_for("the held stream to reach decode",
                        lambda: len(decode.requests) == 5, timeout_s=10, interval_s=0.02)
        wait_for("prefill answers to be read",
                 lambda: router.inflight.snapshot() == {live: 1}, timeout_s=10,
                 interval_s=0.02)
        during = _scrape(url)
        held.set()
        holder.join(10)
        wait_for("the held stream to end", lambda: not router.inflight.snapshot(),
                 timeout_s=10, interval_s=0.02)
        after = _scrape(url)
    finally:
        held.set()
        router.close()
        prefill.close()
        decode.close()

    endpoint = live.name
    assert _get(during, "pd_router_in_flight_requests", role="decode", endpoint=endpoint) == 1
    assert not [k for k in after if k[0] == "pd_router_in_flight_requests"]
    assert _get(after, "pd_router_requests_total", route=COMPLETIONS, code="200") == 5
    assert _get(after, "pd_router_requests_total", route=COMPLETIONS, code="502") == 1
    assert _get(after, "pd_router_requests_total", route="/health", code="200") == 1
    assert _get(after, "pd_router_requests_total", route="other", code="404") == 1
    # The scrape during the hold was answered before it was counted: 1 in `after`.
    assert _get(after, "pd_router_requests_total", route="/metrics", code="200") == 1
    assert _get(after, "pd_router_request_duration_seconds_count", route=COMPLETIONS) == 6
    # The 502 wrote no engine body: 5 first bytes.
    assert _get(after, "pd_router_time_to_first_byte_seconds_count", route=COMPLETIONS) == 5
    ttfb_sum = _get(after, "pd_router_time_to_first_byte_seconds_sum", route=COMPLETIONS)
    duration_sum = _get(after, "pd_router_request_duration_seconds_sum", route=COMPLETIONS)
    assert ttfb_sum is not None and duration_sum is not None and 0 < ttfb_sum < duration_sum
    assert _get(after, "pd_router_upstream_errors_total", role="decode",
                reason="unreachable") == 1
    assert _get(after, "pd_router_upstream_errors_total", role="prefill", reason="status") == 0
    assert _get(after, "pd_router_endpoints", role="prefill") == 1
    assert _get(after, "pd_router_endpoints", role="decode") == 1


def test_streamed_answers_give_token_times_and_prefill_answers_their_prompt_tokens() -> None:
    """Two streamed completions of 3 tokens each (50 ms apart, then `[DONE]`) and one plain
    one; every prefill answer names 7 prompt tokens. Time to first token: one per streamed
    answer; inter-token latency: 2 gaps each, of about 50 ms; prompt tokens: 3 x 7."""
    usage = b'{"choices":[{"text":"x"}],"usage":{"prompt_tokens":7,"total_tokens":8}}'
    prefill = StandInEngine("p", lambda _: Answer(chunks=(usage,)))

    def decode_answer(recorded: object) -> Answer:
        body = getattr(recorded, "body", {})
        if not body.get("stream"):
            return Answer()
        return Answer(chunks=sse({"t": 1}, {"t": 2}, {"t": 3}), stream=True, gap_s=0.05,
                      content_type="text/event-stream")

    decode = StandInEngine("d", decode_answer)
    table = EndpointTable()
    table.replace(Role.PREFILL, [_endpoint(Role.PREFILL, prefill)])
    table.replace(Role.DECODE, [_endpoint(Role.DECODE, decode)])
    router = Router(RouterSettings(host="127.0.0.1", port=0, prefill=("http://p:1@p:2",),
                                   decode=("http://d:1@d:2",)), table)
    try:
        for stream in (True, True, False):
            assert call(router.url, "POST", COMPLETIONS, {"prompt": "q", "stream": stream}
                        )[0] == 200
        wait_for("every prefill answer read", lambda: not router.inflight.snapshot(),
                 timeout_s=10, interval_s=0.02)
        after = _scrape(router.url)
    finally:
        router.close()
        prefill.close()
        decode.close()
    assert _get(after, "pd_router_time_to_first_token_seconds_count", route=COMPLETIONS) == 2
    assert _get(after, "pd_router_inter_token_latency_seconds_count", route=COMPLETIONS) == 4
    gaps = _get(after, "pd_router_inter_token_latency_seconds_sum", route=COMPLETIONS)
    assert gaps is not None and 4 * 0.04 < gaps < 4 * 0.5
    # Each gap is at least 40 ms: none in the buckets up to 20 ms, all by 1 s.
    assert _get(after, "pd_router_inter_token_latency_seconds_bucket", route=COMPLETIONS,
                le="0.02") == 0
    assert _get(after, "pd_router_inter_token_latency_seconds_bucket", route=COMPLETIONS,
                le="1.0") == 4
    assert _get(after, "pd_router_prompt_tokens_total") == 21


class Ticks:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def test_a_stream_clock_counts_events_across_and_within_chunks() -> None:
    clock, first, gaps = Ticks(), [], []
    timer = StreamClock(9.5, first.append, gaps.append, clock=clock)
    timer.chunk(b'data: {"t": 1}\n')  # an event cut before its blank line: not yet a token
    assert first == [] and gaps == []
    clock.now = 10.25
    timer.chunk(b'\ndata: {"t": 2}\n\ndata: {"t"')  # ends event 1, holds event 2 whole
    clock.now = 10.5
    timer.chunk(b': 3}\n\ndata: [DONE]\n\n')  # event 3; [DONE] is no token
    assert first == [0.75] and gaps == [0.0, 0.25]
    assert prompt_tokens(b'{"usage": {"prompt_tokens": 12}}') == 12
    for answer in (b"not json", b"[]", b'{"usage": null}', b'{"usage": {"prompt_tokens": -1}}',
                   b'{"usage": {"prompt_tokens": true}}'):
        assert prompt_tokens(answer) is None, answer
