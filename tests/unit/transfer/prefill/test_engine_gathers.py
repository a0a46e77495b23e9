"""Gathers launched on the engine's thread inside ``send_part`` (prefill/gathers.py's
module docstring), over the loopback transport, stepped by hand.

A staged RequestKV with a pre-grant, for a request whose pages are all registered and whose
engine has given no part yet, makes the prefill worker set staging space aside for that
decode rank's whole share and prepare its gather. ``send_part`` of the whole request then
launches those gathers on the caller's thread, and the worker finds part 0 gathered. On CUDA
that is the default; these tests turn it on for CPU pools (``Cluster(engine_gathers=True)``),
where the gather runs in the call. What they pin: every request lands bit-exact whichever
thread gathered it, every interleaving with a Withdraw, an abort or a resize gives the space
back, and nothing is left behind.
"""

from __future__ import annotations

import pytest

from pd_testbed.transfer_harness import Cluster, Request
from pd_transfer.kv.staging import PreparedMove
from pd_transfer.prefill import PrefillSender
from pd_transfer.protocol.lifecycle import FailureReason, State

pytestmark = pytest.mark.timeout(60)

SUCCEEDED = {State.SUCCEEDED}


def _gathers(sender: PrefillSender, thread: str) -> int:
    return int(sender.metrics.gathers.labels(thread)._value.get())


def _armed(cluster: Cluster) -> list[int]:
    return [s.debug_counts()["armed_gathers"] for s in cluster.senders]


def _finish(cluster: Cluster, request: Request) -> None:
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.states(request.room) == SUCCEEDED, cluster.statuses(request.room)
    assert cluster.verified(request)
    cluster.retire(request)


# (prefill TP, decode TP) with 2 KV heads -> decode ranks each prefill rank writes to: 1 → 2
# splits the prefill rank's 2 heads over two decode ranks; 2 → 1 has two writers into one.
TOPOLOGIES = [((1, 1), [1]), ((1, 2), [2]), ((2, 1), [1, 1])]


@pytest.mark.parametrize(("tp", "streams"), TOPOLOGIES, ids=["1to1", "1to2", "2to1"])
def test_a_pre_granted_request_is_gathered_in_send_part_and_lands_bit_exact(
    tp: tuple[int, int], streams: list[int],
) -> None:
    cluster = Cluster(mode="staged", prefill_tp=tp[0], decode_tp=tp[1], engine_gathers=True)
    request = cluster.new_request(num_tokens=8)
    cluster.start(request, send=False)
    cluster.run(lambda: _armed(cluster) == streams)
    assert [s.staging.live_regions for s in cluster.senders] == streams  # set aside
    for sender in cluster.senders:
        sender.send_part(request.room, last=True)
    # Gathered in the call, before any worker step.
    assert [_gathers(s, "engine") for s in cluster.senders] == streams
    assert _armed(cluster) == [0] * len(streams)
    _finish(cluster, request)
    assert [_gathers(s, "worker") for s in cluster.senders] == [0] * len(streams)
    assert [(s.pregrants_taken, s.alloc_requests_sent) for s in cluster.senders] == [
        (n, 0) for n in streams]
    # ... and posted with the WRITEs the worker prepared with the gathers.
    assert [s.prepared_writes_posted for s in cluster.senders] == streams
    cluster.assert_clean()


def test_a_part_given_before_the_request_kv_is_gathered_by_the_worker() -> None:
    cluster = Cluster(mode="staged", engine_gathers=True)
    sender = cluster.senders[0]
    request = cluster.new_request(num_tokens=8)
    cluster.start(request)  # send_part before decode's RequestKV: nothing set aside yet
    _finish(cluster, request)
    assert (_gathers(sender, "engine"), _gathers(sender, "worker")) == (0, 1)
    cluster.assert_clean()


class _Flag:
    """A ready event the test fires (``ReadyEvent``: only ``query``)."""

    def __init__(self) -> None:
        self.fired = False

    def query(self) -> bool:
        return self.fired


def test_a_part_whose_ready_event_has_not_fired_is_left_to_the_worker() -> None:
    """On CPU the gather would run inside ``send_part``: with an event not fired yet the
    KV may not be written, so the worker gathers once the event fires."""
    cluster = Cluster(mode="staged", engine_gathers=True)
    sender = cluster.senders[0]
    request = cluster.new_request(num_tokens=8)
    cluster.start(request, send=False)
    cluster.run(lambda: _armed(cluster) == [1])
    ready = _Flag()
    sender.send_part(request.room, last=True, ready_event=ready)
    for _ in range(5):
        cluster.step()
    assert _gathers(sender, "worker") == 0 and cluster.states(request.room) == {
        State.TRANSFERRING}
    ready.fired = True
    _finish(cluster, request)
    assert (_gathers(sender, "engine"), _gathers(sender, "worker")) == (0, 1)
    cluster.assert_clean()


def test_parts_smaller_than_the_request_give_the_set_aside_space_back() -> None:
    """1 → 2, two parts (pages halves): part 0 of each stream takes the first half of its
    pre-grant, part 1 asks; the worker gathers all four."""
    cluster = Cluster(mode="staged", decode_tp=2, engine_gathers=True)
    sender = cluster.senders[0]
    request = cluster.new_request(num_tokens=16)
    cluster.start(request, send=False)
    cluster.run(lambda: _armed(cluster) == [2])
    half = len(request.src_pages) // 2
    sender.send_part(request.room, pages=range(0, half))
    assert _armed(cluster) == [2]  # only a whole request's part takes them
    cluster.step()
    assert _armed(cluster) == [0] and sender.debug_counts()["prepared_writes"] == 0
    sender.send_part(request.room, pages=range(half, len(request.src_pages)), last=True)
    _finish(cluster, request)
    assert (_gathers(sender, "engine"), _gathers(sender, "worker")) == (0, 4)
    assert (sender.pregrants_taken, sender.alloc_requests_sent) == (2, 2)
    assert sender.prepared_writes_posted == 0  # made for whole shares: discarded
    cluster.assert_clean()


def test_a_withdraw_before_the_part_takes_back_the_set_aside_space() -> None:
    """Decode resizes its ring while prefill computes: the Withdraw frees the space set aside
    for that decode rank, and part 0 is gathered by the worker and asks in the new ring."""
    cluster = Cluster(mode="staged", ring_bytes=8192, engine_gathers=True)
    receiver, sender = cluster.receivers[0], cluster.senders[0]
    request = cluster.new_request(num_tokens=8)
    cluster.start(request, send=False)
    cluster.run(lambda: _armed(cluster) == [1])
    future = receiver.resize_bytes(16384, deadline_s=30.0)
    cluster.run(future.done)
    assert future.result().failed_requests == 0
    assert (_armed(cluster), sender.staging.live_regions) == ([0], 0)
    sender.send_part(request.room, last=True)
    _finish(cluster, request)
    assert (_gathers(sender, "engine"), _gathers(sender, "worker")) == (0, 1)
    assert (sender.pregrants_taken, sender.alloc_requests_sent) == (0, 1)
    cluster.assert_clean()


def test_a_withdraw_between_the_engines_gathers_and_its_part_makes_part_0_ask() -> None:
    """The interleaving a worker thread allows and a stepped harness cannot order through
    the public API: the engine's thread has launched the gather (``send_part``'s first half),
    then the worker handles decode's Withdraw, then the part. Part 0 keeps its gathered
    space and asks for a grant in the resized ring."""
    cluster = Cluster(mode="staged", ring_bytes=8192, engine_gathers=True)
    receiver, sender = cluster.receivers[0], cluster.senders[0]
    request = cluster.new_request(num_tokens=8)
    cluster.start(request, send=False)
    cluster.run(lambda: _armed(cluster) == [1])
    early = sender._engine_gathers.launch(request.room, None, None, None)
    assert list(early) == [receiver.transport.agent_name]
    future = receiver.resize_bytes(16384, deadline_s=30.0)
    cluster.run(future.done)
    assert future.result().failed_requests == 0
    assert sender.staging.live_regions == 1  # the gathered share, held for its part
    given = cluster.clock()
    sender.submit(lambda: sender._add_part(request.room, None, None, True, None, given, early))
    _finish(cluster, request)
    assert (_gathers(sender, "engine"), _gathers(sender, "worker")) == (1, 0)
    assert (sender.pregrants_taken, sender.alloc_requests_sent) == (0, 1)
    assert sender.prepared_writes_posted == 0  # prepared for the withdrawn region
    cluster.assert_clean()


def test_a_request_that_fails_after_the_engines_gathers_frees_their_space() -> None:
    """The engine's thread gathered, then the request ended before the worker saw the part
    (an abort): the part is refused (the room is gone) and nothing stays allocated."""
    cluster = Cluster(mode="staged", decode_tp=2, engine_gathers=True)
    sender = cluster.senders[0]
    request = cluster.new_request(num_tokens=8)
    cluster.start(request, send=False)
    cluster.run(lambda: _armed(cluster) == [2])
    early = sender._engine_gathers.launch(request.room, None, None, None)
    assert len(early) == 2 and sender.staging.live_regions == 2
    sender.abort(request.room)
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.reasons(request.room) == {FailureReason.ABORTED,
                                             FailureReason.ABORTED_BY_PEER}
    given = cluster.clock()
    part = sender.submit(lambda: sender._add_part(request.room, None, None, True, None, given,
                                                  early))
    cluster.step()
    with pytest.raises(KeyError, match="is not live"):
        part.result(0)
    assert sender.staging.live_regions == 0
    cluster.retire(request)
    cluster.assert_clean()


def test_an_own_buffer_resize_takes_back_the_set_aside_space_at_once() -> None:
    cluster = Cluster(mode="staged", engine_gathers=True)
    sender = cluster.senders[0]
    request = cluster.new_request(num_tokens=8)
    cluster.start(request, send=False)
    cluster.run(lambda: _armed(cluster) == [1])
    future = sender.resize_bytes(32 * 1024, deadline_s=30.0)
    rounds = cluster.run(future.done)
    assert rounds * cluster.tick_s < 1.0  # not the deadline: nothing waited for the part
    assert future.result().failed_requests == 0 and sender.staging_version == 2
    assert _armed(cluster) == [0]
    sender.send_part(request.room, last=True)
    _finish(cluster, request)
    assert (_gathers(sender, "engine"), _gathers(sender, "worker")) == (0, 1)
    assert sender.pregrants_taken == 1  # decode's pre-grant is untouched by prefill's resize
    cluster.assert_clean()


def test_a_part_the_worker_gathers_after_a_failed_engine_launch_posts_its_own_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The launch on the engine's thread raised (a fault the harness cannot produce through
    the engine: the launch is made to fail), so the worker gathers the part into new space.
    The WRITE prepared with the set-aside space must not carry it: that space holds no KV."""
    cluster = Cluster(mode="staged", engine_gathers=True)
    sender = cluster.senders[0]
    request = cluster.new_request(num_tokens=8)
    cluster.start(request, send=False)
    cluster.run(lambda: _armed(cluster) == [1])
    with monkeypatch.context() as patch:
        patch.setattr(PreparedMove, "launch", _fail_launch)
        sender.send_part(request.room, last=True)
    _finish(cluster, request)
    assert (_gathers(sender, "engine"), _gathers(sender, "worker")) == (0, 1)
    assert (sender.pregrants_taken, sender.prepared_writes_posted) == (1, 0)
    cluster.assert_clean()


def _fail_launch(move: PreparedMove, stream: object = None) -> int:
    raise RuntimeError("launch failed")
