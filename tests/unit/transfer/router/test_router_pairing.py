"""The router pairs a prefill only with a decode of the same KV-compatibility key (the pods'
`pd.serving.dev/kv-compat` label): during a change of the model, page size, KV dtype or image,
old and new engines both serve, each with its own kind, and no request crosses the two.
Stand-in engines over real HTTP (`pd_testbed.router_engines`); both P/D protocols."""

from __future__ import annotations

import json
import threading
import time

import pytest

from pd_contract.transferagent import Role
from pd_testbed.router_engines import Answer, StandInEngine, call
from pd_transfer.router import Endpoint, EndpointTable, Router, RouterSettings
from pd_transfer.router.pods import EnginePorts, pod_endpoint

pytestmark = pytest.mark.timeout(30)

COMPLETIONS = "/v1/completions"
NIXL_PARAMS = {"kv_transfer_params": {"remote_engine_id": "e", "remote_block_ids": [1]}}


def endpoint(role: Role, engine: StandInEngine, compat: str | None) -> Endpoint:
    return Endpoint(role, "127.0.0.1", engine.port, f"127.0.0.1:{engine.port + 1}",
                    pod=engine.name, compat=compat)


def router(table: EndpointTable, wait_s: float = 5.0, protocol: str = "pd-transfer") -> Router:
    return Router(RouterSettings(host="127.0.0.1", port=0, prefill=("http://p:1@p:2",),
                                 decode=("http://d:1@d:2",), endpoint_wait_s=wait_s,
                                 protocol=protocol), table)  # type: ignore[arg-type]


def test_a_pod_endpoint_carries_its_kv_compat_label() -> None:
    pod = {"metadata": {"name": "llama-prefill-0", "labels": {
        "pd.serving.dev/role": "prefill", "pd.serving.dev/kv-compat": "0123456789abcdef"}},
           "status": {"podIP": "10.0.0.5", "conditions": [{"type": "Ready", "status": "True"}]}}
    found = pod_endpoint(pod, EnginePorts(8000, 8998))
    assert found is not None and found.compat == "0123456789abcdef"
    del pod["metadata"]["labels"]["pd.serving.dev/kv-compat"]  # type: ignore[attr-defined]
    unlabelled = pod_endpoint(pod, EnginePorts(8000, 8998))
    assert unlabelled is not None and unlabelled.compat is None


def test_requests_pair_only_engines_of_one_key_while_two_keys_serve() -> None:
    """Old (key A) and new (key B) engines side by side: 8 requests, each to a prefill and a
    decode of one key, both keys used, never crossed (the decode's request names the
    prefill's bootstrap, so the pairing is read from what decode was sent)."""
    engines = {name: StandInEngine(name) for name in ("pA", "pB", "dA", "dB")}
    table = EndpointTable()
    table.replace(Role.PREFILL, [endpoint(Role.PREFILL, engines["pA"], "A"),
                                 endpoint(Role.PREFILL, engines["pB"], "B")])
    table.replace(Role.DECODE, [endpoint(Role.DECODE, engines["dA"], "A"),
                                endpoint(Role.DECODE, engines["dB"], "B")])
    live = router(table)
    try:
        for i in range(8):
            assert call(live.url, "POST", COMPLETIONS, {"prompt": f"q{i}"})[0] == 200
        wait = time.monotonic() + 10
        while sum(len(e.requests) for e in engines.values()) < 16 and time.monotonic() < wait:
            time.sleep(0.02)
    finally:
        live.close(drain_s=5)
        for engine in engines.values():
            engine.close()
    for key in "AB":
        prefill_boot = f"127.0.0.1:{engines['p' + key].port + 1}"
        sent = [body["kv_transfer_params"]["pd_transfer"]["prefill"]
                for body in engines["d" + key].bodies()]
        assert sent and set(sent) == {prefill_boot}, (key, sent)
    assert len(engines["pA"].requests) + len(engines["pB"].requests) == 8


def test_a_request_waits_for_a_compatible_pair_then_is_served() -> None:
    """Prefill of key A, decode of key B only: the request waits (counted as waiting for
    decode) until a decode of key A joins, and goes there."""
    prefill, old_decode, new_decode = (StandInEngine(n) for n in ("pA", "dB", "dA"))
    table = EndpointTable()
    table.replace(Role.PREFILL, [endpoint(Role.PREFILL, prefill, "A")])
    table.replace(Role.DECODE, [endpoint(Role.DECODE, old_decode, "B")])
    live = router(table, wait_s=20)
    answers: list[int] = []
    client = threading.Thread(target=lambda: answers.append(
        call(live.url, "POST", COMPLETIONS, {"prompt": "x"})[0]))
    try:
        client.start()
        deadline = time.monotonic() + 10
        while table.waiting()[Role.DECODE] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert table.waiting()[Role.DECODE] == 1 and answers == []
        table.replace(Role.DECODE, [endpoint(Role.DECODE, old_decode, "B"),
                                    endpoint(Role.DECODE, new_decode, "A")])
        client.join(10)
        assert answers == [200]
        assert len(new_decode.requests) == 1 and old_decode.requests == []
        # The prefill half goes out beside decode's and may land after the answer.
        deadline = time.monotonic() + 10
        while not prefill.requests and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(prefill.requests) == 1
    finally:
        live.close(drain_s=5)
        for engine in (prefill, old_decode, new_decode):
            engine.close()


def test_no_compatible_pair_is_refused_503_naming_the_keys_and_nothing_is_sent() -> None:
    prefill, decode = StandInEngine("pA"), StandInEngine("dB")
    table = EndpointTable()
    table.replace(Role.PREFILL, [endpoint(Role.PREFILL, prefill, "A")])
    table.replace(Role.DECODE, [endpoint(Role.DECODE, decode, "B")])
    live = router(table, wait_s=0.3)
    try:
        status, _, body = call(live.url, "POST", COMPLETIONS, {"prompt": "x"})
    finally:
        live.close()
        prefill.close()
        decode.close()
    error = json.loads(body)["error"]
    assert (status, error["type"]) == (503, "no_compatible_pair")
    assert error["message"] == (
        "no ready prefill and decode engine with the same KV-compatibility key after waiting "
        "0.3 s for one: prefill keys ['A'], decode keys ['B'] (a change of the model, page "
        "size, KV dtype or image is rolling out; see GET /health)")
    assert prefill.requests == [] and decode.requests == []


def test_vllm_nixl_sends_the_prefills_answer_to_a_decode_of_its_key() -> None:
    prefill = StandInEngine("pA", lambda _: Answer(chunks=(json.dumps(
        {"choices": [{"text": "x"}], **NIXL_PARAMS}).encode(),)))
    decodes = {key: StandInEngine("d" + key) for key in "AB"}
    table = EndpointTable()
    table.replace(Role.PREFILL, [endpoint(Role.PREFILL, prefill, "A")])
    table.replace(Role.DECODE, [endpoint(Role.DECODE, decodes[k], k) for k in "AB"])
    live = router(table, protocol="vllm-nixl")
    try:
        for i in range(4):
            assert call(live.url, "POST", COMPLETIONS, {"prompt": f"q{i}"})[0] == 200
    finally:
        live.close(drain_s=5)
        prefill.close()
        for engine in decodes.values():
            engine.close()
    assert len(decodes["A"].requests) == 4 and decodes["B"].requests == []
