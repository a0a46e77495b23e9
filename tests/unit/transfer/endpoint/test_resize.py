"""Hot resize of the staging pools (decode ring, prefill buffer) over the loopback transport.

Deterministic (manual clock, endpoints stepped by hand) and bounded (round limits). Guards
docs/failure-modes.md #25 (in-flight requests on a resizing pod finish or fail cleanly), #4/#11
(nothing
leaks across a resize) and #15 (a write with a stale registration is refused).
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from pd_contract.transferagent import AgentStaging
from pd_testbed.transfer_harness import Cluster, Request, message_type, seal_as
from pd_transfer.decode import DecodeReceiver
from pd_transfer.endpoint import ResizeResult
from pd_transfer.errors import ResizeError
from pd_transfer.protocol.lifecycle import FailureReason, State
from pd_transfer.protocol.messages import StagedPart
from pd_transfer.protocol.parts import PartState
from pd_transfer.transport import FaultAction, FaultRule

pytestmark = pytest.mark.timeout(60)

SUCCEEDED = {State.SUCCEEDED}


def _start_multipart(cluster: Cluster, request: Request) -> None:
    """Two parts per writer, so a request asks for ring space more than once."""
    for receiver in cluster.receivers:
        receiver.expect(request.room, request.dst_pages, request.num_tokens)
    half = len(request.src_pages) // 2
    for sender in cluster.senders:
        sender.register_request(request.room, request.src_pages, request.num_tokens)
        sender.send_part(request.room, pages=range(0, half))
        sender.send_part(request.room, pages=range(half, len(request.src_pages)), last=True)


def _all_done(cluster: Cluster, requests: list[Request], futures: list[Future[ResizeResult]],
              ) -> bool:
    return all(f.done() for f in futures) and all(cluster.finished(r.room) for r in requests)


def _succeeded_and_exact(cluster: Cluster, requests: list[Request]) -> None:
    for request in requests:
        assert cluster.states(request.room) == SUCCEEDED, cluster.statuses(request.room)
        assert cluster.verified(request)
        cluster.retire(request)


def _posted(cluster: Cluster) -> int:
    """Staged WRITEs the prefill ranks posted so far."""
    return sum(int(s.metrics.writes_posted.labels("staged")._value.get())
               for s in cluster.senders)


@pytest.mark.parametrize("new_bytes", [4096, 32768], ids=["shrink", "grow"])
def test_resize_under_a_steady_stream_fails_nothing(new_bytes: int) -> None:
    _resize_under_a_steady_stream(new_bytes, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("new_bytes", [4096, 32768], ids=["shrink", "grow"])
def test_resize_of_cuda_staging_under_a_steady_stream_fails_nothing(new_bytes: int) -> None:
    """The same on CUDA pools: gathers and scatters on the endpoints' staging streams, whose
    queued work a swap must wait for before the old memory goes (``StagingMemory.swap``)."""
    _resize_under_a_steady_stream(new_bytes, "cuda")


def _resize_under_a_steady_stream(new_bytes: int, device: str) -> None:
    cluster = Cluster(mode="staged", prefill_tp=2, decode_tp=2, kv_heads=2, ring_bytes=8192,
                      device=device)
    # Writes take a while (50 ms), so regions are live when the resize starts.
    cluster.fabric.inject(FaultRule(FaultAction.DELAY, lambda e: message_type(e)
                                    == "staged_part", delay_s=0.05, remaining=None))
    before = [cluster.new_request(num_tokens=16) for _ in range(8)]
    for request in before:
        _start_multipart(cluster, request)
    cluster.step()
    cluster.step()
    assert any(r.ring.live_regions for r in cluster.receivers)  # regions granted, in flight
    futures = [r.resize_bytes(new_bytes, deadline_s=5.0) for r in cluster.receivers]
    cluster.step()
    assert all(r.resizing for r in cluster.receivers)
    during = [cluster.new_request(num_tokens=16) for _ in range(8)]
    for request in during:
        _start_multipart(cluster, request)
    queued = 0

    def done() -> bool:
        nonlocal queued
        queued = max([queued, *(r.grants.queued for r in cluster.receivers)])
        return _all_done(cluster, before + during, futures)

    cluster.run(done)
    assert queued > 0  # AllocRequests waited for the new ring, then succeeded
    _succeeded_and_exact(cluster, before + during)
    for receiver, future in zip(cluster.receivers, futures, strict=True):
        result = future.result()
        assert (result.capacity_bytes, result.registration_version, result.failed_requests) \
            == (new_bytes, 2, 0)
        assert receiver.ring.capacity_bytes == new_bytes and receiver.ring_version == 2
        assert receiver.ring_region.size_bytes == new_bytes
        assert receiver.document().ring_version == 2
        snap = receiver.metrics.snapshot()
        assert (snap.staging_bytes, snap.registration_version, snap.resizing) == (
            new_bytes, 2, False)
        assert snap.staging_since_unix_s is not None and snap.failed == 0
        assert receiver.metrics.resizes.labels("ring", "succeeded")._value.get() == 1
    for sender in cluster.senders:
        assert all(d.ring_version == 2 for d in sender.peers.values())
    after = [cluster.new_request(num_tokens=16) for _ in range(8)]
    for request in after:
        _start_multipart(cluster, request)
    cluster.run(lambda: _all_done(cluster, after, []))
    _succeeded_and_exact(cluster, after)
    cluster.assert_clean()


def test_a_writer_silent_past_the_deadline_fails_only_its_request() -> None:
    cluster = Cluster(mode="staged", ring_bytes=8192)
    silent = cluster.new_request(num_tokens=8)
    late = cluster.fabric.inject(FaultRule(
        FaultAction.DELAY, lambda e: message_type(e) == "staged_part"
        and silent.room.encode() in e.payload, delay_s=0.5))
    cluster.start(silent)
    cluster.run(lambda: _posted(cluster) == 1)  # its WRITE is on its way: the region is held
    receiver = cluster.receivers[0]
    future = receiver.resize_bytes(16384, deadline_s=0.2)
    others = [cluster.new_request(num_tokens=8) for _ in range(3)]
    for request in others:
        cluster.start(request)
    cluster.run(lambda: future.done() and _all_done(cluster, others, []))
    assert receiver.poll(silent.room).reason is FailureReason.RESIZE_DEADLINE  # type: ignore[union-attr]
    assert future.result().failed_requests == 1 and receiver.ring_version == 2
    _succeeded_and_exact(cluster, others)
    assert receiver.debug_counts()["retired_rings"] == 1  # the late write may still land
    late.remaining = 0
    cluster.run(lambda: receiver.debug_counts()["retired_rings"] == 0)
    assert receiver.metrics.snapshot().failures_by_reason == {"ResizeDeadline": 1}
    cluster.run(lambda: cluster.finished(silent.room))
    cluster.retire(silent)
    cluster.assert_clean()


def test_a_staged_part_of_a_stale_registration_is_rejected_for_its_request_only() -> None:
    cluster = Cluster(mode="staged")
    receiver, sender = cluster.receivers[0], cluster.senders[0]
    future = receiver.resize_bytes(16384, deadline_s=1.0)
    cluster.run(future.done)
    victim = cluster.new_request(num_tokens=8)
    cluster.start(victim, send=False)
    cluster.run(lambda: receiver.poll(victim.room).state is State.TRANSFERRING)  # type: ignore[union-attr]
    (ticket,) = receiver.request_tickets(victim.room).values()
    stale = StagedPart(room=victim.room, ticket=ticket, part=0, sender_id=0, ring_offset=0,
                       size_bytes=256,
                       layer_start=0, layer_stop=2, page_start=0, page_count=2,
                       ring_version=1)
    sender.transport.send_message(receiver.transport.agent_name, seal_as(
        sender.transport.agent_name, receiver.transport.agent_name, stale))
    cluster.run(lambda: cluster.finished(victim.room))
    assert receiver.poll(victim.room).reason is FailureReason.PROTOCOL_VIOLATION  # type: ignore[union-attr]
    assert receiver.metrics.snapshot().rejected_by_reason["stale_registration"] == 1
    cluster.retire(victim)
    ok = cluster.new_request(num_tokens=8)
    cluster.start(ok)
    cluster.run(lambda: cluster.finished(ok.room))
    _succeeded_and_exact(cluster, [ok])


def test_a_ring_announcement_is_checked_against_what_the_rank_registered() -> None:
    """docs/failure-modes.md #50: a newer ring inside the KV pool, one overlapping the ring in
    force, a buffer the metadata does not register, another kind of memory, a version far
    ahead, and another ring at the version in force are refused, each with its reason; the
    announcement in force again is a repeat; a real resize is still taken."""
    cluster = Cluster(mode="staged")
    receiver, sender = cluster.receivers[0], cluster.senders[0]
    name, target = receiver.transport.agent_name, sender.transport.agent_name
    update = receiver._ring_update()
    pool, ring = receiver.kv_regions[0], receiver.ring_region
    version = update.ring_version
    forged = [
        update.model_copy(update={"ring_version": version + 1,
                                  "base_address": pool.base_address, "size_bytes": 4096}),
        update.model_copy(update={"ring_version": version + 1,
                                  "base_address": ring.base_address + 64, "size_bytes": 64}),
        update.model_copy(update={"ring_version": version + 1,
                                  "base_address": ring.end_address + (1 << 20)}),
        update.model_copy(update={"ring_version": version + 1, "kind": "VRAM"}),
        update.model_copy(update={"ring_version": version + 65,
                                  "base_address": ring.end_address + (1 << 20)}),
        update.model_copy(update={"base_address": ring.base_address + 64}),  # same version
        update,  # the announcement in force again: a repeat, not counted
    ]
    for message in forged:
        receiver.transport.send_message(target, seal_as(name, target, message))
    cluster.step()
    assert sender.metrics.snapshot().rejected_by_reason == {
        "invalid_ring_update": 4, "unregistered_ring": 1, "conflicting_registration": 1}
    assert sender.peers[name].ring_version == version
    future = receiver.resize_bytes(16384, deadline_s=1.0)
    cluster.run(future.done)
    cluster.step()
    assert sender.peers[name].ring_version == version + 1
    request = cluster.new_request(num_tokens=8)
    cluster.start(request)
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.states(request.room) == {State.SUCCEEDED} and cluster.verified(request)


def test_a_lost_ring_update_is_sent_again_and_the_next_request_succeeds() -> None:
    """Guards docs/failure-modes.md #3 for the resize protocol: a lost RingUpdate must not leave a
    writer
    holding grants it can never use (a stall until TransferTimeout). The writer re-sends its
    AllocRequest after grantSeconds; decode answers a duplicate with the RingUpdate again."""
    cluster = Cluster(mode="staged", prefill_tp=2, decode_tp=2, kv_heads=2)
    lost = cluster.fabric.inject(FaultRule(FaultAction.DROP, lambda e: message_type(e)
                                           == "ring_update", remaining=4))  # every one of them
    futures = [r.resize_bytes(16384, deadline_s=1.0) for r in cluster.receivers]
    cluster.run(lambda: all(f.done() for f in futures))
    assert lost.applied == 4
    assert all(d.ring_version == 1 for s in cluster.senders for d in s.peers.values())
    request = cluster.new_request(num_tokens=16)
    cluster.start(request)
    cluster.run(lambda: cluster.finished(request.room))
    _succeeded_and_exact(cluster, [request])
    # 2 KV heads over TP 2 → 2: each prefill rank writes to one decode rank only, so only
    # that peer's ring (re-sent) is known at version 2; the other one was never needed.
    assert [sorted(d.ring_version for d in s.peers.values() if d.role == "decode")
            for s in cluster.senders] == [[1, 2], [1, 2]]
    cluster.assert_clean()


def test_a_second_resize_while_one_runs_is_refused_and_bad_sizes_too() -> None:
    cluster = Cluster(mode="staged")
    receiver = cluster.receivers[0]
    hold = cluster.new_request(num_tokens=8)
    cluster.fabric.inject(FaultRule(FaultAction.DELAY, lambda e: message_type(e)
                                    == "staged_part", delay_s=0.3))
    cluster.start(hold)
    cluster.run(lambda: _posted(cluster) == 1)
    first = receiver.resize_bytes(16384, deadline_s=5.0)
    second = receiver.resize_bytes(32768, deadline_s=5.0)
    bad = receiver.resize_bytes(1000, deadline_s=5.0)  # not a multiple of the alignment
    cluster.step()
    with pytest.raises(ResizeError, match="under way"):
        second.result(0)
    with pytest.raises(ResizeError):
        bad.result(0)
    cluster.run(lambda: first.done() and cluster.finished(hold.room))
    assert first.result().capacity_bytes == 16384
    assert cluster.states(hold.room) == SUCCEEDED
    bad = receiver.resize_bytes(1000, deadline_s=5.0)  # alone: refused for its size
    cluster.step()
    with pytest.raises(ResizeError, match=r"multiple of the alignment \(256\), got 1000"):
        bad.result(0)
    assert receiver.ring.capacity_bytes == 16384 and not receiver.resizing


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_prefill_buffer_resize_under_a_stream(device: str) -> None:
    cluster = Cluster(mode="staged", prefill_tp=2, decode_tp=2, kv_heads=2,
                      staging_bytes=8192, device=device)
    before = [cluster.new_request(num_tokens=16) for _ in range(6)]
    for request in before:
        _start_multipart(cluster, request)
    cluster.step()
    futures = [s.resize_bytes(4096, deadline_s=5.0) for s in cluster.senders]
    during = [cluster.new_request(num_tokens=16) for _ in range(6)]
    for request in during:
        _start_multipart(cluster, request)
    cluster.run(lambda: _all_done(cluster, before + during, futures))
    _succeeded_and_exact(cluster, before + during)
    for sender, future in zip(cluster.senders, futures, strict=True):
        assert future.result().capacity_bytes == 4096 == sender.staging.capacity_bytes
        assert sender.staging_version == 2 and sender.staging_region.size_bytes == 4096
        assert sender.metrics.snapshot().staging_bytes == 4096
    cluster.assert_clean()


def test_100_requests_after_resizes_leave_every_map_at_baseline() -> None:
    cluster = Cluster(mode="staged", prefill_tp=2, decode_tp=2, kv_heads=2, ring_bytes=8192)
    baseline = cluster.counts()
    for size in (4096, 16384):
        futures = [r.resize_bytes(size, deadline_s=1.0) for r in cluster.receivers]
        futures += [s.resize_bytes(size, deadline_s=1.0) for s in cluster.senders]
        cluster.run(lambda f=futures: all(x.done() for x in f))  # type: ignore[misc]
        assert all(f.result().failed_requests == 0 for f in futures)
    for _ in range(10):
        batch = [cluster.new_request(num_tokens=12) for _ in range(10)]
        for request in batch:
            cluster.start(request)
        cluster.run(lambda b=batch: _all_done(cluster, b, []))  # type: ignore[misc]
        _succeeded_and_exact(cluster, batch)
    cluster.assert_clean()
    assert [{k: v for k, v in c.items() if k != "live_status"} for c in cluster.counts()] == [
        {k: v for k, v in c.items() if k != "live_status"} for c in baseline]
    assert all(r.ring_version == 3 for r in cluster.receivers)


def test_a_resize_to_the_size_in_force_changes_nothing() -> None:
    """Guards against draining and re-registering a buffer whose size did not change (a
    decode-pool rollout also writes the prefill pods, whose own buffer stays as it is)."""
    cluster = Cluster(mode="staged")
    receiver, sender = cluster.receivers[0], cluster.senders[0]
    ring_before, buffer_before = receiver.ring_region, sender.staging_region
    futures = [receiver.resize_bytes(receiver.ring.capacity_bytes, deadline_s=1.0),
               sender.resize_bytes(sender.staging.capacity_bytes, deadline_s=1.0)]
    cluster.step()
    assert [f.result(0) for f in futures] == [
        ResizeResult("ring", receiver.ring.capacity_bytes, 1, 0.0, 0),
        ResizeResult("buffer", sender.staging.capacity_bytes, 1, 0.0, 0)]
    assert (receiver.ring_region, sender.staging_region) == (ring_before, buffer_before)
    assert receiver.metrics.resizes.labels("ring", "succeeded")._value.get() == 0
    request = cluster.new_request(num_tokens=8)
    cluster.start(request)
    cluster.run(lambda: cluster.finished(request.room))
    _succeeded_and_exact(cluster, [request])


def test_one_agent_staging_resizes_each_side_to_its_own_size() -> None:
    """``Endpoint.resize`` takes the size of the endpoint's own role from the contract's
    ``AgentStaging``: the same sizes given to both sides resize decode's ring to
    decodePoolMiB and prefill's buffer to prefillBufferMiB; given again (a rollout writes every
    pod), each size is in force and nothing changes."""
    cluster = Cluster(mode="staged")
    receiver, sender = cluster.receivers[0], cluster.senders[0]
    staging = AgentStaging(decode_pool_mib=1, prefill_buffer_mib=2)
    futures = [receiver.resize(staging, deadline_s=1.0), sender.resize(staging, deadline_s=1.0)]
    cluster.run(lambda: all(f.done() for f in futures))
    assert [(r.side, r.capacity_bytes, r.registration_version, r.failed_requests)
            for r in (f.result(0) for f in futures)] == [("ring", 1 << 20, 2, 0),
                                                        ("buffer", 2 << 20, 2, 0)]
    assert (receiver.ring.capacity_bytes, sender.staging.capacity_bytes) == (1 << 20, 2 << 20)
    again = [receiver.resize(staging, deadline_s=1.0), sender.resize(staging, deadline_s=1.0)]
    cluster.step()
    assert [f.result(0) for f in again] == [ResizeResult("ring", 1 << 20, 2, 0.0, 0),
                                            ResizeResult("buffer", 2 << 20, 2, 0.0, 0)]
    request = cluster.new_request(num_tokens=8)
    cluster.start(request)
    cluster.run(lambda: cluster.finished(request.room))
    _succeeded_and_exact(cluster, [request])
    cluster.assert_clean()


def test_a_resize_takes_back_a_pre_grant_whose_writer_has_not_written() -> None:
    """A writer still computing its KV holds a pre-grant (protocol v5): the resize asks for
    it back (Withdraw), the writer gives it (Withdrawn) and the resize ends at once, not at
    its deadline; part 0 then asks in the new ring and the request succeeds bit-exact."""
    cluster = Cluster(mode="staged", ring_bytes=8192)
    receiver, sender = cluster.receivers[0], cluster.senders[0]
    computing = cluster.new_request(num_tokens=8)
    cluster.start(computing, send=False)  # registered, asked, no part given yet
    cluster.run(lambda: computing.room in {r for r, _ in _pregrants(cluster)})
    assert receiver.ring.live_regions == 1 and sender.pregrants_taken == 0
    future = receiver.resize_bytes(16384, deadline_s=30.0)
    rounds = cluster.run(future.done)
    assert rounds * cluster.tick_s < 1.0  # not the 30 s deadline
    assert future.result().failed_requests == 0 and receiver.ring_version == 2
    assert _pregrants(cluster) == []
    sender.send_part(computing.room, last=True)
    cluster.run(lambda: cluster.finished(computing.room))
    _succeeded_and_exact(cluster, [computing])
    assert sender.pregrants_taken == 0 and sender.alloc_requests_sent == 1
    assert {k: v for k, v in _pregrant_counts(receiver).items() if v} == {
        "granted": 1, "returned": 1}
    cluster.assert_clean()


def test_a_lost_withdraw_is_sent_again() -> None:
    cluster = Cluster(mode="staged", ring_bytes=8192)
    receiver = cluster.receivers[0]
    lost = cluster.fabric.inject(FaultRule(FaultAction.DROP, lambda e: message_type(e)
                                           == "withdraw"))
    computing = cluster.new_request(num_tokens=8)
    cluster.start(computing, send=False)
    cluster.run(lambda: receiver.ring.live_regions == 1)
    future = receiver.resize_bytes(16384, deadline_s=30.0)
    rounds = cluster.run(future.done)
    assert lost.applied == 1
    assert cluster.timeouts.grant_s <= rounds * cluster.tick_s < cluster.timeouts.grant_s + 1
    assert future.result().failed_requests == 0
    for sender in cluster.senders:
        sender.send_part(computing.room, last=True)
    cluster.run(lambda: cluster.finished(computing.room))
    _succeeded_and_exact(cluster, [computing])
    cluster.assert_clean()


def _pregrants(cluster: Cluster) -> list[tuple[str, int]]:
    """(room, bytes) of every pre-grant decode holds unwritten."""
    return [(t.room, p.region.size_bytes) for r in cluster.receivers
            for t in r._transfers.values() for w in t.writers.values()
            for p in w.parts.values()
            if p.pregranted and p.region is not None and p.state is PartState.GRANTED]


def _pregrant_counts(receiver: DecodeReceiver) -> dict[str, int]:
    return {outcome: int(receiver.metrics.pregrants.labels(outcome)._value.get())
            for outcome in ("granted", "used", "returned")}
