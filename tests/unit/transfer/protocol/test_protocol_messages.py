"""Wire messages: every malformed or hostile payload is refused with its reason
(docs/failure-modes.md #15, #27).

Needs neither NIXL nor a GPU.
"""

from __future__ import annotations

import json
from typing import get_args

import pytest
from pydantic import TypeAdapter

from pd_transfer.errors import RemoteProtocolError
from pd_transfer.protocol.messages import (
    MAX_DEPTH,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    RECEIVED_BY,
    Abort,
    AllocRequest,
    Finish,
    Grant,
    GrantRefused,
    Message,
    PartDone,
    Release,
    RequestKV,
    RingUpdate,
    StagedPart,
    Watermark,
    Withdraw,
    Withdrawn,
    compute_runs,
    decode_message,
    encode_message,
    expand_runs,
)

pytestmark = pytest.mark.timeout(10)

EVERY_TYPE: list[Message] = [
    RequestKV(room="r", ticket=7, decode_pp_rank=0, decode_tp_rank=3,
              dst_page_runs=((4, 2), (9, 1)),
              num_tokens=37, path="staged", ring_version=1),
    RequestKV(room="r", ticket=7, decode_pp_rank=0, decode_tp_rank=3,
              dst_page_runs=((4, 2), (9, 1)),
              num_tokens=37, path="staged", ring_version=2, pregrant_offset=512,
              pregrant_bytes=8192),
    AllocRequest(room="r", ticket=7, part=0, sender_id=1, size_bytes=4096),
    Grant(room="r", ticket=7, part=0, sender_id=1, ring_offset=256, size_bytes=4096,
          ring_version=1),
    GrantRefused(room="r", ticket=7, part=0, sender_id=1, needed_bytes=1 << 30,
                 capacity_bytes=1 << 20),
    StagedPart(room="r", ticket=7, part=2, sender_id=1, ring_offset=0, size_bytes=64, layer_start=0,
               layer_stop=4, page_start=3, page_count=2, ring_version=1, final_parts=3),
    PartDone(room="r", ticket=7, part=0, sender_id=0, layer_start=0, layer_stop=2, page_start=0,
             page_count=4),
    Finish(room="r", ticket=7, sender_id=0, final_parts=2),
    Release(room="r", ticket=7),
    Abort(room="r", ticket=7, reason="Aborted", detail="engine"),
    Watermark(used_bytes=1, capacity_bytes=2, largest_free_bytes=1, pending_allocations=0),
    RingUpdate(ring_version=2, name="d/ring-v2", base_address=4096, size_bytes=1 << 20,
               kind="VRAM", device_id=0, transport_metadata_b64="bWV0YQ=="),
    Withdraw(room="r", ticket=7, sender_id=1),
    Withdrawn(room="r", ticket=7, sender_id=1),
]


@pytest.mark.parametrize("message", EVERY_TYPE, ids=lambda m: m.type + (
    ", pre-granted" if getattr(m, "pregrant_bytes", None) else ""))
def test_every_message_round_trips_as_compact_versioned_json(message: Message) -> None:
    wire = encode_message(message)
    envelope = json.loads(wire)
    assert envelope["v"] == PROTOCOL_VERSION == 6 and envelope["type"] == message.type
    assert b" " not in wire.replace(b'"engine"', b"")  # compact
    assert decode_message(wire) == message


def _raw(**fields: object) -> bytes:
    return json.dumps({"v": PROTOCOL_VERSION, **fields}).encode()


GRANT = {"type": "grant", "room": "r", "ticket": 3, "part": 0, "sender_id": 0,
         "ring_offset": 0, "size_bytes": 64, "ring_version": 1}

REJECTED: list[tuple[str, bytes, str]] = [
    ("oversized payload", b'{"v":2,"pad":"' + b"x" * MAX_MESSAGE_BYTES + b'"}', "too_large"),
    ("binary garbage", b"\xff\xfe\x00", "not_json"),
    ("truncated json", encode_message(EVERY_TYPE[0])[:-3], "not_json"),
    ("json array", b"[1, 2]", "not_object"),
    ("no version", json.dumps({"type": "release", "room": "r"}).encode(), "unsupported_version"),
    ("older version (1: before hot resize)", json.dumps({"v": 1, "type": "release",
                                                          "room": "r"}).encode(),
     "unsupported_version"),
    ("future version",
     json.dumps({"v": PROTOCOL_VERSION + 1, "type": "release", "room": "r"}).encode(),
     "unsupported_version"),
    ("boolean version", json.dumps({"v": True, "type": "release", "room": "r"}).encode(),
     "unsupported_version"),
    ("unknown type", _raw(type="reset_everything", room="r"), "invalid_body"),
    ("missing type", _raw(room="r"), "invalid_body"),
    ("unknown field (positional drift)", _raw(**GRANT, extra=1), "invalid_body"),
    ("negative ring offset", _raw(**{**GRANT, "ring_offset": -256}), "invalid_body"),
    ("a message about a room without its ticket",
     _raw(**{k: v for k, v in GRANT.items() if k != "ticket"}), "invalid_body"),
    ("ticket 0 (tickets count from 1)", _raw(**{**GRANT, "ticket": 0}), "invalid_body"),
    ("a watermark naming a room without its ticket",
     _raw(type="watermark", used_bytes=0, capacity_bytes=1, largest_free_bytes=0,
          pending_allocations=0, room="r"), "invalid_body"),
    ("a ring version of 4001 digits",
     _raw(type="ring_update", ring_version=int("9" * 4001), name="d/ring",
          base_address=4096, size_bytes=4096, kind="DRAM", device_id=0,
          transport_metadata_b64="bWV0YQ=="), "invalid_body"),
    ("a ring version past 2^31 - 1",
     _raw(type="ring_update", ring_version=1 << 31, name="d/ring", base_address=4096,
          size_bytes=4096, kind="DRAM", device_id=0, transport_metadata_b64="bWV0YQ=="),
     "invalid_body"),
    ("zero size", _raw(**{**GRANT, "size_bytes": 0}), "invalid_body"),
    ("size as a string", _raw(**{**GRANT, "size_bytes": "64"}), "invalid_body"),
    ("size as a float", _raw(**{**GRANT, "size_bytes": 64.0}), "invalid_body"),
    ("part past the limit", _raw(**{**GRANT, "part": 1 << 16}), "invalid_body"),
    ("empty room", _raw(**{**GRANT, "room": ""}), "invalid_body"),
    ("page run of zero pages", _raw(type="request_kv", room="r", decode_pp_rank=0,
                                    decode_tp_rank=0, dst_page_runs=[[0, 0]], num_tokens=1,
                                    path="staged", ring_version=1), "invalid_body"),
    ("unknown path", _raw(type="request_kv", room="r", decode_pp_rank=0, decode_tp_rank=0,
                          dst_page_runs=[[0, 1]], num_tokens=1, path="carrier-pigeon",
                          ring_version=1), "invalid_body"),
    ("pre-grant offset without its size", _raw(
        type="request_kv", room="r", decode_pp_rank=0, decode_tp_rank=0, dst_page_runs=[[0, 1]],
        num_tokens=1, path="staged", ring_version=1, pregrant_offset=0), "invalid_body"),
    ("pre-grant on the contiguous path", _raw(
        type="request_kv", room="r", decode_pp_rank=0, decode_tp_rank=0, dst_page_runs=[[0, 1]],
        num_tokens=1, path="contiguous", ring_version=1, pregrant_offset=0, pregrant_bytes=64),
     "invalid_body"),
    ("pre-grant of zero bytes", _raw(
        type="request_kv", room="r", decode_pp_rank=0, decode_tp_rank=0, dst_page_runs=[[0, 1]],
        num_tokens=1, path="staged", ring_version=1, pregrant_offset=0, pregrant_bytes=0),
     "invalid_body"),
    ("older version (4: before pre-grants)", json.dumps({"v": 4, "type": "release",
                                                          "room": "r"}).encode(),
     "unsupported_version"),
    ("final_parts zero", _raw(type="part_done", room="r", part=0, sender_id=0, layer_start=0,
                              layer_stop=1, page_start=0, page_count=1, final_parts=0),
     "invalid_body"),
    # A recursive JSON parser hits the interpreter's recursion limit on these; the decoder
    # must refuse them before parsing (the payload is far below the size limit).
    ("2000 nested arrays", b"[" * 2000, "too_deep"),
    ("nested objects in a field", b'{"v":2,"type":"release","room":"r","x":' + b'{"a":' * 500
     + b"1" + b"}" * 500 + b"}", "too_deep"),
    # The boundary the bracket count guards (fewer opening brackets than MAX_DEPTH + 1
    # cannot nest deeper, so such payloads skip the scan): depth 5 is refused before parsing,
    # depth 4 is parsed and refused by the schema (no field "x").
    ("depth MAX_DEPTH + 1, no other bracket", b'{"v":6,"type":"release","room":"r","ticket":1,"x":'
     + b"[" * MAX_DEPTH + b"1" + b"]" * MAX_DEPTH + b"}", "too_deep"),
    ("depth MAX_DEPTH", b'{"v":6,"type":"release","room":"r","ticket":1,"x":'
     + b"[" * (MAX_DEPTH - 1) + b"1" + b"]" * (MAX_DEPTH - 1) + b"}", "invalid_body"),
    ("version as a float", json.dumps({"v": 2.0, "type": "release", "room": "r"}).encode(),
     "unsupported_version"),
    ("duplicate type key (last would win)",
     b'{"v":2,"type":"grant","type":"release","room":"r"}', "duplicate_key"),
    # Of the current version and valid but for the repeat: the schema alone would take the
    # last value (test_the_schema_alone_takes_a_repeated_key_s_last_value).
    ("duplicate room key of a valid grant", b'{"v":6,"type":"grant","room":"r","room":"s",'
     b'"ticket":1,"part":0,"sender_id":0,"ring_offset":0,"size_bytes":64,"ring_version":1}',
     "duplicate_key"),
    ("a valid grant's key twice, same value", encode_message(EVERY_TYPE[3])[:-1]
     + b',"size_bytes":4096}', "duplicate_key"),
    ("NUL in the room id", _raw(type="release", room="r\u0000x"), "invalid_body"),
    ("newline in the room id", _raw(type="release", room="r\nx"), "invalid_body"),
    ("layer_stop of 2**64", _raw(type="staged_part", room="r", part=0, sender_id=0,
                                 ring_offset=0, size_bytes=64, layer_start=0,
                                 layer_stop=1 << 64, page_start=0, page_count=1,
                                 ring_version=1), "invalid_body"),
    ("ring base address of 2**64", _raw(type="ring_update", ring_version=2, name="d",
                                        base_address=1 << 64, size_bytes=64, kind="DRAM",
                                        device_id=0, transport_metadata_b64="bQ=="),
     "invalid_body"),
    ("size of 2**63", _raw(**{**GRANT, "size_bytes": 1 << 63}), "invalid_body"),
]


@pytest.mark.parametrize(("payload", "reason"), [(p, r) for _, p, r in REJECTED],
                         ids=[name for name, _, _ in REJECTED])
def test_malformed_or_hostile_payload_is_rejected_with_its_reason(
    payload: bytes, reason: str
) -> None:
    with pytest.raises(RemoteProtocolError) as caught:
        decode_message(payload)
    assert caught.value.reason == reason


def test_the_schema_alone_takes_a_repeated_key_s_last_value() -> None:
    """Why decode_message checks repeats itself: pydantic keeps the last of a repeated key,
    so a peer could show a logger one room and the state machine another."""
    payload = next(p for name, p, _ in REJECTED if name == "duplicate room key of a valid grant")
    parsed = TypeAdapter(Message).validate_json(payload)
    assert isinstance(parsed, Grant) and parsed.room == "s"


@pytest.mark.parametrize("message", EVERY_TYPE, ids=lambda m: m.type + (
    ", pre-granted" if getattr(m, "pregrant_bytes", None) else ""))
def test_a_valid_payload_in_another_form_decodes_the_same(message: Message) -> None:
    """Whitespace and another key order (a peer with another JSON writer) are valid JSON of
    the same message: they decode to it, though not in the form encode_message writes."""
    envelope = json.loads(encode_message(message))
    reordered = json.dumps(dict(reversed(envelope.items())), indent=1).encode()
    assert reordered != encode_message(message)
    assert decode_message(reordered) == message


def test_a_request_of_scattered_pages_decodes_to_itself() -> None:
    """64 single-page runs (a fragmented block table): far more brackets than MAX_DEPTH, at
    the depth of every RequestKV."""
    runs = compute_runs(list(range(0, 256, 4)))
    assert len(runs) == 64
    message = RequestKV(room="r", ticket=1, decode_pp_rank=0, decode_tp_rank=1,
                        dst_page_runs=runs,
                        num_tokens=1024, path="staged", ring_version=1)
    assert decode_message(encode_message(message)) == message


def test_largest_wire_integer_is_accepted() -> None:
    """2**63 - 1 is the largest offset a 64-bit signed address can take; it still decodes."""
    wire = _raw(**{**GRANT, "ring_offset": (1 << 63) - 1})
    grant = decode_message(wire)
    assert isinstance(grant, Grant) and grant.ring_offset == (1 << 63) - 1


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    """Depth is counted outside strings only: a room id full of brackets is a legal id."""
    room = "[[[[[{{{{{" + '\\"[[[['
    assert decode_message(encode_message(Release(room=room, ticket=1))) == Release(room=room,
                                                                                 ticket=1)


def test_page_runs_round_trip_and_expansion_is_bounded() -> None:
    """Runs by hand: [3,4,5,9,2] → (3,3),(9,1),(2,1); a peer cannot make us expand more
    pages than the pool holds."""
    runs = compute_runs([3, 4, 5, 9, 2])
    assert runs == ((3, 3), (9, 1), (2, 1))
    assert expand_runs(runs, limit=10) == [3, 4, 5, 9, 2]
    with pytest.raises(RemoteProtocolError) as caught:
        expand_runs(((0, 1 << 40),), limit=1024)
    assert caught.value.reason == "too_many_pages"


def test_messages_are_frozen() -> None:
    grant = EVERY_TYPE[2]
    with pytest.raises(ValueError, match="frozen"):
        grant.room = "other"  # type: ignore[misc]


def test_every_message_has_its_receiving_side_and_no_other() -> None:
    """The one direction table both endpoints check before their handlers (PROTOCOL.md,
    "Who sends what"): written out here by hand, so a new message type fails this test until
    someone decides which side receives it."""
    union_tags = {str(kind.model_fields["type"].default)
                  for kind in get_args(get_args(Message)[0])}
    assert {
        "request_kv": {"prefill"}, "grant": {"prefill"}, "grant_refused": {"prefill"},
        "watermark": {"prefill"}, "release": {"prefill"}, "ring_update": {"prefill"},
        "withdraw": {"prefill"},
        "alloc_request": {"decode"}, "staged_part": {"decode"}, "part_done": {"decode"},
        "finish": {"decode"}, "withdrawn": {"decode"},
        "abort": {"prefill", "decode"},
    } == RECEIVED_BY
    assert set(RECEIVED_BY) == union_tags
