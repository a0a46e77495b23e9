"""The router↔engine request contract (``pd_transfer.protocol.handoff``): the exact
``kv_transfer_params`` the router builds, each read back by the connector's reader, and a
malformed one refused naming the key. The wire format is written out literally: a change
here is a change of what routers and engines of different versions exchange.

Needs neither torch, NIXL nor vLLM."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pd_transfer.protocol.handoff import (
    PARAMS_KEY,
    LoadParams,
    ParamsError,
    SendParams,
    load_params,
    read_load_params,
    read_send_params,
    send_params,
)

pytestmark = pytest.mark.timeout(10)

ROOM = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"


def test_the_builders_write_exactly_the_documented_params() -> None:
    assert PARAMS_KEY == "pd_transfer"
    assert send_params(ROOM, "10.0.0.2:8998") == {
        "pd_transfer": {"room": "0f1e2d3c4b5a69788796a5b4c3d2e1f0", "decode": "10.0.0.2:8998"}}
    assert load_params(ROOM, "10.0.0.1:8998") == {
        "pd_transfer": {"room": "0f1e2d3c4b5a69788796a5b4c3d2e1f0", "prefill": "10.0.0.1:8998"}}


def test_the_builders_json_is_byte_identical_to_the_hand_written_body() -> None:
    """The router serialises with ``separators=(",", ":")``; key order is part of the bytes."""
    assert json.dumps(send_params("r1", "[fd00::2]:8998"), separators=(",", ":")) == (
        '{"pd_transfer":{"room":"r1","decode":"[fd00::2]:8998"}}')
    assert json.dumps(load_params("r1", "prefill-0.pd:9000"), separators=(",", ":")) == (
        '{"pd_transfer":{"room":"r1","prefill":"prefill-0.pd:9000"}}')


def test_each_built_params_round_trips_through_its_reader() -> None:
    assert read_send_params(send_params(ROOM, "10.0.0.2:8998")) == SendParams(
        room=ROOM, decode="10.0.0.2:8998")
    assert read_load_params(load_params(ROOM, "10.0.0.1:8998")) == LoadParams(
        room=ROOM, prefill="10.0.0.1:8998")


def test_a_request_without_the_key_is_served_locally() -> None:
    for params in (None, {}, {"do_remote_decode": True}):
        assert read_send_params(params) is None
        assert read_load_params(params) is None


def test_each_reader_refuses_the_other_sides_params() -> None:
    with pytest.raises(ParamsError, match=r"of a prefill request is invalid.*'decode'"):
        read_send_params(load_params(ROOM, "10.0.0.1:8998"))
    with pytest.raises(ParamsError, match=r"of a decode request is invalid.*'prefill'"):
        read_load_params(send_params(ROOM, "10.0.0.2:8998"))


@pytest.mark.parametrize(("params", "reason"), [
    ({"pd_transfer": {"room": "r1"}}, "Field required"),
    ({"pd_transfer": {"room": "r 1", "decode": "h:1"}}, "should match pattern"),
    ({"pd_transfer": {"room": "", "decode": "h:1"}}, "should match pattern"),
    ({"pd_transfer": {"room": "r1", "decode": "no-port"}}, "must be host:port"),
    ({"pd_transfer": {"room": "r1", "decode": ":8998"}}, "must be host:port"),
    ({"pd_transfer": {"room": "r1", "decode": "h:70000"}}, "port in 1-65535"),
    ({"pd_transfer": {"room": "r1", "decode": "h" * 261 + ":1"}}, "at most 262 characters"),
    ({"pd_transfer": {"room": "r1", "decode": "h:1", "extra": True}}, "Extra inputs"),
    ({"pd_transfer": "r1"}, "valid dictionary"),
])
def test_malformed_params_are_refused_naming_the_key_and_the_reason(
        params: dict[str, Any], reason: str) -> None:
    with pytest.raises(ParamsError, match=r"kv_transfer_params\['pd_transfer'\] of a prefill "
                                          r"request is invalid") as refused:
        read_send_params(params)
    assert reason in str(refused.value)


@pytest.mark.parametrize(("room", "address", "reason"), [
    ("r 1", "10.0.0.2:8998", "should match pattern"),
    ("r1", "10.0.0.2", "must be host:port"),
    ("r1", "10.0.0.2:0", "port in 1-65535"),
])
def test_the_builders_refuse_what_the_connector_would(room: str, address: str,
                                                      reason: str) -> None:
    with pytest.raises(ParamsError, match=r"of a prefill request is invalid") as refused:
        send_params(room, address)
    assert reason in str(refused.value)
    with pytest.raises(ParamsError, match=r"of a decode request is invalid") as refused:
        load_params(room, address)
    assert reason in str(refused.value)
