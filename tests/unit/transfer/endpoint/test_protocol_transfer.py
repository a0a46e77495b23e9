"""The transfer protocol end to end over the loopback transport, with injected faults.

Deterministic (one manual clock, endpoints stepped by hand, no threads) and bounded: every
run has a round limit, so a hang fails the test instead of stalling it. Needs neither NIXL
nor a GPU. Each test names the failure mode in docs/failure-modes.md it guards.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import pytest
import torch
from prometheus_client import generate_latest

from pd_testbed.transfer_harness import FAST, Cluster, Request, message_type, of_type, seal_as
from pd_transfer.common.metrics import PendingKV
from pd_transfer.decode import DecodeReceiver
from pd_transfer.endpoint import Endpoint
from pd_transfer.protocol.lifecycle import FailureReason, State
from pd_transfer.protocol.messages import (
    AllocRequest,
    Grant,
    Message,
    Release,
    RequestKV,
    StagedPart,
    compute_runs,
)
from pd_transfer.protocol.parts import PartState
from pd_transfer.transport import Envelope, FaultAction, FaultRule

pytestmark = pytest.mark.timeout(60)

SUCCEEDED = {State.SUCCEEDED}


@pytest.mark.parametrize(
    ("topology", "mode"),
    [
        ({}, "staged"), ({}, "sliced"), ({}, "contiguous"),
        ({"prefill_tp": 2, "decode_tp": 4, "kv_heads": 4}, "staged"),
        ({"prefill_tp": 4, "decode_tp": 2, "kv_heads": 4}, "sliced"),
        ({"prefill_tp": 4, "decode_tp": 8, "kv_heads": 2}, "auto"),
        ({"prefill_tp": 2, "prefill_pp": 2, "decode_tp": 4, "kv_heads": 4, "layers": 4},
         "staged"),
    ],
)
def test_decode_pages_equal_the_prefill_source_bit_exactly(
    topology: dict[str, int], mode: str
) -> None:
    """docs/failure-modes.md #13, #14: right heads, right layers, every topology and path."""
    cluster = Cluster(mode=mode, **topology)  # type: ignore[arg-type]
    request = cluster.new_request(num_tokens=13)  # not a multiple of the page size (4)
    cluster.start(request)
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.states(request.room) == SUCCEEDED
    assert cluster.verified(request)


def test_staging_sends_one_alloc_request_per_part_and_writer() -> None:
    """docs/failure-modes.md #1: a flag read the wrong way once skipped every staging request.
    2 → 4 with 4 heads: 4 (prefill rank, decode rank) pairs; 3 parts each → 12, of which each
    pair's part 0 writes into the pre-grant its RequestKV carried (4) and the others ask (8)."""
    cluster = Cluster(prefill_tp=2, decode_tp=4, kv_heads=4, mode="staged")
    request = cluster.new_request(num_tokens=24)  # 6 pages
    cluster.start(request, send=False)
    for sender in cluster.senders:
        sender.send_part(request.room, pages=range(0, 2))
        sender.send_part(request.room, pages=range(2, 4))
        sender.send_part(request.room, pages=range(4, 6), last=True)
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.states(request.room) == SUCCEEDED and cluster.verified(request)
    assert sum(s.pregrants_taken for s in cluster.senders) == 4
    assert sum(s.alloc_requests_sent for s in cluster.senders) == 3 * 4 - 4
    assert sum(s.metrics.writes_posted.labels("staged")._value.get()
               for s in cluster.senders) == 3 * 4


def test_out_of_order_notifications_complete_by_resources_not_a_last_flag() -> None:
    """docs/failure-modes.md #8: the last part's notification arrives first; decode must still
    finish."""
    cluster = Cluster(mode="staged")
    request = cluster.new_request(num_tokens=16)
    first = cluster.fabric.inject(FaultRule(
        FaultAction.DELAY, lambda e: message_type(e) == "staged_part"
        and b'"part":0' in e.payload, delay_s=0.2))
    cluster.start(request, send=False)
    cluster.senders[0].send_part(request.room, pages=range(0, 2))
    cluster.senders[0].send_part(request.room, pages=range(2, 4), last=True)
    cluster.run(lambda: cluster.finished(request.room))
    assert first.applied == 1
    assert cluster.states(request.room) == SUCCEEDED and cluster.verified(request)


# Fault injection on every message type: drop, duplicate, reorder --------------------------

STAGED_FLOW = ["request_kv", "alloc_request", "grant", "staged_part", "release"]
DIRECT_FLOW = ["request_kv", "part_done", "release"]


def _flow(message: str) -> str:
    return "contiguous" if message == "part_done" else "staged"


DROP_OUTCOMES: dict[str, tuple[set[State], set[FailureReason | None]]] = {
    # (states seen over both sides, reasons seen): re-sent messages recover, a WRITE's lost
    # notification too (the writer sends it again when no Release follows); a lost Release
    # fails the prefill side within its deadline with the reason that says so.
    "request_kv": (SUCCEEDED, {None}),
    "alloc_request": (SUCCEEDED, {None}),
    "grant": (SUCCEEDED, {None}),
    "staged_part": (SUCCEEDED, {None}),
    "staged_part, pre-granted": (SUCCEEDED, {None}),
    "part_done": (SUCCEEDED, {None}),
    "release": ({State.SUCCEEDED, State.FAILED}, {None, FailureReason.TRANSFER_TIMEOUT}),
}
# Every message of each flow, with pre-grants (a one-part request then sends no
# AllocRequest / Grant) and without them (part 0 asks, as every later part does).
FLOWS = [(m, False) for m in [*STAGED_FLOW, "part_done"]] + [
    (m, True) for m in ("request_kv", "staged_part", "release")]


def _cluster(message: str, pregrant: bool) -> Cluster:
    return Cluster(mode=_flow(message), pregrant_share=0.5 if pregrant else 0.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("message", "pregrant"), FLOWS)
def test_a_dropped_message_recovers_or_fails_with_its_reason_within_the_deadline(
    message: str, pregrant: bool,
) -> None:
    """docs/failure-modes.md #3: a lost message never leaves a worker waiting forever."""
    cluster = _cluster(message, pregrant)
    rule = cluster.fabric.inject(FaultRule(FaultAction.DROP, of_type(message)))
    request = cluster.new_request(num_tokens=10)
    cluster.start(request)
    rounds = cluster.run(lambda: cluster.finished(request.room))
    assert rule.applied == 1
    states, reasons = DROP_OUTCOMES[message + (", pre-granted" if pregrant and message
                                               == "staged_part" else "")]
    assert cluster.senders[0].pregrants_taken == (pregrant and _flow(message) == "staged")
    assert cluster.states(request.room) == states
    assert cluster.reasons(request.room) == reasons
    assert rounds * cluster.tick_s <= cluster.timeouts.transfer_s + 1
    _assert_clean_after_grace(cluster)
    after = cluster.new_request(num_tokens=10)
    cluster.start(after)
    cluster.run(lambda: cluster.finished(after.room))
    assert cluster.states(after.room) == SUCCEEDED and cluster.verified(after)


def test_a_lost_notification_is_sent_again_and_the_request_completes_bit_exact() -> None:
    """docs/failure-modes.md #3: the last of three parts lands without its notification (its
    data is in decode's ring). With every part written and no Release after a quarter of the
    stall watchdog's time, the writer sends all three notifications again, once: decode
    scatters the missing part and counts the other two as duplicates, before its watchdog."""
    cluster = Cluster(mode="staged", pregrant_share=0.0)
    rule = cluster.fabric.inject(FaultRule(
        FaultAction.DROP, lambda e: message_type(e) == "staged_part" and b'"part":2' in e.payload))
    request = cluster.new_request(num_tokens=24)  # 6 pages
    cluster.start(request, send=False)
    sender, receiver = cluster.senders[0], cluster.receivers[0]
    sender.send_part(request.room, pages=range(0, 2))
    sender.send_part(request.room, pages=range(2, 4))
    sender.send_part(request.room, pages=range(4, 6), last=True)
    rounds = cluster.run(lambda: cluster.finished(request.room))
    assert rule.applied == 1
    assert cluster.states(request.room) == SUCCEEDED and cluster.verified(request)
    assert sender.metrics.renotified._value.get() == 3
    assert receiver.metrics.rejected.labels("duplicate")._value.get() == 2
    assert rounds * cluster.tick_s < receiver.timeouts.stall_s


@pytest.mark.parametrize(("message", "pregrant"), FLOWS)
def test_a_duplicated_message_is_harmless(message: str, pregrant: bool) -> None:
    """Requests are idempotent: each message type delivered twice still succeeds."""
    cluster = _cluster(message, pregrant)
    seen: list[Envelope] = []

    def capture(envelope: Envelope) -> bool:
        if message_type(envelope) == message and not seen:
            seen.append(envelope)
        return False  # observe only

    cluster.fabric.inject(FaultRule(FaultAction.DROP, capture, remaining=None))
    request = cluster.new_request(num_tokens=10)
    cluster.start(request)
    cluster.run(lambda: bool(seen))
    agents = {e.transport.agent_name: e.transport for e in cluster.endpoints}
    agents[seen[0].src].send_message(seen[0].dst, seen[0].payload)  # the duplicate
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.states(request.room) == SUCCEEDED and cluster.verified(request)


@pytest.mark.parametrize(("message", "pregrant"), FLOWS)
def test_a_delayed_message_overtaken_by_later_ones_still_succeeds(message: str,
                                                                  pregrant: bool) -> None:
    cluster = _cluster(message, pregrant)
    rule = cluster.fabric.inject(FaultRule(FaultAction.DELAY, of_type(message), delay_s=0.15))
    request = cluster.new_request(num_tokens=10)
    cluster.start(request)
    cluster.run(lambda: cluster.finished(request.room))
    assert rule.applied == 1
    assert cluster.states(request.room) == SUCCEEDED and cluster.verified(request)


def test_dropped_watermark_and_queued_grant_still_complete() -> None:
    """A full ring queues the AllocRequest and answers with a Watermark; losing it costs
    only a re-send, and the queued grant arrives when the ring frees."""
    cluster = Cluster(mode="staged", ring_bytes=1024, kv_heads=2, head_dim=16)
    rule = cluster.fabric.inject(FaultRule(FaultAction.DROP, of_type("watermark")))
    first, second = cluster.new_request(num_tokens=4), cluster.new_request(num_tokens=4)
    cluster.start(first)
    cluster.start(second)  # 2 layers x 2 parts x 4 tokens x 2 heads x 32 B = 1024 B each
    cluster.run(lambda: cluster.finished(first.room) and cluster.finished(second.room))
    assert rule.applied >= 1
    for request in (first, second):
        assert cluster.states(request.room) == SUCCEEDED and cluster.verified(request)


def test_grant_timeout_when_decode_never_answers() -> None:
    cluster = Cluster(mode="staged", pregrant_share=0.0)
    cluster.fabric.inject(FaultRule(FaultAction.DROP, of_type("alloc_request"), remaining=None))
    request = cluster.new_request(num_tokens=8)
    cluster.start(request)
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.senders[0].poll(request.room).reason is FailureReason.GRANT_TIMEOUT  # type: ignore[union-attr]


def _assert_clean_after_grace(cluster: Cluster) -> None:
    """Quarantined regions are released after the grace; then every map is empty."""
    cluster.clock.advance(cluster.timeouts.quarantine_grace_s + 0.1)
    cluster.step()
    for receiver in cluster.receivers:
        assert receiver.ring.used_bytes == 0
    for counts in cluster.counts():
        assert {k: v for k, v in counts.items() if k != "live_status"} == dict.fromkeys(
            [k for k in counts if k != "live_status"], 0), counts


# Ring and watchdog ------------------------------------------------------------------------


def test_a_chunk_larger_than_the_ring_fails_only_its_request() -> None:
    """docs/failure-modes.md #6: OversizedChunk naming the pool size needed; the worker lives on,
    the
    next small request succeeds, nothing leaks."""
    cluster = Cluster(mode="staged", ring_bytes=4096)
    big = cluster.new_request(num_tokens=128)  # 2 layers x 2 x 128 tokens x 2 heads x 8 B
    cluster.start(big)
    cluster.run(lambda: cluster.finished(big.room))
    assert cluster.reasons(big.room) == {FailureReason.OVERSIZED_CHUNK}
    decode_detail = cluster.receivers[0].poll(big.room).detail  # type: ignore[union-attr]
    prefill_detail = cluster.senders[0].poll(big.room).detail  # type: ignore[union-attr]
    assert "8192" in decode_detail and "decodePoolMiB" in decode_detail
    assert "8192" in prefill_detail and "decodePoolMiB" in prefill_detail
    small = cluster.new_request(num_tokens=8)
    cluster.start(small)
    cluster.run(lambda: cluster.finished(small.room))
    assert cluster.states(small.room) == SUCCEEDED and cluster.verified(small)
    _assert_clean_after_grace(cluster)


def test_abort_mid_transfer_then_100_requests_through_the_same_ring() -> None:
    """docs/failure-modes.md #4: an aborted request must not pin the ring."""
    cluster = Cluster(mode="staged", prefill_tp=2, decode_tp=2, kv_heads=2,
                      ring_bytes=8192)
    hold = cluster.fabric.inject(FaultRule(FaultAction.DROP, of_type("staged_part"),
                                           remaining=None))
    victim = cluster.new_request(num_tokens=16)
    cluster.start(victim)
    cluster.run(lambda: all(r.ring.used_bytes for r in cluster.receivers))  # granted
    cluster.receivers[0].abort(victim.room)
    cluster.run(lambda: cluster.finished(victim.room))
    assert FailureReason.ABORTED in cluster.reasons(victim.room)
    hold.remaining = 0
    for _ in range(10):
        batch = [cluster.new_request(num_tokens=12) for _ in range(10)]
        for request in batch:
            cluster.start(request)
        cluster.run(lambda b=batch: all(cluster.finished(r.room) for r in b))  # type: ignore[misc]
        for request in batch:
            assert cluster.states(request.room) == SUCCEEDED and cluster.verified(request)
            cluster.retire(request)
    _assert_clean_after_grace(cluster)


def test_a_stalled_writer_is_failed_by_the_watchdog_and_the_ring_is_not_pinned() -> None:
    """docs/failure-modes.md #16: a writer granted a region that never writes it."""
    cluster = Cluster(mode="staged", ring_bytes=4096, pregrant_share=0.0)
    cluster.fabric.inject(FaultRule(FaultAction.DROP, of_type("grant", "alloc_request"),
                                    remaining=0))
    stuck = cluster.new_request(num_tokens=8)
    # The WRITE is delayed past the stall deadline: the region is quarantined, not reused.
    cluster.fabric.inject(FaultRule(FaultAction.DELAY, of_type("staged_part"), delay_s=30.0))
    cluster.start(stuck)
    rounds = cluster.run(lambda: cluster.finished(stuck.room))
    assert cluster.receivers[0].poll(stuck.room).reason is FailureReason.STALLED_WRITER  # type: ignore[union-attr]
    assert rounds * cluster.tick_s <= cluster.timeouts.stall_s + 0.5
    assert cluster.receivers[0].ring.quarantined_regions == 1
    after = cluster.new_request(num_tokens=8)
    cluster.start(after)
    cluster.run(lambda: cluster.finished(after.room))
    assert cluster.states(after.room) == SUCCEEDED and cluster.verified(after)
    _assert_clean_after_grace(cluster)


def test_a_notification_of_another_room_leaves_a_quarantined_region_held() -> None:
    """docs/failure-modes.md #3, #16: a written part's notification sent again after decode
    finished its room may name a ring region that a failed room of the same writer holds in
    quarantine since: only that room's own late write may release it."""
    cluster = Cluster(mode="staged", ring_bytes=4096, pregrant_share=0.0)
    cluster.fabric.inject(FaultRule(FaultAction.DELAY, of_type("staged_part"), delay_s=30.0))
    stuck = cluster.new_request(num_tokens=8)
    cluster.start(stuck)
    cluster.run(lambda: cluster.finished(stuck.room))
    sender, receiver = cluster.senders[0], cluster.receivers[0]
    assert receiver.ring.quarantined_regions == 1
    held = receiver.grants.quarantined[0]
    stale = StagedPart(room="finished-room", ticket=held.ticket, part=0, sender_id=0,
                       ring_offset=held.region.offset_bytes, size_bytes=held.region.size_bytes,
                       layer_start=0, layer_stop=2, page_start=0, page_count=2,
                       ring_version=held.ring_version)
    assert held.matches(sender.transport.agent_name, stale.ticket, stale.ring_offset,
                        stale.size_bytes, stale.ring_version)  # all but the room
    sender.transport.send_message(receiver.transport.agent_name, seal_as(
        sender.transport.agent_name, receiver.transport.agent_name, stale))
    cluster.step()
    assert receiver.ring.quarantined_regions == 1
    assert receiver.metrics.snapshot().rejected_by_reason == {"unknown_room": 1}


def test_an_exception_inside_one_request_fails_only_that_request() -> None:
    """docs/failure-modes.md #12: the worker keeps serving; the other requests succeed."""

    class ExplodingEvent:
        def query(self) -> bool:
            raise RuntimeError("injected: device fault while polling the ready event")

    cluster = Cluster(mode="staged")
    requests = [cluster.new_request(num_tokens=8) for _ in range(3)]
    for index, request in enumerate(requests):
        cluster.start(request, send=False)
        cluster.senders[0].send_part(request.room, last=True,
                                     ready_event=ExplodingEvent() if index == 1 else None)
    cluster.run(lambda: all(cluster.finished(r.room) for r in requests))
    assert cluster.senders[0].poll(requests[1].room).reason is FailureReason.INTERNAL_ERROR  # type: ignore[union-attr]
    assert "injected" in cluster.senders[0].poll(requests[1].room).detail  # type: ignore[union-attr]
    assert cluster.receivers[0].poll(requests[1].room).reason is FailureReason.ABORTED_BY_PEER  # type: ignore[union-attr]
    for request in (requests[0], requests[2]):
        assert cluster.states(request.room) == SUCCEEDED and cluster.verified(request)


def test_request_kv_before_prefill_registered_is_buffered() -> None:
    """docs/failure-modes.md #2: decode asks first; prefill registers a few rounds later."""
    cluster = Cluster(mode="staged")
    request = cluster.new_request(num_tokens=8)
    cluster.receivers[0].expect(request.room, request.dst_pages, request.num_tokens)
    for _ in range(5):
        cluster.step()
    assert cluster.senders[0].debug_counts()["early_requests"] == 1
    cluster.senders[0].register_request(request.room, request.src_pages, request.num_tokens)
    cluster.senders[0].send_part(request.room, last=True)
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.states(request.room) == SUCCEEDED and cluster.verified(request)


def test_request_kv_for_an_unregistered_room_is_kept_for_decodes_deadline() -> None:
    """A RequestKV whose room prefill's engine has not scheduled yet (a long queue) is kept
    as long as decode itself waits (its transfer deadline), not only the shorter KV lease;
    after that it is refused LeaseExpired."""
    timeouts = replace(FAST, kv_lease_s=0.2, transfer_s=0.6)
    cluster = Cluster(mode="staged", timeouts=timeouts)
    late, never = cluster.new_request(num_tokens=8), cluster.new_request(num_tokens=8)
    for request in (late, never):
        cluster.receivers[0].expect(request.room, request.dst_pages, request.num_tokens)
    for _ in range(40):  # 0.4 s: past the lease, inside decode's deadline
        cluster.step()
        cluster.clock.advance(cluster.tick_s)
    assert cluster.senders[0].debug_counts()["early_requests"] == 2
    cluster.senders[0].register_request(late.room, late.src_pages, late.num_tokens)
    cluster.senders[0].send_part(late.room, last=True)
    cluster.run(lambda: cluster.finished(late.room)
                and cluster.receivers[0].poll(never.room).finished)  # type: ignore[union-attr]
    assert cluster.states(late.room) == SUCCEEDED and cluster.verified(late)
    refused = cluster.receivers[0].poll(never.room)
    assert refused is not None and refused.reason in (FailureReason.LEASE_EXPIRED,
                                                      FailureReason.TRANSFER_TIMEOUT)
    cluster.run(lambda: cluster.senders[0].debug_counts()["early_requests"] == 0, 10)


def test_a_request_kv_prefill_refuses_is_answered_so_decode_fails_at_once() -> None:
    """Guards against a refused RequestKV that decode waits out to its transfer deadline
    (docs/failure-modes.md #58): here a decode whose tickets restarted under the same agent
    name (its window on prefill 5000 ahead) is refused ``stale_ticket``; prefill answers with
    an Abort of that ticket and decode fails the request within a few steps, naming why.
    The next request, whose ticket is inside the window again, succeeds bit-exactly."""
    cluster = Cluster(mode="staged", timeouts=replace(FAST, transfer_s=60.0))
    receiver, sender = cluster.receivers[0], cluster.senders[0]
    receiver._tickets = itertools.count(5000)
    first = cluster.new_request(num_tokens=8)
    cluster.start(first)
    cluster.run(lambda: cluster.finished(first.room))
    assert cluster.states(first.room) == SUCCEEDED
    receiver._tickets = itertools.count(1)  # far below what prefill has seen from it
    refused = cluster.new_request(num_tokens=8)
    cluster.start(refused, send=False)
    rounds = cluster.run(lambda: receiver.poll(refused.room).finished, 50)  # type: ignore[union-attr]
    status = receiver.poll(refused.room)
    assert status is not None and status.reason is FailureReason.ABORTED_BY_PEER, status
    assert (f"ProtocolViolation: prefill refused this RequestKV (stale_ticket): RequestKV for "
            f"{refused.room!r} ticket 1 from {receiver.transport.agent_name}, below the window "
            f"(5000)") in status.detail, status.detail
    assert rounds < 50 and cluster.clock() < 60.0  # long before decode's deadline
    assert sender.metrics.snapshot().rejected_by_reason == {"stale_ticket": 1}
    receiver._tickets = itertools.count(4900)  # inside the window again
    after = cluster.new_request(num_tokens=8)
    cluster.start(after)
    cluster.run(lambda: cluster.finished(after.room))
    assert cluster.states(after.room) == SUCCEEDED and cluster.verified(after)


def test_prefill_kv_hold_has_a_lease() -> None:
    """docs/failure-modes.md #18: no decode ever asks → LeaseExpired, the KV released."""
    cluster = Cluster(mode="staged")
    request = cluster.new_request(num_tokens=8)
    cluster.senders[0].register_request(request.room, request.src_pages, request.num_tokens)
    cluster.senders[0].send_part(request.room, last=True)
    rounds = cluster.run(lambda: cluster.senders[0].poll(request.room).finished)  # type: ignore[union-attr]
    assert cluster.senders[0].poll(request.room).reason is FailureReason.LEASE_EXPIRED  # type: ignore[union-attr]
    assert rounds * cluster.tick_s == pytest.approx(cluster.timeouts.kv_lease_s, abs=0.05)


def test_prefill_reports_the_kv_it_holds_until_decode_pulls_it() -> None:
    """docs/failure-modes.md #39: what a leaving prefill waits for is visible. A request
    registered and never asked for is held with its bytes and its age; once decode pulled
    it, nothing is."""
    cluster = Cluster(mode="staged", prefill_tp=2, decode_tp=2, kv_heads=4)
    request = cluster.new_request(num_tokens=13)  # 4 pages of 4 tokens
    for sender in cluster.senders:
        sender.register_request(request.room, request.src_pages, request.num_tokens)
        sender.send_part(request.room, last=True)
    cluster.step()  # the senders' workers take the registrations
    cluster.clock.advance(0.75)
    # 2 layers x 2 heads per rank x 4 dims x 2 bytes (bfloat16) x 4 tokens x K and V, per page
    page_bytes = 2 * 2 * 4 * 2 * 4 * 2
    for sender in cluster.senders:
        assert sender.metrics.snapshot().pending == PendingKV(1, 4 * page_bytes, 0.75)
        exposition = generate_latest(sender.metrics.registry).decode()
        assert f'pd_transfer_kv_pending_bytes{{role="prefill"}} {float(4 * page_bytes)}' in (
            exposition)
        assert 'pd_transfer_kv_pending_oldest_seconds{role="prefill"} 0.75' in exposition
    for receiver in cluster.receivers:
        receiver.expect(request.room, request.dst_pages, request.num_tokens)
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.states(request.room) == SUCCEEDED and cluster.verified(request)
    for endpoint in cluster.endpoints:
        assert endpoint.metrics.snapshot().pending == PendingKV(0, 0, 0.0)


def transferring_with_decode_dead() -> tuple[Cluster, Request]:
    """A staged request that reached TRANSFERRING, then its decode peer's process died."""
    cluster = Cluster(mode="staged")
    request = cluster.new_request(num_tokens=8)
    cluster.start(request, send=False)
    cluster.run(lambda: cluster.senders[0].poll(request.room).state  # type: ignore[union-attr]
                is State.TRANSFERRING)
    cluster.fabric.kill(cluster.receivers[0].transport.agent_name)
    cluster.receivers.clear()  # its process is gone: nothing steps it any more
    return cluster, request


def test_a_dead_decode_peer_fails_prefill_requests_with_peer_unreachable() -> None:
    """docs/failure-modes.md #10, #19: the peer is pruned; its requests fail fast, no hang."""
    cluster, request = transferring_with_decode_dead()
    cluster.senders[0].send_part(request.room, last=True)
    rounds = cluster.run(lambda: cluster.senders[0].poll(request.room).finished)  # type: ignore[union-attr]
    assert cluster.senders[0].poll(request.room).reason is FailureReason.PEER_UNREACHABLE  # type: ignore[union-attr]
    assert rounds < 10
    assert cluster.senders[0].peers == {}


def test_an_abort_whose_notice_finds_the_peer_dead_fails_the_request_once() -> None:
    """The Abort sent to decode meets a dead peer: pruning it fails the request first
    (PeerUnreachable); the abort itself then has nothing left to do and must not raise."""
    cluster, request = transferring_with_decode_dead()
    aborted = cluster.senders[0].abort(request.room, "the engine ended the request")
    cluster.run(aborted.done)
    assert aborted.exception() is None
    status = cluster.senders[0].poll(request.room)
    assert status is not None and status.state is State.FAILED
    assert status.reason is FailureReason.PEER_UNREACHABLE
    assert cluster.senders[0].peers == {}


# Hostile peers ------------------------------------------------------------------------------


def test_hostile_messages_are_rejected_counted_and_change_nothing() -> None:
    """docs/failure-modes.md #15: a stranger, a wrong writer, a grant never asked for, a
    notification
    for an unknown room: each rejected by reason; the live request is unaffected."""
    cluster = Cluster(mode="staged")
    receiver, sender = cluster.receivers[0], cluster.senders[0]
    mallory = cluster.fabric.create("mallory")
    mallory.add_peer(receiver.transport.local_metadata(),
                     expected_name=receiver.transport.agent_name)
    mallory.add_peer(sender.transport.local_metadata(), expected_name=sender.transport.agent_name)
    request = cluster.new_request(num_tokens=8)
    cluster.start(request, send=False)
    cluster.run(lambda: sender.poll(request.room).state is State.TRANSFERRING)  # type: ignore[union-attr]
    ring_before = receiver.ring_buffer.clone()
    # The live request's tickets: mallory copies them, so the checks past them are met.
    (ticket,) = receiver.request_tickets(request.room).values()
    hostile: list[tuple[Endpoint, Message]] = [
        (receiver, AllocRequest(room=request.room, ticket=ticket, part=0, sender_id=0,
                                size_bytes=64)),
        (receiver, StagedPart(room=request.room, ticket=ticket, part=0, sender_id=0,
                              ring_offset=0, size_bytes=64, layer_start=0, layer_stop=1,
                              page_start=0, page_count=1, ring_version=1)),
        (receiver, Release(room=request.room, ticket=ticket)),
        (sender, Grant(room=request.room, ticket=ticket, part=5, sender_id=0, ring_offset=0,
                       size_bytes=64, ring_version=1)),
        (sender, StagedPart(room="nope", ticket=1, part=0, sender_id=0, ring_offset=0,
                            size_bytes=64,
                            layer_start=0, layer_stop=1, page_start=0, page_count=1,
                            ring_version=1)),
    ]
    for target, message in hostile:
        mallory.send_message(target.transport.agent_name,
                             seal_as("mallory", target.transport.agent_name, message))
    mallory.send_message(receiver.transport.agent_name,
                         seal_as("mallory", receiver.transport.agent_name,
                                 b'{"v":9,"type":"grant"}'))
    for _ in range(3):
        cluster.step()
    assert receiver.metrics.snapshot().rejected_by_reason == {
        "sender_mismatch": 2, "wrong_direction": 1, "unsupported_version": 1}
    assert sender.metrics.snapshot().rejected_by_reason == {
        "unknown_room": 1, "wrong_direction": 1}
    assert cluster.states(request.room) == {State.TRANSFERRING}
    assert torch.equal(receiver.ring_buffer, ring_before)
    sender.send_part(request.room, last=True)
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.states(request.room) == SUCCEEDED and cluster.verified(request)


def test_a_grant_outside_the_ring_is_refused_before_anything_is_posted() -> None:
    """A peer can never make us write outside the region it registered (docs/failure-modes.md
    #15)."""
    cluster = Cluster(mode="staged", ring_bytes=4096, pregrant_share=0.0)
    sender, receiver = cluster.senders[0], cluster.receivers[0]
    cluster.fabric.inject(FaultRule(FaultAction.DROP, of_type("grant")))
    request = cluster.new_request(num_tokens=8)
    cluster.start(request)
    cluster.run(lambda: sender.alloc_requests_sent == 1)
    forged = Grant(room=request.room,
                   ticket=sender.request_tickets(request.room)[receiver.transport.agent_name],
                   part=0, sender_id=0, ring_offset=4096 - 256, size_bytes=512,
                   ring_version=1)
    receiver.transport.send_message(sender.transport.agent_name, seal_as(
        receiver.transport.agent_name, sender.transport.agent_name, forged))
    cluster.run(lambda: cluster.finished(request.room))
    assert sender.poll(request.room).reason is FailureReason.PROTOCOL_VIOLATION  # type: ignore[union-attr]
    assert sender.transport.stats.transfers_posted == 0
    assert sender.metrics.snapshot().rejected_by_reason["region_mismatch"] == 1


def test_request_kv_naming_pages_outside_the_decode_pool_is_a_violation() -> None:
    cluster = Cluster(mode="contiguous")
    sender, receiver = cluster.senders[0], cluster.receivers[0]
    request = cluster.new_request(num_tokens=8)
    sender.register_request(request.room, request.src_pages, request.num_tokens)
    sender.send_part(request.room, last=True)
    forged = seal_as(receiver.transport.agent_name, sender.transport.agent_name,
                     RequestKV(room=request.room, ticket=1, decode_pp_rank=0,
                               decode_tp_rank=0,
                               dst_page_runs=((cluster.num_pages - 1, 2),),
                               num_tokens=8, path="contiguous", ring_version=1))
    receiver.transport.send_message(sender.transport.agent_name, forged)
    cluster.run(lambda: sender.poll(request.room).finished)  # type: ignore[union-attr]
    assert sender.poll(request.room).reason is FailureReason.PROTOCOL_VIOLATION  # type: ignore[union-attr]
    assert sender.transport.stats.transfers_posted == 0


# Bounded state --------------------------------------------------------------------------------


@pytest.mark.parametrize("waves", [
    pytest.param(25, id="2500"), pytest.param(100, id="10k", marks=pytest.mark.long)])
def test_requests_with_failures_and_aborts_leave_every_map_at_baseline(waves: int) -> None:
    """docs/failure-modes.md #11: per-request state is released on every path, not only on
    success. 2,500 requests in CI; the 10k run (`make test-long`) takes 50 s on 2 cores."""
    cluster = Cluster(mode="staged", kv_heads=1, layers=1, head_dim=2, page_size=1,
                      num_pages=256, ring_bytes=2048, tick_s=0.1)
    baseline = cluster.counts()
    cluster.fabric.inject(FaultRule(FaultAction.FAIL, lambda e: e.kind == "transfer"
                                    and hash(e.payload) % 17 == 0, remaining=None))
    cluster.fabric.inject(FaultRule(FaultAction.DROP, lambda e: message_type(e) == "grant"
                                    and hash(e.payload) % 23 == 0, remaining=None))
    outcomes: dict[str, int] = {}
    for wave in range(waves):
        batch = [cluster.new_request(num_tokens=2) for _ in range(100)]
        for index, request in enumerate(batch):
            cluster.start(request)
            if index % 10 == 3:
                cluster.senders[0].abort(request.room)
            elif index % 10 == 7:
                cluster.receivers[0].abort(request.room)
        cluster.run(lambda b=batch: all(cluster.finished(r.room) for r in b))  # type: ignore[misc]
        for request in batch:
            for status in cluster.statuses(request.room):
                assert status is not None
                key = status.reason.value if status.reason else "ok"
                outcomes[key] = outcomes.get(key, 0) + 1
            for endpoint in cluster.endpoints:
                endpoint.forget(request.room)
            cluster.retire(request)
        assert wave < waves
    cluster.clock.advance(cluster.timeouts.quarantine_grace_s + 1)
    cluster.step()
    assert cluster.counts() == baseline
    assert cluster.receivers[0].ring.used_bytes == 0
    requests = waves * 100  # one status on each side per request; a fifth of them aborted
    assert outcomes["ok"] > requests and outcomes["Aborted"] >= requests // 5
    assert sum(outcomes.values()) == 2 * requests


def test_a_write_that_never_completes_fails_on_decode_and_prefill_logs_where_it_stopped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A WRITE whose completion never comes (held by the fabric) leaves decode's region
    granted but unwritten: decode fails StalledWriter, prefill fails on its Abort and logs
    the part it never saw written, with the WRITE still pending: the line a StalledWriter on
    decode is read against."""
    cluster = Cluster(mode="staged", pregrant_share=0.0)
    cluster.fabric.inject(FaultRule(FaultAction.DELAY, lambda e: e.kind == "transfer",
                                    delay_s=1000.0))
    request = cluster.new_request(num_tokens=8)
    with caplog.at_level("WARNING", logger="pd_transfer"):
        cluster.start(request)
        cluster.run(lambda: cluster.finished(request.room))
    assert cluster.reasons(request.room) == {FailureReason.STALLED_WRITER,
                                             FailureReason.ABORTED_BY_PEER}
    decode = cluster.receivers[0].transport.agent_name
    lines = [r.getMessage() for r in caplog.records if "parts unwritten" in r.getMessage()]
    assert len(lines) == 1
    assert re.fullmatch(
        rf"room {request.room} failed \(AbortedByPeer\) with parts unwritten: to {decode}: "
        r"part 0 Writing, given \d+\.\d s ago, posted \d+\.\d s ago, the WRITE pending",
        lines[0]), lines[0]


# Pre-grants (protocol v5: the decode package's docstring) --------------------------------


def _pregranted_rooms(receiver: DecodeReceiver) -> list[str]:
    return [t.room for t in receiver._transfers.values() for w in t.writers.values()
            for p in w.parts.values() if p.pregranted and p.state is PartState.GRANTED]


def _asked_while_computing(cluster: Cluster, count: int) -> list[Request]:
    """``count`` 8-token requests whose decode asked (RequestKV) while no part was given."""
    requests = [cluster.new_request(num_tokens=8) for _ in range(count)]
    for request in requests:
        cluster.start(request, send=False)
    receiver = cluster.receivers[0]
    cluster.run(lambda: all(receiver.poll(r.room).state is State.TRANSFERRING  # type: ignore[union-attr]
                            for r in requests))
    return requests


def _send_all_and_verify(cluster: Cluster, requests: list[Request]) -> None:
    for request in requests:
        cluster.senders[0].send_part(request.room, last=True)
    cluster.run(lambda: all(cluster.finished(r.room) for r in requests))
    for request in requests:
        assert cluster.states(request.room) == SUCCEEDED and cluster.verified(request)


def test_pre_grants_hold_at_most_their_share_of_the_ring_and_the_rest_ask() -> None:
    """1 → 1, 8 tokens: a writer's share is 2 layers × 2 pages × 4 tokens × 2 heads × 4 dims ×
    2 bytes × (K, V) = 512 bytes. A share of 0.5 of a 4096-byte ring holds 4 of them; the 5th
    and 6th request ask with an AllocRequest. Every request lands bit-exact."""
    cluster = Cluster(mode="staged", ring_bytes=4096, pregrant_share=0.5)
    sender, receiver = cluster.senders[0], cluster.receivers[0]
    requests = _asked_while_computing(cluster, 6)
    assert _pregranted_rooms(receiver) == [r.room for r in requests[:4]]
    assert receiver.ring.used_bytes == 4 * 512
    _send_all_and_verify(cluster, requests)
    assert (sender.pregrants_taken, sender.alloc_requests_sent) == (4, 2)
    assert [int(receiver.metrics.pregrants.labels(o)._value.get())
            for o in ("granted", "used", "returned")] == [4, 4, 0]


@pytest.mark.parametrize("engine_gathers", [False, True], ids=["worker", "engine gathers"])
def test_a_part_that_finds_the_ring_full_of_pre_grants_is_granted_the_latest_one(
    engine_gathers: bool,
) -> None:
    """Pre-grants may fill the ring, but never keep it from a part that is moving. 1 → 1, 8
    tokens: 8 shares of 512 bytes fill a 4096-byte ring. A 9th request gets no pre-grant; its
    part asks, finds no room and queues. Decode asks the latest pre-grant back (Withdraw);
    its writer, still computing, gives it (Withdrawn; with gathers on the engine's thread,
    the staging set aside for it too), and the 9th is granted the space. That writer asks
    with an AllocRequest once its KV is ready. Every request lands bit-exact, and the 7
    other pre-grants are never asked for."""
    cluster = Cluster(mode="staged", ring_bytes=4096, pregrant_share=1.0,
                      engine_gathers=engine_gathers)
    sender, receiver = cluster.senders[0], cluster.receivers[0]
    computing = _asked_while_computing(cluster, 8)
    assert _pregranted_rooms(receiver) == [r.room for r in computing]
    assert receiver.ring.used_bytes == 4096
    moving = cluster.new_request(num_tokens=8)
    cluster.start(moving)
    cluster.run(lambda: cluster.finished(moving.room))
    assert cluster.states(moving.room) == SUCCEEDED and cluster.verified(moving)
    assert _pregranted_rooms(receiver) == [r.room for r in computing[:7]]
    _send_all_and_verify(cluster, computing)
    assert (sender.pregrants_taken, sender.alloc_requests_sent) == (7, 2)
    assert [int(receiver.metrics.pregrants.labels(o)._value.get())
            for o in ("granted", "used", "returned", "reclaimed")] == [8, 7, 1, 1]
    assert receiver.ring.used_bytes == 0
    assert sender.debug_counts()["staging_regions"] == 0
    assert int(sender.metrics.gathers.labels("engine")._value.get()) == (
        7 if engine_gathers else 0)


def test_a_pre_granted_request_aborted_before_its_part_frees_the_ring_without_the_grace() -> None:
    """Decode's engine aborts a request whose writer still computes: decode quarantines the
    pre-granted region (the writer lives and might write), the writer fails on the Abort
    and answers Withdrawn, and the region is free at once, long before quarantine_grace_s."""
    cluster = Cluster(mode="staged", ring_bytes=4096)
    receiver = cluster.receivers[0]
    victim = cluster.new_request(num_tokens=8)
    cluster.start(victim, send=False)
    cluster.run(lambda: _pregranted_rooms(receiver) == [victim.room])
    receiver.abort(victim.room)
    rounds = cluster.run(lambda: cluster.finished(victim.room)
                         and receiver.debug_counts()["quarantined"] == 0)
    assert rounds * cluster.tick_s < 1.0 < cluster.timeouts.quarantine_grace_s
    assert cluster.reasons(victim.room) == {FailureReason.ABORTED,
                                            FailureReason.ABORTED_BY_PEER}
    assert receiver.ring.used_bytes == 0
    cluster.retire(victim)
    after = cluster.new_request(num_tokens=8)
    cluster.start(after)
    cluster.run(lambda: cluster.finished(after.room))
    assert cluster.states(after.room) == SUCCEEDED and cluster.verified(after)


@pytest.mark.parametrize(("offset", "size", "problem"), [
    (0, 1024, "share"),  # the share is 512 bytes
    (4096 - 256, 512, "outside"),  # ends past the 4096-byte ring
], ids=["not the writer's share", "outside the ring"])
def test_a_hostile_pre_grant_fails_its_request_before_anything_is_posted(
    offset: int, size: int, problem: str,
) -> None:
    cluster = Cluster(mode="staged", ring_bytes=4096)
    sender, receiver = cluster.senders[0], cluster.receivers[0]
    request = cluster.new_request(num_tokens=8)
    sender.register_request(request.room, request.src_pages, request.num_tokens)
    sender.send_part(request.room, last=True)
    forged = RequestKV(room=request.room, ticket=1, decode_pp_rank=0, decode_tp_rank=0,
                       dst_page_runs=compute_runs(request.dst_pages), num_tokens=8,
                       path="staged", ring_version=1, pregrant_offset=offset,
                       pregrant_bytes=size)
    receiver.transport.send_message(sender.transport.agent_name, seal_as(
        receiver.transport.agent_name, sender.transport.agent_name, forged))
    cluster.run(lambda: sender.poll(request.room).finished)  # type: ignore[union-attr]
    status = sender.poll(request.room)
    assert status is not None and status.reason is FailureReason.PROTOCOL_VIOLATION
    assert problem in status.detail
    assert sender.transport.stats.transfers_posted == 0 and sender.pregrants_taken == 0


def test_pre_grants_default_to_off_on_cpu_and_refuse_a_share_outside_0_to_1() -> None:
    """On CPU the grant round trip is small beside the copies (receiver.PREGRANT_SHARE)."""
    cluster = Cluster(mode="staged", pregrant_share=None)
    assert cluster.receivers[0].pregrant_share == 0.0
    request = cluster.new_request(num_tokens=8)
    cluster.start(request)
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.states(request.room) == SUCCEEDED and cluster.verified(request)
    assert (cluster.senders[0].pregrants_taken, cluster.senders[0].alloc_requests_sent) == (0, 1)
    with pytest.raises(ValueError, match=r"pregrant_share must be in \[0, 1\], got 1.5"):
        Cluster(mode="staged", pregrant_share=1.5)
