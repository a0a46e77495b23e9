"""The P/D router over real HTTP against stand-in engines (`pd_testbed.router_engines`): the
exact bodies each protocol sends to prefill and decode, streams passed through as they
arrive and byte for byte, engines' errors relayed, unreachable engines, bounded bodies,
health and draining. Real vLLM behind the router is exercised by the e2e tests
(`tests/e2e/test_vllm_pd_transfer.py`); the stand-ins give exact requests and answers and
faults on cue. Needs neither NIXL, torch nor a GPU."""

from __future__ import annotations

import http.client
import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pd_contract.transferagent import Role
from pd_testbed.router_engines import Answer, Recorded, StandInEngine, call, closed_port, sse
from pd_transfer.router import EndpointTable, PDProtocol, PolicyName, Router, RouterSettings
from pd_transfer.router.endpoints import Endpoint

pytestmark = pytest.mark.timeout(30)

PREFILL_BOOT = "10.0.0.1:8998"
DECODE_BOOT = "10.0.0.2:8998"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# vLLM NixlConnector's answer to a do_remote_decode prefill: what decode must be sent.
NIXL_PARAMS = {"do_remote_decode": False, "do_remote_prefill": True,
               "remote_engine_id": "engine-p0", "remote_block_ids": [3, 4, 9],
               "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 1}


class Pair:
    """One prefill and one decode stand-in behind a router."""

    def __init__(self, protocol: PDProtocol = PDProtocol.PD_TRANSFER, **settings: Any) -> None:
        self.prefill = StandInEngine("prefill")
        self.decode = StandInEngine("decode")
        self.router = Router(RouterSettings(
            host="127.0.0.1", port=0, protocol=protocol, policy=PolicyName.ROUND_ROBIN,
            prefill=(self.prefill.spec(PREFILL_BOOT),), decode=(self.decode.spec(DECODE_BOOT),),
            **settings))

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None,
             ) -> tuple[int, dict[str, str], bytes]:
        return call(self.router.url, "POST", path, body, headers=headers)

    def errors(self, role: str, reason: str) -> float:
        value = self.router.metrics.registry.get_sample_value(
            "pd_router_upstream_errors_total", {"role": role, "reason": reason})
        return float(value or 0)

    def close(self) -> None:
        self.router.close()
        self.prefill.close()
        self.decode.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def nixl() -> Iterator[Pair]:
    p = Pair(PDProtocol.VLLM_NIXL)
    try:
        yield p
    finally:
        p.close()


def _wait_both(pair: Pair) -> None:
    """Prefill answers only once decode's request has arrived (they are sent at once)."""
    released = threading.Event()

    def prefill_answer(_: Recorded) -> Answer:
        return Answer(before=released)

    def decode_answer(_: Recorded) -> Answer:
        released.set()
        return Answer(chunks=[b'{"from":"decode"}'])

    pair.prefill.answer, pair.decode.answer = prefill_answer, decode_answer


# -- pd-transfer ----------------------------------------------------------------------------

def test_pd_transfer_sends_prefill_and_decode_at_once_with_exact_bodies(pair: Pair) -> None:
    """Guards the connector contract (`pd_transfer.protocol.handoff`): one room on both sides,
    each told the other's bootstrap address, prefill cut to one unstreamed token; and a
    client's own kv_transfer_params never reaching an engine."""
    _wait_both(pair)  # would deadlock (and time out) if the router sent them one by one
    client = {"model": "m", "prompt": "Hello", "max_tokens": 7, "stream": False,
              "min_tokens": 2, "kv_transfer_params": {"remote_host": "evil.example"}}
    status, headers, body = pair.post(COMPLETIONS, client,
                                      {"X-Request-Id": "req-1", "Authorization": "Bearer k"})
    assert (status, body) == (200, b'{"from":"decode"}')
    assert headers["X-Request-Id"] == "req-1"
    pair.router.close(drain_s=5)  # the prefill answer has been read: the counts are final
    (prefill,), (decode,) = pair.prefill.requests, pair.decode.requests
    room = decode.body["kv_transfer_params"]["pd_transfer"]["room"]
    assert re.fullmatch(r"[0-9a-f]{32}", room)
    assert prefill.body == {"model": "m", "prompt": "Hello", "max_tokens": 1, "stream": False,
                            "kv_transfer_params": {"pd_transfer": {"room": room,
                                                                   "decode": DECODE_BOOT}}}
    assert decode.body == {"model": "m", "prompt": "Hello", "max_tokens": 7, "stream": False,
                           "min_tokens": 2,
                           "kv_transfer_params": {"pd_transfer": {"room": room,
                                                                  "prefill": PREFILL_BOOT}}}
    for request in (prefill, decode):
        assert (request.method, request.path) == ("POST", COMPLETIONS)
        assert request.headers["X-Request-Id"] == "req-1"
        assert request.headers["Authorization"] == "Bearer k"
    assert pair.router.inflight.snapshot() == {}  # invariant: nothing left in flight


def test_pd_transfer_chat_prefill_computes_one_token(pair: Pair) -> None:
    """vLLM prefers max_completion_tokens over max_tokens and refuses min_tokens above it;
    a stream's options make no sense for an unstreamed prefill."""
    client = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
              "stream_options": {"include_usage": True}, "max_completion_tokens": 50,
              "min_completion_tokens": 3}
    assert pair.post(CHAT, client)[0] == 200
    pair.router.close(drain_s=5)
    (prefill,), (decode,) = pair.prefill.requests, pair.decode.requests
    room = prefill.body["kv_transfer_params"]["pd_transfer"]["room"]
    assert prefill.path == decode.path == CHAT
    assert prefill.body == {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                            "stream": False, "max_completion_tokens": 1, "max_tokens": 1,
                            "kv_transfer_params": {"pd_transfer": {"room": room,
                                                                   "decode": DECODE_BOOT}}}
    assert decode.body == {**client, "kv_transfer_params": {
        "pd_transfer": {"room": room, "prefill": PREFILL_BOOT}}}


def test_streams_pass_through_as_they_arrive_byte_for_byte(pair: Pair) -> None:
    """Guards against a router that buffers a stream: the client reads the first event
    while decode still holds the rest."""
    events = sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
                 {"choices": [{"text": "c"}], "usage": {"completion_tokens": 3}})
    held = threading.Event()
    pair.decode.answer = lambda _: Answer(chunks=events, stream=True, between=held,
                                          content_type="text/event-stream")
    host, port = pair.router.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request("POST", COMPLETIONS, json.dumps({"prompt": "x", "stream": True}),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        assert response.getheader("Content-Type") == "text/event-stream"
        first = response.read1(65536)
        assert first == events[0]  # arrived while the rest was held back
        held.set()
        assert first + response.read() == b"".join(events)
    finally:
        held.set()
        connection.close()


def test_decode_errors_reach_the_client_with_their_status_and_body(pair: Pair) -> None:
    error = b'{"object":"error","message":"max_tokens is too large","code":400}'
    pair.decode.answer = lambda _: Answer(status=400, chunks=[error])
    status, headers, body = pair.post(COMPLETIONS, {"prompt": "x", "max_tokens": 10**9})
    assert (status, body, headers["Content-Type"]) == (400, error, "application/json")
    assert pair.errors("decode", "status") == 0  # a client error, not an engine failure


def test_a_failed_prefill_is_logged_and_counted_and_decode_still_answers(
        pair: Pair, caplog: pytest.LogCaptureFixture) -> None:
    """pd-transfer: decode's answer is the client's; its connector decides what a request
    without the KV does. The prefill failure must still be visible."""
    pair.prefill.answer = lambda _: Answer(status=500, chunks=[b'{"message":"prefill OOM"}'])
    with caplog.at_level(logging.WARNING, logger="pd_transfer.router"):
        status, _, body = pair.post(COMPLETIONS, {"prompt": "x"})
        pair.router.close(drain_s=5)
    assert status == 200 and body == Answer().body
    assert pair.errors("prefill", "status") == 1
    assert any("prefill engine" in r.message and "answered 500" in r.message
               and "prefill OOM" in r.message for r in caplog.records)


def test_an_unreachable_decode_is_a_502_naming_the_engine_and_costs_no_prefill() -> None:
    prefill = StandInEngine("prefill")
    dead = f"127.0.0.1:{closed_port()}"
    router = Router(RouterSettings(host="127.0.0.1", port=0, prefill=(prefill.spec(PREFILL_BOOT),),
                                   decode=(f"http://{dead}@{DECODE_BOOT}",)))
    try:
        status, _, body = call(router.url, "POST", COMPLETIONS, {"prompt": "x"})
        error = json.loads(body)["error"]
        assert status == 502
        assert error["type"] == "upstream_error" and error["code"] == 502
        assert (error["role"], error["engine"]) == ("decode", dead)
        assert f"decode engine {dead}: unreachable" in error["message"]
        assert router.metrics.registry.get_sample_value(
            "pd_router_upstream_errors_total", {"role": "decode", "reason": "unreachable"}) == 1
        # The decode connection is opened first: no prefill computed KV nobody will take.
        assert prefill.requests == []
    finally:
        router.close(drain_s=5)
        prefill.close()


def test_an_answer_cut_mid_stream_never_looks_complete(pair: Pair) -> None:
    """Guards against relaying a dropped decode as a short but well-formed answer: the
    terminating chunk is withheld and the client connection closed."""
    events = sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]})
    pair.decode.answer = lambda _: Answer(chunks=events, stream=True, drop_after=1)
    with pytest.raises(http.client.IncompleteRead):
        pair.post(COMPLETIONS, {"prompt": "x", "stream": True})
    assert pair.errors("decode", "broken") == 1


def test_a_body_cut_before_its_content_length_is_not_complete(pair: Pair) -> None:
    pair.decode.answer = lambda _: Answer(chunks=[b'{"a":', b'"b"}'], drop_after=1)
    with pytest.raises(http.client.IncompleteRead):
        pair.post(COMPLETIONS, {"prompt": "x"})
    assert pair.errors("decode", "broken") == 1


# -- vllm-nixl ------------------------------------------------------------------------------

def test_vllm_nixl_sends_prefill_first_then_decode_with_its_params(nixl: Pair) -> None:
    """As vLLM's toy proxy drives NixlConnector; decode starts only after prefill's answer,
    and gets exactly the params that answer held."""
    answered: list[float] = []

    def prefill_answer(_: Recorded) -> Answer:
        answered.append(time.monotonic())
        return Answer(chunks=[json.dumps({"choices": [{"text": "x"}],
                                          "kv_transfer_params": NIXL_PARAMS}).encode()])

    nixl.prefill.answer = prefill_answer
    client = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 5, "stream": True,
              "stream_options": {"include_usage": True}, "min_tokens": 2,
              "kv_transfer_params": {"remote_host": "evil.example"}}
    status, _, body = nixl.post(COMPLETIONS, client, {"X-Request-Id": "r-2"})
    assert (status, body) == (200, Answer().body)
    (prefill,), (decode,) = nixl.prefill.requests, nixl.decode.requests
    assert prefill.body == {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1,
                            "stream": False, "kv_transfer_params": {
                                "do_remote_decode": True, "do_remote_prefill": False,
                                "remote_engine_id": None, "remote_block_ids": None,
                                "remote_host": None, "remote_port": None}}
    assert decode.body == {**client, "kv_transfer_params": NIXL_PARAMS}
    assert decode.at >= answered[0]
    assert prefill.headers["X-Request-Id"] == decode.headers["X-Request-Id"] == "r-2"


def test_vllm_nixl_relays_a_prefill_error_as_is_and_never_calls_decode(nixl: Pair) -> None:
    error = b'{"object":"error","message":"prompt too long","code":400}'
    nixl.prefill.answer = lambda _: Answer(status=400, chunks=[error])
    status, _, body = nixl.post(COMPLETIONS, {"prompt": "x" * 10})
    assert (status, body) == (400, error)
    assert nixl.decode.requests == []


def test_vllm_nixl_without_params_decodes_alone_and_counts_it(nixl: Pair) -> None:
    """A prefill engine without NixlConnector answers without params: decode computes the
    prompt itself (the client is served) and the misconfiguration shows in the metrics."""
    status, _, _ = nixl.post(COMPLETIONS, {"prompt": "x", "kv_transfer_params": {"a": 1}})
    assert status == 200
    assert nixl.decode.bodies() == [{"prompt": "x"}]
    assert nixl.errors("prefill", "no_transfer_params") == 1


def test_vllm_nixl_unreachable_or_invalid_prefill_is_a_502(nixl: Pair) -> None:
    nixl.prefill.answer = lambda _: Answer(chunks=[b"<html>not json</html>"])
    status, _, body = nixl.post(COMPLETIONS, {"prompt": "x"})
    assert status == 502 and json.loads(body)["error"]["role"] == "prefill"
    assert nixl.errors("prefill", "invalid_response") == 1
    nixl.prefill.close()
    status, _, body = nixl.post(COMPLETIONS, {"prompt": "x"})
    assert status == 502 and "unreachable" in json.loads(body)["error"]["message"]
    assert nixl.decode.requests == []


# -- bounds, routes, health, models --------------------------------------------------------

@pytest.mark.parametrize(("headers", "raw", "status"), [
    ({"Content-Length": "2000"}, b"", 413),  # over the limit: not read at all
    ({"Transfer-Encoding": "chunked"}, b"0\r\n\r\n", 411),
    ({}, b"not json", 400),
    ({}, b"[1, 2]", 400),
    ({}, b"[" * 1020, 400),  # deeper than the JSON parser's recursion limit
])
def test_request_bodies_are_bounded_and_must_be_json_objects(
        headers: dict[str, str], raw: bytes, status: int) -> None:
    p = Pair(max_body_bytes=1024)
    try:
        host, port = p.router.url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            connection.putrequest("POST", COMPLETIONS)
            sent = {"Content-Length": str(len(raw)), **headers}
            for name, value in sent.items():
                connection.putheader(name, value)
            connection.endheaders(raw)
            response = connection.getresponse()
            error = json.loads(response.read())["error"]
        finally:
            connection.close()
        assert (response.status, error["code"]) == (status, status)
        assert p.prefill.requests == p.decode.requests == []
    finally:
        p.close()


def test_a_request_without_content_length_is_411(pair: Pair) -> None:
    host, port = pair.router.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.putrequest("POST", COMPLETIONS)
        connection.endheaders()
        assert connection.getresponse().status == 411
    finally:
        connection.close()


def test_unknown_routes_and_methods(pair: Pair) -> None:
    status, _, body = call(pair.router.url, "POST", "/v1/embeddings", {"input": "x"})
    assert status == 404 and "POST /v1/completions" in json.loads(body)["error"]["message"]
    assert call(pair.router.url, "GET", COMPLETIONS)[0] == 405
    assert call(pair.router.url, "POST", "/health", {})[0] == 405


def test_models_come_from_a_decode_engine(pair: Pair) -> None:
    models = b'{"object":"list","data":[{"id":"tiny-llama"}]}'
    pair.decode.answer = lambda _: Answer(chunks=[models])
    status, _, body = call(pair.router.url, "GET", "/v1/models",
                           headers={"Authorization": "Bearer k"})
    assert (status, body) == (200, models)
    (request,) = pair.decode.requests
    assert (request.method, request.path, request.headers["Authorization"]) == (
        "GET", "/v1/models", "Bearer k")
    assert pair.prefill.requests == []


def _health(router: Router) -> tuple[int, dict[str, Any]]:
    status, _, body = call(router.url, "GET", "/health")
    return status, json.loads(body)


def test_health_is_ready_only_with_a_prefill_and_a_decode_endpoint() -> None:
    """The router Deployment's readiness probe: 503 names the role without an endpoint."""
    table = EndpointTable()
    router = Router(RouterSettings(host="127.0.0.1", port=0, prefill=("http://p:1@p:2",),
                                   decode=("http://d:1@d:2",), endpoint_wait_s=0), table)
    prefill = Endpoint(Role.PREFILL, "10.0.0.1", 8000, PREFILL_BOOT)
    decode = Endpoint(Role.DECODE, "10.0.0.2", 8000, DECODE_BOOT)
    try:
        assert _health(router) == (503, {"status": "unavailable",
                                         "endpoints": {"prefill": 0, "decode": 0},
                                         "missing": ["prefill", "decode"],
                                         "message": "no ready prefill or decode engine"})
        status, body = call(router.url, "POST", COMPLETIONS, {"prompt": "x"})[::2]
        assert status == 503 and json.loads(body)["error"] == {
            "message": "no ready prefill engine: the router has none in rotation "
                       "(see GET /health)",
            "type": "no_ready_endpoint", "code": 503}
        table.replace(Role.PREFILL, [prefill])
        assert _health(router)[0] == 503 and _health(router)[1]["missing"] == ["decode"]
        table.replace(Role.DECODE, [decode])
        assert _health(router) == (200, {"status": "ok", "endpoints": {"prefill": 1,
                                                                       "decode": 1},
                                         "missing": [], "message": "ready"})
        table.replace(Role.PREFILL, [])
        assert _health(router)[1]["missing"] == ["prefill"]
    finally:
        router.close()


def _wait_sample(router: Router, role: str, outcome: str, name: str = "count") -> float:
    return float(router.metrics.registry.get_sample_value(
        f"pd_router_endpoint_wait_seconds_{name}", {"role": role, "outcome": outcome}) or 0)


def test_a_request_waits_for_a_decode_to_rejoin_the_rotation_then_is_served() -> None:
    """A decode briefly out of rotation (a restart, a missed readiness probe) costs the
    request latency, not a 503: it waits, is counted as waiting, and goes to the decode that
    joins."""
    prefill, decode = StandInEngine("prefill"), StandInEngine("decode")
    decode.answer = lambda _: Answer(chunks=[b'{"from":"decode"}'])
    table = EndpointTable()
    router = Router(RouterSettings(host="127.0.0.1", port=0, prefill=("http://p:1@p:2",),
                                   decode=("http://d:1@d:2",), endpoint_wait_s=20), table)
    table.replace(Role.PREFILL, [Endpoint(Role.PREFILL, "127.0.0.1", prefill.port,
                                          PREFILL_BOOT)])
    answers: list[tuple[int, dict[str, str], bytes]] = []
    client = threading.Thread(target=lambda: answers.append(
        call(router.url, "POST", COMPLETIONS, {"prompt": "x", "max_tokens": 3})))
    try:
        client.start()
        deadline = time.monotonic() + 10
        while table.waiting()[Role.DECODE] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert table.waiting() == {Role.PREFILL: 0, Role.DECODE: 1}
        assert router.metrics.registry.get_sample_value(
            "pd_router_endpoint_waiting_requests", {"role": "decode"}) == 1.0
        time.sleep(0.3)
        assert answers == [] and decode.requests == []
        table.replace(Role.DECODE, [Endpoint(Role.DECODE, "127.0.0.1", decode.port,
                                             DECODE_BOOT)])
        client.join(10)
        assert [(status, body) for status, _, body in answers] == [(200, b'{"from":"decode"}')]
        assert len(decode.requests) == 1 and table.waiting()[Role.DECODE] == 0
        assert _wait_sample(router, "decode", "served") == 1.0
        assert _wait_sample(router, "decode", "served", "sum") >= 0.3
        assert _wait_sample(router, "decode", "refused") == 0.0
        assert _wait_sample(router, "prefill", "served") == 0.0  # found one at once
    finally:
        router.close(drain_s=5)
        prefill.close()
        decode.close()


def test_a_request_is_refused_503_once_its_endpoint_wait_ends() -> None:
    table = EndpointTable()
    router = Router(RouterSettings(host="127.0.0.1", port=0, prefill=("http://p:1@p:2",),
                                   decode=("http://d:1@d:2",), endpoint_wait_s=0.5), table)
    try:
        started = time.monotonic()
        status, _, body = call(router.url, "POST", COMPLETIONS, {"prompt": "x"})
        waited = time.monotonic() - started
        assert status == 503 and json.loads(body)["error"]["message"] == (
            "no ready prefill engine: the router has none in rotation after waiting 0.5 s for "
            "one (see GET /health)")
        assert 0.5 <= waited < 5
        assert _wait_sample(router, "prefill", "refused") == 1.0
        assert table.waiting() == {Role.PREFILL: 0, Role.DECODE: 0}
    finally:
        router.close()


def test_closing_with_a_drain_finishes_requests_in_flight_and_turns_health_503(
        pair: Pair) -> None:
    held = threading.Event()
    pair.decode.answer = lambda _: Answer(chunks=sse({"t": 1}, {"t": 2}), stream=True,
                                          between=held)
    answers: list[tuple[int, dict[str, str], bytes]] = []
    client = threading.Thread(target=lambda: answers.append(
        pair.post(COMPLETIONS, {"prompt": "x", "stream": True})))
    client.start()
    assert pair.decode.arrived.wait(10)
    closer = threading.Thread(target=pair.router.close, kwargs={"drain_s": 10})
    closer.start()
    status, body = _health(pair.router)
    assert (status, body["status"]) == (503, "draining")
    held.set()
    client.join(10)
    closer.join(10)
    assert not closer.is_alive()
    assert answers[0][0] == 200 and answers[0][2] == b"".join(sse({"t": 1}, {"t": 2}))


def test_a_draining_router_still_takes_new_requests_while_it_lingers(pair: Pair) -> None:
    """Guards against a router that stops listening the moment it is told to stop, while
    the Service and the proxies still send it requests: for `linger_s` a new request is
    served (with /health 503 meanwhile), and the close ends once the linger is over."""
    closer = threading.Thread(target=pair.router.close, kwargs={"drain_s": 10,
                                                               "linger_s": 1.0})
    started = time.monotonic()
    closer.start()
    assert _health(pair.router)[0] == 503
    status, _, _ = pair.post(COMPLETIONS, {"prompt": "late"})
    assert status == 200 and time.monotonic() - started < 1.0
    closer.join(10)
    assert not closer.is_alive() and 1.0 <= time.monotonic() - started < 5.0
