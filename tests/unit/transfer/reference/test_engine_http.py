"""The reference engine's HTTP layer against a recording backend (no NIXL, no torch work):
validation, size limits, routes, status codes."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from pd_transfer.reference.engine.errors import EngineBusy, RequestRejected
from pd_transfer.reference.engine.faults import FaultKind
from pd_transfer.reference.engine.http_api import MAX_BODY_BYTES, EngineHTTPServer


class RecordingBackend:
    """Answers like the engine; records what reached it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.faults: dict[str, float] = {}

    def healthy(self) -> bool:
        return True

    def prefill(self, room: str, tokens: Sequence[int] | None, num_tokens: int,
                decode: Sequence[str], timeout_s: float | None) -> dict[str, Any]:
        self.calls.append(("prefill", (room, tokens, num_tokens, list(decode))))
        if room == "busy":
            raise EngineBusy("no pages")
        return {"room": room, "state": "Succeeded"}

    def decode(self, room: str, num_tokens: int, prefill: Sequence[str],
               timeout_s: float | None) -> dict[str, Any]:
        self.calls.append(("decode", (room, num_tokens, list(prefill))))
        if room == "taken":
            raise RequestRejected("room 'taken' is already in use on this pod", status=409)
        return {"room": room, "state": "Succeeded"}

    def lookup(self, room: str) -> dict[str, Any] | None:
        return {"room": room, "state": "Succeeded"} if room == "known" else None

    def set_faults(self, faults: dict[FaultKind, float], clear: bool) -> dict[str, float]:
        if clear:
            self.faults.clear()
        self.faults.update(faults)
        return dict(self.faults)


@pytest.fixture
def engine() -> Iterator[tuple[RecordingBackend, str]]:
    backend = RecordingBackend()
    server = EngineHTTPServer(backend, "127.0.0.1", 0)
    try:
        yield backend, server.address
    finally:
        server.close()


def call(address: str, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def post(address: str, path: str, payload: Any) -> tuple[int, Any]:
    return call(address, "POST", path, json.dumps(payload).encode(),
                {"Content-Type": "application/json"})


def test_valid_requests_reach_the_backend(engine: tuple[RecordingBackend, str]) -> None:
    backend, address = engine
    assert call(address, "GET", "/health") == (200, {"status": "ok"})
    assert post(address, "/v1/prefill", {"room": "r1", "num_tokens": 64,
                                         "decode": ["127.0.0.1:8998"]})[0] == 200
    assert post(address, "/v1/decode", {"room": "r1", "num_tokens": 64,
                                        "prefill": ["127.0.0.1:8998"]})[0] == 200
    assert backend.calls == [("prefill", ("r1", None, 64, ["127.0.0.1:8998"])),
                             ("decode", ("r1", 64, ["127.0.0.1:8998"]))]


def test_bad_json_is_400_and_reaches_nothing(engine: tuple[RecordingBackend, str]) -> None:
    backend, address = engine
    status, body = call(address, "POST", "/v1/decode", b"{not json")
    assert status == 400 and "not JSON" in body["error"]
    assert backend.calls == []


@pytest.mark.parametrize("payload, fragment", [
    ({"room": "r", "decode": ["a:1"]}, "exactly one of tokens and num_tokens"),
    ({"room": "r", "tokens": [1], "num_tokens": 1, "decode": ["a:1"]}, "exactly one"),
    ({"room": "r", "num_tokens": 0, "decode": ["a:1"]}, "num_tokens"),
    ({"room": "r", "num_tokens": 8, "decode": []}, "decode"),
    ({"room": "r", "num_tokens": 8, "decode": ["a:1"], "extra": 1}, "extra"),
])
def test_invalid_prefill_bodies_are_400_naming_the_field(
        engine: tuple[RecordingBackend, str], payload: dict[str, Any], fragment: str) -> None:
    backend, address = engine
    status, body = post(address, "/v1/prefill", payload)
    assert status == 400 and fragment in body["error"], body
    assert backend.calls == []


def test_oversized_body_is_413_without_reading_it(engine: tuple[RecordingBackend, str]) -> None:
    backend, address = engine
    big = b"[" + b"1," * (MAX_BODY_BYTES // 2) + b"1]"
    status, body = call(address, "POST", "/v1/prefill", big)
    assert status == 413 and str(MAX_BODY_BYTES) in body["error"]
    assert backend.calls == []


def test_unknown_room_route_and_method(engine: tuple[RecordingBackend, str]) -> None:
    _, address = engine
    assert call(address, "GET", "/v1/requests/unknown")[0] == 404
    assert call(address, "GET", "/v1/requests/known") == (200, {"room": "known",
                                                               "state": "Succeeded"})
    assert call(address, "GET", "/v1/nothing")[0] == 404
    assert call(address, "GET", "/v1/decode")[0] == 405


def test_busy_and_conflict_map_to_503_and_409(engine: tuple[RecordingBackend, str]) -> None:
    _, address = engine
    assert post(address, "/v1/prefill", {"room": "busy", "num_tokens": 8,
                                         "decode": ["a:1"]})[0] == 503
    assert post(address, "/v1/decode", {"room": "taken", "num_tokens": 8,
                                        "prefill": ["a:1"]})[0] == 409


def test_faults_validate_kind_and_probability(engine: tuple[RecordingBackend, str]) -> None:
    _, address = engine
    assert post(address, "/v1/faults", {"set": {"drop_grants": 0.5}}) == (
        200, {"faults": {"drop_grants": 0.5}})
    assert post(address, "/v1/faults", {"set": {"explode": 1.0}})[0] == 400
    assert post(address, "/v1/faults", {"set": {"fail_writes": 2.0}})[0] == 400
    assert post(address, "/v1/faults", {"clear": True}) == (200, {"faults": {}})
