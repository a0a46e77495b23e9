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
