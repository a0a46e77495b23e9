"""WRITEs posted by the poster thread as soon as the engine's gathers ran (poster.py), over
the loopback transport, the endpoints stepped by hand and the poster a real thread.

``send_part`` hands the prepared WRITE of each armed share to the sender's ``WritePoster``
(on CPU the gathers ran inside the call, so it posts at once). What these pin: each WRITE is
posted exactly once, by the poster or, if the worker reaches the share first, by the worker;
the request lands bit-exact either way; a Withdraw, an abort or a failed post after or
before the poster's post is handled as for a WRITE the worker posted; nothing is left
behind. Where the order of the two threads matters, the test holds the poster's job (its
``submit`` is wrapped) and hands it over at a chosen point.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from pd_transfer.errors import PeerUnreachable, TransportError
from pd_transfer.poster import PostTicket, TicketState, WritePoster
from pd_transfer.protocol.lifecycle import FailureReason, State
from pd_transfer.sender import PrefillSender
from pd_transfer.transport.base import PreparedWrite, TransferHandle
from pd_transfer.transport.loopback import Envelope, FaultAction, FaultRule
from tests.transfer_harness import Cluster, Request

pytestmark = pytest.mark.timeout(60)

SUCCEEDED = {State.SUCCEEDED}


@pytest.fixture
def clusters() -> Iterator[list[Cluster]]:
    made: list[Cluster] = []
    yield made
    for cluster in made:
        for sender in cluster.senders:
            if sender.poster is not None:
                sender.poster.close()


def _cluster(made: list[Cluster], **kwargs: object) -> Cluster:
    cluster = Cluster(mode="staged", engine_gathers=True, early_posts=True,
                      **kwargs)  # type: ignore[arg-type]
    made.append(cluster)
    return cluster


def _armed(cluster: Cluster) -> list[int]:
    return [s.debug_counts()["armed_gathers"] for s in cluster.senders]


def _posted_by_poster(sender: PrefillSender) -> int:
    assert sender.poster is not None
    return sender.poster.posted


def _wait(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Real time: the poster is a thread of its own."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the poster did not get there"
        time.sleep(0.001)


def _finish(cluster: Cluster, request: Request) -> None:
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.states(request.room) == SUCCEEDED, cluster.statuses(request.room)
    assert cluster.verified(request)
    cluster.retire(request)


class _HeldJobs:
    """Wraps a sender's ``poster.submit``: jobs wait here until ``release``."""

    def __init__(self, sender: PrefillSender, monkeypatch: pytest.MonkeyPatch) -> None:
        assert sender.poster is not None
        self.poster = sender.poster
        self.submit = sender.poster.submit
        self.jobs: list[tuple[torch.cuda.Event | None, list[PostTicket]]] = []
        monkeypatch.setattr(sender.poster, "submit", self._hold)

    def _hold(self, event: torch.cuda.Event | None, tickets: Sequence[PostTicket]) -> None:
        self.jobs.append((event, list(tickets)))

    def release(self) -> list[PostTicket]:
        """Hand the held jobs to the poster and wait until it has handled them."""
        tickets = [t for _, ts in self.jobs for t in ts]
        for event, held in self.jobs:
            self.submit(event, held)
        self.jobs.clear()
        assert self.poster.flush()
        return tickets


# (prefill TP, decode TP) with 2 KV heads -> decode ranks each prefill rank writes to.
TOPOLOGIES = [((1, 1), [1]), ((1, 2), [2]), ((2, 1), [1, 1])]


@pytest.mark.parametrize(("tp", "streams"), TOPOLOGIES, ids=["1to1", "1to2", "2to1"])
def test_the_poster_posts_each_share_before_the_worker_steps_and_the_worker_adopts_it(
    clusters: list[Cluster], tp: tuple[int, int], streams: list[int],
) -> None:
    cluster = _cluster(clusters, prefill_tp=tp[0], decode_tp=tp[1])
    request = cluster.new_request(num_tokens=8)
    cluster.start(request, send=False)
    cluster.run(lambda: _armed(cluster) == streams)
    for sender in cluster.senders:
        sender.send_part(request.room, last=True)
    _wait(lambda: [_posted_by_poster(s) for s in cluster.senders] == streams)
    _finish(cluster, request)
    # Posted once each: by the poster, then adopted by the worker (no second WRITE).
    assert [s.transport.stats.transfers_posted for s in cluster.senders] == streams
    assert [s.prepared_writes_posted for s in cluster.senders] == streams
    assert [(s.pregrants_taken, s.alloc_requests_sent) for s in cluster.senders] == [
        (n, 0) for n in streams]
    cluster.assert_clean()


def test_a_share_the_worker_reaches_first_is_posted_by_the_worker_alone(
    clusters: list[Cluster], monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster = _cluster(clusters, decode_tp=2)
    sender = cluster.senders[0]
    held = _HeldJobs(sender, monkeypatch)
    request = cluster.new_request(num_tokens=8)
    cluster.start(request, send=False)
    cluster.run(lambda: _armed(cluster) == [2])
    sender.send_part(request.room, last=True)
    _finish(cluster, request)
    tickets = held.release()  # the poster gets its job after the worker posted both
    assert [t.state for t in tickets] == [TicketState.TAKEN] * 2
    assert (_posted_by_poster(sender), sender.transport.stats.transfers_posted) == (0, 2)
    assert sender.prepared_writes_posted == 2
    cluster.assert_clean()


def test_a_withdraw_after_the_posters_post_is_not_answered_and_the_part_lands(
    clusters: list[Cluster],
) -> None:
    """The poster posted into the pre-grant, the WRITE is still on its way (delayed on the
    fabric), and the worker handles decode's Withdraw (a ring resize) before the part:
    prefill answers as for a posted WRITE (no Withdrawn), so decode keeps the region until
    the StagedPart lands, the resize waits for it, and the request lands bit-exact. Giving
    the region back would let the late WRITE land in freed ring space."""
    cluster = _cluster(clusters, ring_bytes=8192)
    receiver, sender = cluster.receivers[0], cluster.senders[0]
    request = cluster.new_request(num_tokens=8)
    cluster.start(request, send=False)
    cluster.run(lambda: _armed(cluster) == [1])
    cluster.fabric.inject(FaultRule(FaultAction.DELAY, _transfers, delay_s=1.0))
    early = sender._gather_on_engine_thread(request.room, None, None, None)
    _wait(lambda: _posted_by_poster(sender) == 1)
    future = receiver.resize_ring(16384, deadline_s=30.0)
    rounds = cluster.run(future.done)
    assert rounds * cluster.tick_s >= 1.0  # it waited for the delayed WRITE
    assert future.result().failed_requests == 0
    given = cluster.clock()
    sender.submit(lambda: sender._add_part(request.room, None, None, True, None, given, early))
    _finish(cluster, request)
    assert (sender.pregrants_taken, sender.alloc_requests_sent) == (1, 0)
    assert _returned_pregrants(cluster) == 0
    assert sender.transport.stats.transfers_posted == 1
    cluster.assert_clean()


def test_a_withdraw_before_the_poster_posts_takes_its_ticket_back(
    clusters: list[Cluster], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's thread gathered (``send_part``'s first half), the poster has not posted
    yet, and the worker handles decode's Withdraw before the part: prefill gives the
    pre-grant back, the poster never posts that WRITE, and part 0 asks for a grant in the
    resized ring."""
    cluster = _cluster(clusters, ring_bytes=8192)
    receiver, sender = cluster.receivers[0], cluster.senders[0]
    held = _HeldJobs(sender, monkeypatch)
    request = cluster.new_request(num_tokens=8)
    cluster.start(request, send=False)
    cluster.run(lambda: _armed(cluster) == [1])
    early = sender._gather_on_engine_thread(request.room, None, None, None)
    future = receiver.resize_ring(16384, deadline_s=30.0)
    cluster.run(future.done)
    assert future.result().failed_requests == 0
    assert [t.state for t in held.release()] == [TicketState.TAKEN]
    given = cluster.clock()
    sender.submit(lambda: sender._add_part(request.room, None, None, True, None, given, early))
    _finish(cluster, request)
    assert _posted_by_poster(sender) == 0
    assert (sender.pregrants_taken, sender.alloc_requests_sent) == (0, 1)
    assert _returned_pregrants(cluster) == 1
    assert sender.transport.stats.transfers_posted == 1  # the worker's, into the new grant
    cluster.assert_clean()


def test_an_abort_after_the_posters_post_releases_it_and_leaves_nothing_behind(
    clusters: list[Cluster],
) -> None:
    """The request is aborted while the poster's WRITEs are on their way (delayed on the
    fabric) and before the worker made the part: prefill must not hand the pre-grants back
    as unwritten (decode would free ring space the WRITEs still land in); decode keeps them
    until the failed request's quarantine ends."""
    cluster = _cluster(clusters, decode_tp=2)
    sender = cluster.senders[0]
    request = cluster.new_request(num_tokens=8)
    cluster.start(request, send=False)
    cluster.run(lambda: _armed(cluster) == [2])
    cluster.fabric.inject(FaultRule(FaultAction.DELAY, _transfers, delay_s=1.0, remaining=2))
    sender.send_part(request.room, last=True)
    _wait(lambda: _posted_by_poster(sender) == 2)
    sender.abort(request.room)
    rounds = cluster.run(lambda: cluster.finished(request.room))
    assert rounds * cluster.tick_s < 1.0  # the WRITEs have not landed yet
    assert FailureReason.ABORTED in cluster.reasons(request.room)
    # Each pre-grant stays quarantined on decode: a Withdrawn would have freed it.
    assert [r.debug_counts()["quarantined"] for r in cluster.receivers] == [1, 1]
    assert _returned_pregrants(cluster) == 0
    cluster.retire(request)
    cluster.assert_clean()


def test_a_write_the_transport_discarded_before_the_poster_fails_the_request(
    clusters: list[Cluster], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The transport dropped the prepared WRITE (as it does when the peer's metadata is
    reloaded) before the poster got to it: the poster's post raises, and the worker fails
    the request with that error instead of posting anything."""
    cluster = _cluster(clusters)
    sender = cluster.senders[0]
    held = _HeldJobs(sender, monkeypatch)
    request = cluster.new_request(num_tokens=8)
    cluster.start(request, send=False)
    cluster.run(lambda: _armed(cluster) == [1])
    sender.send_part(request.room, last=True)
    (_, (ticket,)), = held.jobs
    sender.transport.discard(ticket.write)
    held.release()
    assert ticket.state is TicketState.FAILED
    cluster.run(lambda: cluster.finished(request.room))
    assert FailureReason.TRANSPORT_FAILED in cluster.reasons(request.room)
    assert sender.transport.stats.transfers_posted == 0
    cluster.retire(request)
    cluster.assert_clean()


def _transfers(envelope: Envelope) -> bool:
    return envelope.kind == "transfer"


def _returned_pregrants(cluster: Cluster) -> int:
    return sum(int(r.metrics.pregrants.labels("returned")._value.get())
               for r in cluster.receivers)


# The poster alone ------------------------------------------------------------------------


def _write(serial: int) -> PreparedWrite:
    return PreparedWrite("t", serial, "peer")


def test_the_poster_posts_pending_tickets_in_order_and_skips_taken_ones() -> None:
    lock = threading.Lock()
    posted: list[int] = []

    def post(write: PreparedWrite) -> TransferHandle:
        assert lock.locked()  # under the endpoint's step lock
        posted.append(write.serial)
        return TransferHandle("t", write.serial)

    poster = WritePoster(post, lock, time.monotonic, torch.device("cpu"), "test-poster")
    first, taken, last = PostTicket(_write(1)), PostTicket(_write(2)), PostTicket(_write(3))
    assert taken.take() and not taken.take()
    poster.submit(None, [first, taken])
    poster.submit(None, [last])
    poster.close()
    assert posted == [1, 3]
    assert [t.state for t in (first, taken, last)] == [
        TicketState.POSTED, TicketState.TAKEN, TicketState.POSTED]
    assert first.result() == TransferHandle("t", 1) and poster.posted == 2
    assert not first.take()  # a posted ticket is the worker's to adopt, not to post


@pytest.mark.parametrize("error", [PeerUnreachable("peer", "gone"), RuntimeError("bug")],
                         ids=["transport", "unexpected"])
def test_a_failed_post_is_kept_on_the_ticket_for_the_worker(error: Exception) -> None:
    def post(write: PreparedWrite) -> TransferHandle:
        raise error

    poster = WritePoster(post, threading.Lock(), time.monotonic, torch.device("cpu"), "p")
    ticket = PostTicket(_write(1))
    poster.submit(None, [ticket])
    poster.close()
    assert ticket.state is TicketState.FAILED and poster.posted == 0
    with pytest.raises(TransportError, match="gone" if isinstance(error, TransportError)
                       else "RuntimeError: bug"):
        ticket.result()


def test_closing_the_sender_stops_its_poster(clusters: list[Cluster]) -> None:
    cluster = _cluster(clusters)
    sender = cluster.senders[0]
    assert sender.poster is not None
    thread = sender.poster._thread
    assert thread.is_alive()
    sender.close()
    assert not thread.is_alive()


def test_without_engine_gathers_there_is_no_poster(clusters: list[Cluster]) -> None:
    cluster = Cluster(mode="staged", engine_gathers=False, early_posts=True)
    assert cluster.senders[0].poster is None
