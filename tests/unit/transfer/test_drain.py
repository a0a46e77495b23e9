"""`pd-transfer drain` (the engine pods' preStop hook): what a reading finds, read over real
HTTP from a local server that serves exposition text as vLLM's and the connector's
endpoints do, and when the wait ends."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import cast

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pd_transfer.drain import Holding, drain, read_holding
from pd_transfer.native.scrape import fetch_metrics
from pd_transfer.reference.engine.main import EngineCollector
from pd_transfer.reference.engine.service import EngineService

pytestmark = pytest.mark.timeout(30)

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{{engine="0",finished_reason="length",model_name="m"}} {length}
vllm:request_success_total{{engine="0",finished_reason="stop",model_name="m"}} 2.0
"""
CONNECTOR = """# HELP pd_transfer_connector_live_requests Requests with connector state
# TYPE pd_transfer_connector_live_requests gauge
pd_transfer_connector_live_requests{{side="scheduler"}} {scheduler}
pd_transfer_connector_live_requests{{rank="0",side="rank"}} {rank}
# HELP pd_transfer_kv_pending_bytes KV bytes of the requests live on this rank
# TYPE pd_transfer_kv_pending_bytes gauge
pd_transfer_kv_pending_bytes{{rank="0",role="prefill"}} {pending}
pd_transfer_kv_pending_bytes{{rank="1",role="prefill"}} {pending}
# HELP pd_transfer_requests_total Finished requests
# TYPE pd_transfer_requests_total counter
pd_transfer_requests_total{{rank="0",result="succeeded",role="prefill"}} 40.0
pd_transfer_requests_total{{rank="1",result="succeeded",role="prefill"}} 40.0
pd_transfer_requests_total{{rank="1",result="failed",role="prefill"}} 1.0
"""


class Pages:
    """What the local server answers per path (mutable between readings)."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}


@pytest.fixture
def server() -> Iterator[tuple[str, Pages]]:
    pages = Pages()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.texts.get(self.path)
            if body is None:
                self.send_error(404)
                return
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", pages
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_reading_sums_the_engine_queues_and_the_schedulers_live_requests(
        server: tuple[str, Pages]) -> None:
    base, pages = server
    pages.texts["/metrics"] = VLLM.format(running=2, waiting=1, length=39)
    pages.texts["/kv"] = CONNECTOR.format(scheduler=3, rank=5, pending=4096)
    held = read_holding("vllm", f"{base}/metrics", f"{base}/kv")
    assert held == Holding(2, 1, 3, with_connector=True, pending_bytes=8192, finished=41,
                           succeeded=80, failed=1)
    assert not held.empty
    assert held.describe("prefill") == (
        "2 running, 1 waiting, 3 KV transfers not yet pulled (8192 bytes)")
    assert held.totals() == (
        "the engine finished 41 requests; connector transfers: 80 succeeded, 1 failed")
    pages.texts["/metrics"] = VLLM.format(running=0, waiting=0, length=39)
    pages.texts["/kv"] = CONNECTOR.format(scheduler=0, rank=1, pending=0)  # ranks: not the measure
    assert read_holding("vllm", f"{base}/metrics", f"{base}/kv").empty
    # Without a connector (an engine-native pod) only the queues count.
    alone = read_holding("vllm", f"{base}/metrics", None)
    assert alone == Holding(0, 0, None, finished=41) and alone.empty
    assert alone.describe("decode") == "0 running, 0 waiting"
    assert alone.totals() == "the engine finished 41 requests"


def test_what_cannot_be_read_is_never_empty_unless_the_engine_is_gone(
        server: tuple[str, Pages]) -> None:
    base, pages = server
    pages.texts["/metrics"] = VLLM.format(running=0, waiting=0, length=0)
    # The connector's endpoint answers 404: not known to be empty.
    unread = read_holding("vllm", f"{base}/metrics", f"{base}/missing")
    assert unread == Holding(0, 0, None, with_connector=True, finished=2)
    assert not unread.empty
    # Text without the gauges (another engine's): not empty.
    pages.texts["/other"] = "# TYPE other gauge\nother 1\n"
    assert not read_holding("vllm", f"{base}/other", None).empty
    # Nothing listens: the engine has exited, so nothing is left.
    gone = read_holding("vllm", "http://127.0.0.1:9/metrics", None, fetch=fetch_metrics)
    assert gone.engine_gone and gone.empty
    assert gone.describe("prefill") == "the engine has exited"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_drain_ends_after_two_empty_readings_in_a_row_and_reports_progress() -> None:
    def held(running: int, transfers: int, finished: int) -> Holding:
        return Holding(running, 0, transfers, True, finished=finished,
                       succeeded=finished - running, failed=0)

    readings = iter([held(1, 2, 8), held(0, 1, 9), held(0, 0, 9), held(1, 0, 9),
                     held(0, 0, 10), held(0, 0, 10)])
    clock, said = Clock(), []
    assert drain("prefill", lambda: next(readings), timeout_s=60, interval_s=1.0,
                 say=said.append, clock=clock, sleep=clock.sleep)
    assert said == [
        "draining prefill: 1 running, 0 waiting, 2 KV transfers not yet pulled (0.0 s of 60 s)",
        "draining prefill: 0 running, 0 waiting, 1 KV transfers not yet pulled (1.0 s of 60 s)",
        "draining prefill: 0 running, 0 waiting, 0 KV transfers not yet pulled (2.0 s of 60 s)",
        "draining prefill: 1 running, 0 waiting, 0 KV transfers not yet pulled (3.0 s of 60 s)",
        "draining prefill: 0 running, 0 waiting, 0 KV transfers not yet pulled (4.0 s of 60 s)",
        "drained prefill after 5.0 s: the engine finished 10 requests; connector transfers: "
        "10 succeeded, 0 failed",
    ]


def test_drain_gives_up_at_its_deadline() -> None:
    clock, said = Clock(), []
    assert not drain("decode", lambda: Holding(1, 0, 0, True), timeout_s=5, interval_s=1.0,
                     say=said.append, clock=clock, sleep=clock.sleep)
    assert said[-1] == ("decode not drained after 5.0 s (1 running, 0 waiting, 0 KV loads "
                        "live); stopping anyway")
    assert clock.now == 5.0


REFERENCE = """# HELP pd_reference_requests_running Requests accepted, not answered
# TYPE pd_reference_requests_running gauge
pd_reference_requests_running {running}
# HELP pd_reference_requests_finished_total Requests the engine answered, either way
# TYPE pd_reference_requests_finished_total counter
pd_reference_requests_finished_total 12.0
# HELP pd_transfer_live_requests Requests in flight
# TYPE pd_transfer_live_requests gauge
pd_transfer_live_requests{{rank="0",role="decode"}} {live}
pd_transfer_live_requests{{rank="1",role="decode"}} {live}
# HELP pd_transfer_requests_total Finished requests
# TYPE pd_transfer_requests_total counter
pd_transfer_requests_total{{rank="0",result="succeeded",role="decode"}} 12.0
pd_transfer_requests_total{{rank="1",result="succeeded",role="decode"}} 11.0
pd_transfer_requests_total{{rank="1",result="failed",role="decode"}} 1.0
"""


def test_the_reference_engine_is_read_from_its_one_metrics_port(
        server: tuple[str, Pages]) -> None:
    """Guards against a reference pod's hook that ends while a request or its KV is live:
    the engine has no queue (waiting is 0), its ranks' live requests are the KV it holds."""
    base, pages = server
    url = f"{base}/metrics"
    pages.texts["/metrics"] = REFERENCE.format(running=1, live=1)
    held = read_holding("reference", url, url)
    assert held == Holding(1, 0, 2, with_connector=True, finished=12, succeeded=23, failed=1)
    assert held.describe("decode") == "1 running, 0 waiting, 2 KV loads live"
    pages.texts["/metrics"] = REFERENCE.format(running=0, live=1)
    assert not read_holding("reference", url, url).empty
    pages.texts["/metrics"] = REFERENCE.format(running=0, live=0)
    assert read_holding("reference", url, url).empty


def test_the_engines_collector_serves_what_the_hook_reads(server: tuple[str, Pages]) -> None:
    """The names the reference engine exports are the ones `--engine reference` reads."""
    class Service:
        running_requests, finished_requests, failed_requests = 3, 17, 2

    registry = CollectorRegistry()
    registry.register(EngineCollector(cast(EngineService, Service())))
    base, pages = server
    pages.texts["/metrics"] = generate_latest(registry).decode()
    held = read_holding("reference", f"{base}/metrics", None)
    assert (held.running, held.waiting, held.finished) == (3, 0, 17)
    assert "pd_reference_requests_failed_total 2.0" in pages.texts["/metrics"]


def test_drain_waits_out_its_settle_time_for_clients_that_list_pods() -> None:
    """Guards against a leaving pod stopped before a client that lists the pods every few
    seconds has seen it leave: empty from the start, the hook still ends at 5 s, not 1 s."""
    clock, said = Clock(), []
    assert drain("prefill", lambda: Holding(0, 0, 0, True, finished=4, succeeded=4, failed=0),
                 timeout_s=60, interval_s=1.0, settle_s=5.0, say=said.append, clock=clock,
                 sleep=clock.sleep)
    assert clock.now == 5.0
    assert said[-1] == ("drained prefill after 5.0 s: the engine finished 4 requests; "
                        "connector transfers: 4 succeeded, 0 failed")
