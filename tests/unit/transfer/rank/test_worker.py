"""The worker loop's sleeping: an engine command wakes it at once, and an endpoint caps its
sleep while its requests move data (CUDA pools by default; set explicitly here on CPU).

Unit tests over the loopback transport: no NIXL, no GPU.
"""

from __future__ import annotations

import ctypes
import sys
import time

import pytest

from pd_testbed.transfer_harness import Cluster
from pd_transfer.endpoint import CUDA_POLL, PollIntervals
from pd_transfer.protocol.lifecycle import State
from pd_transfer.rank.worker import Worker

pytestmark = pytest.mark.timeout(60)
PR_GET_TIMERSLACK = 30  # <linux/prctl.h>


def test_a_command_does_not_wait_for_the_idle_sleep() -> None:
    """Before the wake-up, a send_part issued while the worker slept waited out the sleep
    (up to max_idle_sleep_s): at 1 ms that was most of a small transfer's latency."""
    cluster = Cluster()
    sender = cluster.senders[0]
    worker = Worker(sender, "test-wakeup", max_idle_sleep_s=30.0).start()
    try:
        # Idle back-off doubles from 50 µs: after 1.8 s the worker is inside a sleep of
        # ~1.6 s that ends ~1.5 s later, so only the wake-up can answer within 0.5 s.
        time.sleep(1.8)
        future = sender.submit(lambda: "done")
        assert future.result(timeout=0.5) == "done"
    finally:
        worker.stop(close=False)
    assert not sender.wakeup.is_set() or sender.wakeup.wait(0)  # consumed or harmless


def test_a_worker_whose_thread_setup_fails_still_serves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``thread_started`` (on CUDA: binding the thread to the staging stream) raising must
    not end the loop silently: every request would hang instead of failing. A stand-in
    raises, since a real device error cannot be produced here."""
    cluster = Cluster()
    sender = cluster.senders[0]

    def broken() -> None:
        raise RuntimeError("CUDA error: no device")

    monkeypatch.setattr(sender, "thread_started", broken)
    worker = Worker(sender, "test-setup-fails").start()
    try:
        assert sender.submit(lambda: "served").result(timeout=5.0) == "served"
        assert worker.loop_errors == 1
    finally:
        worker.stop(close=False)


def test_submit_sets_the_wakeup_event() -> None:
    cluster = Cluster()
    sender = cluster.senders[0]
    sender.wakeup.clear()
    sender.submit(lambda: None)
    assert sender.wakeup.is_set()


@pytest.mark.parametrize("pregrant", [False, True], ids=["asked", "pre-granted"])
def test_poll_interval_follows_what_the_requests_are_doing(pregrant: bool) -> None:
    """No request: no cap (the idle back-off). A request waiting for its peer: waiting_s. A
    part in flight on this side: moving_s (decode: from the pre-grant on, if it gave one,
    since the part's WRITE may land at any moment). Done: no cap again. A CPU pool has no
    caps by default, a CUDA pool CUDA_POLL."""
    intervals = PollIntervals(moving_s=1e-5, waiting_s=1e-4)
    cluster = Cluster(mode="staged", pregrant_share=0.5 if pregrant else 0.0)
    assert all(e.poll_intervals is None for e in cluster.endpoints)  # CPU default
    assert CUDA_POLL.moving_s < CUDA_POLL.waiting_s <= 1e-3
    sender, receiver = cluster.senders[0], cluster.receivers[0]
    for endpoint in cluster.endpoints:
        endpoint.poll_intervals = intervals
    assert sender.poll_interval_s() is None and receiver.poll_interval_s() is None
    request = cluster.new_request(num_tokens=8)
    cluster.start(request, send=False)
    cluster.step()
    cluster.step()
    assert receiver.poll(request.room).state is State.TRANSFERRING  # type: ignore[union-attr]
    assert sender.poll_interval_s() == intervals.waiting_s  # no part given yet
    assert receiver.poll_interval_s() == (intervals.moving_s if pregrant  # a WRITE may land
                                          else intervals.waiting_s)  # nothing named yet
    sender.send_part(request.room, last=True)
    sender.step()  # part made, AllocRequest sent, gather done
    assert sender.poll_interval_s() == intervals.moving_s
    receiver.step()  # asked: AllocRequest handled, region granted: the WRITE is due
    assert receiver.poll_interval_s() == intervals.moving_s
    cluster.run(lambda: cluster.finished(request.room))
    assert sender.poll_interval_s() is None and receiver.poll_interval_s() is None


def _own_timer_slack_ns() -> int:
    """The calling thread's timer slack."""
    return int(ctypes.CDLL(None).prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0))


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="Linux only: the kernel's per-thread timer slack")
def test_a_worker_given_a_timer_slack_sets_it_on_its_own_thread_only() -> None:
    """``timer_slack_ns`` (``pd-transfer bench transfer --timer-slack-ns``) is the kernel's
    slack for the worker thread's timed waits; the other threads keep theirs."""
    cluster = Cluster()
    sender = cluster.senders[0]
    mine = _own_timer_slack_ns()
    worker = Worker(sender, "test-slack", timer_slack_ns=1000).start()
    try:
        assert sender.submit(_own_timer_slack_ns).result(timeout=5.0) == 1000
        assert _own_timer_slack_ns() == mine
    finally:
        worker.stop(close=False)
    with pytest.raises(ValueError, match="must be positive"):
        Worker(sender, timer_slack_ns=0)
