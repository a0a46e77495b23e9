"""Complete or fail: a request succeeds only when every cell its plan promised landed once.

Reproduced over the loopback transport, from the bugs a hostile peer found (success counted
by parts, integers without an upper bound, decoder exceptions that escaped the worker's
step): a writer (the real prefill agent's transport, so the messages pass the sender
checks) sends forged notifications and the endpoints must refuse to complete; an engine
that sends too little fails on prefill; hostile messages in a step never skip the rest of
the batch or the deadlines.
"""

from __future__ import annotations

import json

import pytest

from pd_testbed.transfer_harness import Cluster, Request
from pd_transfer.decode import DecodeReceiver
from pd_transfer.protocol.coverage import Coverage, CoverageError
from pd_transfer.protocol.lifecycle import FailureReason, State
from pd_transfer.protocol.messages import (
    PROTOCOL_VERSION,
    AllocRequest,
    Message,
    PartDone,
    StagedPart,
    encode_message,
)
from pd_transfer.trust.auth import Purpose

pytestmark = pytest.mark.timeout(60)

DECODE = "decode-0-0"
CHUNK_2x2 = 2 * 2 * 2 * 4 * 2 * 4 * 2  # K,V x 2 layers x 2 pages x 4 slots x 2 heads x 4 x bf16
TICKET = 1  # the ticket of the first request a fresh decode rank expects


def _transferring(mode: str) -> tuple[Cluster, Request, DecodeReceiver]:
    """A 4-page request (16 tokens, 2 layers) both sides hold, Transferring, no part sent."""
    cluster = Cluster(mode=mode)  # type: ignore[arg-type]
    request = cluster.new_request(num_tokens=16)
    cluster.start(request, send=False)
    cluster.run(lambda: cluster.states(request.room) == {State.TRANSFERRING})
    return cluster, request, cluster.receivers[0]


def _send_raw(cluster: Cluster, body: bytes) -> None:
    """``body`` from the prefill agent, authenticated: hostile bytes from a member peer."""
    sender = cluster.senders[0]
    sender.transport.send_message(DECODE, sender.auth.seal(
        body, purpose=Purpose.MESSAGE, version=PROTOCOL_VERSION,
        sender=sender.transport.agent_name, receiver=DECODE))


def _forge(cluster: Cluster, *messages: Message) -> None:
    for message in messages:
        _send_raw(cluster, encode_message(message))
    cluster.step()


def _done(room: str, part: int, pages: range, final: int | None = None,
          layers: range = range(2)) -> PartDone:
    return PartDone(room=room, ticket=TICKET, part=part, sender_id=0, layer_start=layers.start,
                    layer_stop=layers.stop, page_start=pages.start,
                    page_count=len(pages), final_parts=final)


def _decode_failure(receiver: DecodeReceiver, room: str) -> tuple[State, FailureReason | None,
                                                                  str]:
    status = receiver.poll(room)
    assert status is not None
    return status.state, status.reason, status.detail


def test_contiguous_part_index_beyond_the_final_count_fails_the_request() -> None:
    """docs/failure-modes.md #28: part 1 then PartDone(part=7,
    final_parts=2) was Succeeded (2 parts counted) though part 0 never landed."""
    cluster, request, receiver = _transferring("contiguous")
    _forge(cluster, _done(request.room, 1, range(0, 2)), _done(request.room, 7, range(2, 4), 2))
    state, reason, detail = _decode_failure(receiver, request.room)
    assert (state, reason) == (State.FAILED, FailureReason.PROTOCOL_VIOLATION)
    assert detail.endswith("part 7 landed but the writer's final part count is 2 (parts 0..1)")
    assert receiver.metrics.snapshot().rejected_by_reason == {"protocol_violation": 1}


def test_staged_part_index_beyond_the_final_count_fails_the_request() -> None:
    """docs/failure-modes.md #28: staged parts 0 and 5 with final_parts=2
    were Succeeded though part 1 never existed."""
    cluster, request, receiver = _transferring("staged")
    room = request.room
    _forge(cluster,
           AllocRequest(room=room, ticket=TICKET, part=0, sender_id=0, size_bytes=CHUNK_2x2),
           AllocRequest(room=room, ticket=TICKET, part=5, sender_id=0, size_bytes=CHUNK_2x2))
    parts = receiver._transfers[room].writers[0].parts
    offsets = {index: part.region.offset_bytes for index, part in parts.items()
               if part.region is not None}
    assert sorted(offsets) == [0, 5]

    def staged(part: int, pages: range, final: int | None) -> StagedPart:
        return StagedPart(room=room, ticket=TICKET, part=part, sender_id=0,
                          ring_offset=offsets[part],
                          size_bytes=CHUNK_2x2, layer_start=0, layer_stop=2,
                          page_start=pages.start, page_count=len(pages), ring_version=1,
                          final_parts=final)

    _forge(cluster, staged(0, range(0, 2), None), staged(5, range(2, 4), 2))
    state, reason, detail = _decode_failure(receiver, room)
    assert (state, reason) == (State.FAILED, FailureReason.PROTOCOL_VIOLATION)
    assert detail.endswith("final part count 2 conflicts with None / parts already named [5]")


def test_decode_refuses_to_complete_when_the_landed_parts_leave_cells_unwritten() -> None:
    """docs/failure-modes.md #28: one part of 2 of 4 pages with
    final_parts=1 counted as the whole request."""
    cluster, request, receiver = _transferring("contiguous")
    _forge(cluster, _done(request.room, 0, range(0, 2), 1))
    state, reason, detail = _decode_failure(receiver, request.room)
    assert (state, reason) == (State.FAILED, FailureReason.PROTOCOL_VIOLATION)
    assert detail.endswith(
        "all 1 parts landed but pages [2, 4) of layers [0, 2) were never written")


@pytest.mark.parametrize(
    ("second", "problem"),
    [
        (_done("r", 1, range(1, 3)),
         "part 1: layers [0, 2) × pages [1, 3) overlaps cells already covered (in layers "
         "[0, 2))"),
        (_done("r", 1, range(2, 4), layers=range(1, 3)),
         "part 1: layers [1, 3) × pages [2, 4) is outside the promised layers [0, 2) × pages "
         "[0, 4)"),
        (_done("r", 1, range(3, 5)),
         "part 1: layers [0, 2) × pages [3, 5) is outside the promised layers [0, 2) × pages "
         "[0, 4)"),
    ],
    ids=["overlapping", "layers outside the plan", "pages outside the request"],
)
def test_overlapping_or_outside_coverage_is_a_counted_violation(
    second: PartDone, problem: str
) -> None:
    """docs/failure-modes.md #28: a part whose cells overlap another's or lie outside the
    request would write stale or foreign KV yet count towards completion."""
    cluster, request, receiver = _transferring("contiguous")
    _forge(cluster, _done(request.room, 0, range(0, 2)),
           second.model_copy(update={"room": request.room}))
    state, reason, detail = _decode_failure(receiver, request.room)
    assert (state, reason) == (State.FAILED, FailureReason.PROTOCOL_VIOLATION)
    assert detail.endswith(problem)
    assert receiver.metrics.snapshot().rejected_by_reason == {"protocol_violation": 1}


def test_staged_layer_stop_beyond_64_bits_is_a_counted_rejection() -> None:
    """docs/failure-modes.md #27: layer_stop=2**64 raised OverflowError
    inside len(range) and failed the request InternalError; the request is untouched now."""
    cluster, request, receiver = _transferring("staged")
    fields = json.loads(encode_message(StagedPart(
        room=request.room, ticket=TICKET, part=0, sender_id=0, ring_offset=0, size_bytes=CHUNK_2x2,
        layer_start=0, layer_stop=2, page_start=0, page_count=2, ring_version=1)))
    fields["layer_stop"] = 2**64
    _send_raw(cluster, json.dumps(fields).encode())
    cluster.step()
    assert receiver.metrics.snapshot().rejected_by_reason == {"invalid_body": 1}
    assert receiver.poll(request.room).state is State.TRANSFERRING  # type: ignore[union-attr]


def test_staged_layer_stop_at_the_wire_bound_is_a_protocol_violation() -> None:
    """docs/failure-modes.md #28: the largest legal integer must be refused
    as coverage outside the plan, never computed with (InternalError before)."""
    cluster, request, receiver = _transferring("staged")
    room = request.room
    _forge(cluster,
           AllocRequest(room=room, ticket=TICKET, part=0, sender_id=0, size_bytes=CHUNK_2x2))
    region = receiver._transfers[room].writers[0].parts[0].region
    assert region is not None
    _forge(cluster, StagedPart(room=room, ticket=TICKET, part=0, sender_id=0,
                               ring_offset=region.offset_bytes,
                               size_bytes=CHUNK_2x2, layer_start=0, layer_stop=2**63 - 1,
                               page_start=0, page_count=2, ring_version=1))
    state, reason, detail = _decode_failure(receiver, room)
    assert (state, reason) == (State.FAILED, FailureReason.PROTOCOL_VIOLATION)
    assert detail.endswith(f"part 0: layers [0, {2**63 - 1}) × pages [0, 2) is outside the "
                           "promised layers [0, 2) × pages [0, 4)")


@pytest.mark.parametrize(
    ("mode", "pages", "layers", "missing"),
    [
        ("contiguous", range(0, 1), None, "pages [1, 4) of layers [0, 2)"),
        ("staged", None, range(0, 1), "pages [0, 4) of layers [1, 2)"),
    ],
    ids=["one page of four", "one layer of two"],
)
def test_prefill_fails_a_request_whose_parts_do_not_cover_it(
    mode: str, pages: range | None, layers: range | None, missing: str
) -> None:
    """docs/failure-modes.md #28: send_part(pages=range(0, 1), last=True)
    on a 4-page request (or a one-layer staged send) ended Succeeded on both sides with
    stale KV on decode. The engine broke the send_part contract (a local bug, no peer's
    fault): prefill fails InternalError naming the unsent cells; decode hears Abort."""
    cluster, request, receiver = _transferring(mode)
    sender = cluster.senders[0]
    future = sender.send_part(request.room, pages=pages, layers=layers, last=True)
    cluster.run(lambda: cluster.finished(request.room))
    expected = (f"the parts sent up to last=True leave {missing} unsent; send every page "
                f"of every layer of this stage [0, 2) before last=True")
    with pytest.raises(ValueError, match="before last=True") as raised:
        future.result(timeout=0)
    assert str(raised.value) == f"room {request.room!r}: {expected}"
    status = sender.poll(request.room)
    assert status is not None
    assert (status.state, status.reason, status.detail) == (
        State.FAILED, FailureReason.INTERNAL_ERROR, expected)
    assert _decode_failure(receiver, request.room)[:2] == (State.FAILED,
                                                           FailureReason.ABORTED_BY_PEER)


def test_an_overlapping_send_part_is_refused_and_the_request_still_completes() -> None:
    """docs/failure-modes.md #28: a page sent twice would land twice; the call is refused,
    the request goes on and completes bit-exactly with the remaining pages."""
    cluster, request, _ = _transferring("staged")
    sender = cluster.senders[0]
    first = sender.send_part(request.room, pages=range(0, 2))
    twice = sender.send_part(request.room, pages=range(1, 3))
    rest = sender.send_part(request.room, pages=range(2, 4), last=True)
    cluster.run(lambda: cluster.finished(request.room))
    assert first.result(timeout=0) is None and rest.result(timeout=0) is None
    with pytest.raises(ValueError) as raised:
        twice.result(timeout=0)
    assert str(raised.value) == (
        f"room {request.room!r}: layers [0, 2) × pages [1, 3) overlaps cells already covered "
        f"(in layers [0, 2)); each page of each layer is sent once")
    assert cluster.states(request.room) == {State.SUCCEEDED} and cluster.verified(request)


def test_nested_json_in_a_batch_does_not_lose_the_notification_beside_it() -> None:
    """docs/failure-modes.md #27: b"[" * 2000 raised RecursionError out of
    step, skipping a legitimate notification in the same batch."""
    cluster, request, receiver = _transferring("contiguous")
    _send_raw(cluster, b"[" * 2000)
    _forge(cluster, _done(request.room, 0, range(0, 4), 1))
    assert receiver.poll(request.room).state is State.SUCCEEDED  # type: ignore[union-attr]
    assert receiver.metrics.snapshot().rejected_by_reason == {"too_deep": 1}


def test_a_hostile_message_every_step_still_lets_the_request_fail_at_its_deadline() -> None:
    """docs/failure-modes.md #27: with one message per step raising out of
    its handler, _check_deadlines never ran (13 s past a 5 s deadline). Each such message is
    counted; the request fails TransferTimeout on the round its deadline passes."""
    cluster, request, receiver = _transferring("contiguous")
    deadline = receiver._transfers[request.room].transfer_deadline

    def broken(peer: str, message: Message) -> None:
        raise RecursionError("maximum recursion depth exceeded")

    receiver._on_unknown_room = broken  # type: ignore[method-assign]
    hostile = _done("no-such-room", 0, range(0, 1))
    rounds = 0
    while receiver.poll(request.room).state is State.TRANSFERRING:  # type: ignore[union-attr]
        _send_raw(cluster, encode_message(hostile))
        receiver.step()
        rounds += 1
        assert rounds < 1000
        if receiver.poll(request.room).state is State.TRANSFERRING:  # type: ignore[union-attr]
            cluster.clock.advance(cluster.tick_s)
    state, reason, _ = _decode_failure(receiver, request.room)
    assert (state, reason) == (State.FAILED, FailureReason.TRANSFER_TIMEOUT)
    assert deadline <= cluster.clock() < deadline + cluster.tick_s
    assert receiver.metrics.snapshot().rejected_by_reason == {"handler_error": rounds}


def test_coverage_claims_once_and_names_what_is_missing() -> None:
    """docs/failure-modes.md #28: the coverage model itself: a refused claim marks nothing,
    and the missing cells are grouped by layers with equal gaps."""
    coverage = Coverage(range(4, 7), 5)
    coverage.claim(range(4, 7), range(0, 2))
    with pytest.raises(CoverageError):
        coverage.claim(range(6, 8), range(2, 3))  # layer 7 outside: nothing of it marked
    coverage.claim(range(6, 7), range(2, 5))
    assert coverage.missing() == "pages [2, 5) of layers [4, 6)"
    assert not coverage.complete
    coverage.claim(range(4, 6), range(2, 5))
    assert coverage.complete and coverage.missing() == ""
