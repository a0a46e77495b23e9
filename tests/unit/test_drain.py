"""`pd-transfer drain` (the engine pods' preStop hook): what a reading finds, read over real
HTTP from a local server that serves exposition text as vLLM's and the connector's
endpoints do, and when the wait ends."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pd_transfer.drain import Holding, drain, read_holding
from pd_transfer.native.scrape import fetch_metrics

pytestmark = pytest.mark.timeout(30)

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
"""
CONNECTOR = """# HELP pd_transfer_connector_live_requests Requests with connector state
# TYPE pd_transfer_connector_live_requests gauge
pd_transfer_connector_live_requests{{side="scheduler"}} {scheduler}
pd_transfer_connector_live_requests{{rank="0",side="rank"}} {rank}
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
    pages.texts["/metrics"] = VLLM.format(running=2, waiting=1)
    pages.texts["/kv"] = CONNECTOR.format(scheduler=3, rank=5)
    held = read_holding("vllm", f"{base}/metrics", f"{base}/kv")
    assert held == Holding(2, 1, 3, with_connector=True)
    assert not held.empty
    assert held.describe("prefill") == "2 running, 1 waiting, 3 KV transfers not yet pulled"
    pages.texts["/metrics"] = VLLM.format(running=0, waiting=0)
    pages.texts["/kv"] = CONNECTOR.format(scheduler=0, rank=1)  # ranks are not the measure
    assert read_holding("vllm", f"{base}/metrics", f"{base}/kv").empty
    # Without a connector (an engine-native pod) only the queues count.
    alone = read_holding("vllm", f"{base}/metrics", None)
    assert alone == Holding(0, 0, None) and alone.empty
    assert alone.describe("decode") == "0 running, 0 waiting"


def test_what_cannot_be_read_is_never_empty_unless_the_engine_is_gone(
        server: tuple[str, Pages]) -> None:
    base, pages = server
    pages.texts["/metrics"] = VLLM.format(running=0, waiting=0)
    # The connector's endpoint answers 404: not known to be empty.
    unread = read_holding("vllm", f"{base}/metrics", f"{base}/missing")
    assert unread == Holding(0, 0, None, with_connector=True) and not unread.empty
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
    readings = iter([Holding(1, 0, 2, True), Holding(0, 0, 1, True), Holding(0, 0, 0, True),
                     Holding(1, 0, 0, True), Holding(0, 0, 0, True), Holding(0, 0, 0, True)])
    clock, said = Clock(), []
    assert drain("prefill", lambda: next(readings), timeout_s=60, interval_s=1.0,
                 say=said.append, clock=clock, sleep=clock.sleep)
    assert said == [
        "draining prefill: 1 running, 0 waiting, 2 KV transfers not yet pulled (0.0 s of 60 s)",
        "draining prefill: 0 running, 0 waiting, 1 KV transfers not yet pulled (1.0 s of 60 s)",
        "draining prefill: 0 running, 0 waiting, 0 KV transfers not yet pulled (2.0 s of 60 s)",
        "draining prefill: 1 running, 0 waiting, 0 KV transfers not yet pulled (3.0 s of 60 s)",
        "draining prefill: 0 running, 0 waiting, 0 KV transfers not yet pulled (4.0 s of 60 s)",
        "drained prefill after 5.0 s",
    ]


def test_drain_gives_up_at_its_deadline() -> None:
    clock, said = Clock(), []
    assert not drain("decode", lambda: Holding(1, 0, 0, True), timeout_s=5, interval_s=1.0,
                     say=said.append, clock=clock, sleep=clock.sleep)
    assert said[-1] == ("decode not drained after 5.0 s (1 running, 0 waiting, 0 KV loads "
                        "live); stopping anyway")
    assert clock.now == 5.0
