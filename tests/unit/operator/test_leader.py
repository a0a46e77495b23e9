"""The leader election's campaign on an in-memory Lease: its timing rules, the write fence
before and after a term, terms that lapse, rounds that fail or hang, and the API server's
return (the Lease itself is exercised against a real API server in
tests/integration/test_leader_election.py)."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import pytest

from pd_operator.errors import APIUnreachable, ConflictError, LeadershipLost
from pd_operator.kube import KindRef, KubeClient
from pd_operator.leader import ROUND_LIMIT_S, LeaderElector, LeaseConfig


@pytest.mark.parametrize(("lease", "deadline", "retry"), [(10, 10, 2), (10, 7, 7), (10, 7, 0)])
def test_timing_that_lets_two_leaders_overlap_is_refused(lease: float, deadline: float,
                                                         retry: float) -> None:
    with pytest.raises(ValueError, match=r"0 < retry .* < renew deadline .* < lease duration"):
        LeaseConfig("l", "ns", "me", lease_s=lease, renew_deadline_s=deadline, retry_s=retry)


class _LeaseStore:
    """The Lease as an API server keeps it (resourceVersion checked on replace), in memory:
    the stand-in for faults a real server does not produce on cue, a renewal whose answer
    arrives after the renewal deadline and a round that fails with an error nobody
    anticipated. `slow_once` delays the next read; `fail_once` makes the next read raise."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.slow_once = 0.0
        self.fail_once: Exception | None = None
        self.unblocked = threading.Event()  # cleared: reads hang (up to 10 s)
        self.unblocked.set()

    def get(self, ref: KindRef, namespace: str, name: str) -> dict[str, Any] | None:
        delay, self.slow_once = self.slow_once, 0.0
        time.sleep(delay)
        self.unblocked.wait(10)
        failure, self.fail_once = self.fail_once, None
        if failure is not None:
            raise failure
        return copy.deepcopy(self.lease)

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        assert self.lease is None
        self.lease = {**obj, "metadata": {**obj["metadata"], "resourceVersion": "1"}}
        return copy.deepcopy(self.lease)

    def replace(self, obj: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
        assert self.lease is not None
        version = self.lease["metadata"]["resourceVersion"]
        if current["metadata"]["resourceVersion"] != version:
            raise ConflictError("the Lease changed")
        self.lease = {**obj, "metadata": {**obj["metadata"],
                                          "resourceVersion": str(int(version) + 1)}}
        return copy.deepcopy(self.lease)


FAST_LEASE = LeaseConfig("l", "ns", "me", lease_s=1.0, renew_deadline_s=0.6, retry_s=0.05)


async def _until(what: str, condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _campaign(store: _LeaseStore,
              scenario: Callable[[LeaderElector, list[str]], Awaitable[None]],
              clock: Callable[[], float] = time.monotonic) -> list[str]:
    """Run `scenario` while an elector campaigns on `store`; the terms' starts and stops,
    and the API server's returns."""
    terms: list[str] = []

    async def started() -> None:
        terms.append("started")

    async def stopped() -> None:
        terms.append("stopped")

    async def main() -> None:
        elector = LeaderElector(cast(KubeClient, store), FAST_LEASE, clock=clock)
        elector.start(on_started=started, on_stopped=stopped,
                      on_reconnected=lambda: terms.append("reconnected"))
        try:
            await _until("the first term", lambda: terms == ["started"])
            await scenario(elector, terms)
        finally:
            await elector.stop()

    asyncio.run(asyncio.wait_for(main(), timeout=20))
    return terms


def test_a_renewal_that_lands_after_the_deadline_ends_the_term_and_starts_a_new_one() -> None:
    """Guards against reconciles lost for good: past the deadline the fence refuses writes
    and the work queue drops those reconciles for the next term to redo. When the renewal
    that was under way then succeeds, that next term must really begin (stop, then start:
    every PDDeployment queued again), not carry on as if nothing was refused."""
    store = _LeaseStore()

    async def scenario(elector: LeaderElector, terms: list[str]) -> None:
        store.slow_once = 0.9  # the next round's read answers 0.9 s later: 0.6 s is the deadline
        await _until("the fence to close", lambda: not elector.is_leading())
        with pytest.raises(LeadershipLost):
            elector.guard()
        await _until("a new term", lambda: terms == ["started", "stopped", "started"])
        elector.guard()

    assert _campaign(store, scenario) == ["started", "stopped", "started", "stopped"]
    assert store.lease is not None and store.lease["spec"]["holderIdentity"] == ""  # released


def test_an_unexpected_error_in_one_round_does_not_end_the_campaign() -> None:
    """Guards against a leader that silently stops renewing: a round that raises something
    no one anticipated is logged, and the next round renews as usual."""
    store = _LeaseStore()

    async def scenario(elector: LeaderElector, terms: list[str]) -> None:
        store.fail_once = ValueError("a response no one expected")
        await _until("the failing round", lambda: store.fail_once is None)
        await asyncio.sleep(2 * FAST_LEASE.renew_deadline_s)
        assert elector.is_leading() and terms == ["started"]

    _campaign(store, scenario)


def test_the_api_server_answering_again_is_announced_even_within_a_term() -> None:
    """Guards against deletions missed during a short outage: one round that cannot reach
    the API server ends no term (the deadline has not passed), yet the loop must hear that
    the server is back, to audit its cache against what the watches may have missed."""
    store = _LeaseStore()

    async def scenario(elector: LeaderElector, terms: list[str]) -> None:
        store.fail_once = APIUnreachable("connection refused")
        await _until("the server's return", lambda: terms == ["started", "reconnected"])
        await asyncio.sleep(4 * FAST_LEASE.retry_s)
        assert elector.is_leading() and terms == ["started", "reconnected"]

    _campaign(store, scenario)


def test_a_campaign_stuck_in_a_round_fails_the_liveness_check() -> None:
    """Guards against a replica that neither renews nor steps down (a request that never
    returns): once a round has lasted longer than any round can, `stalled()` says so, and
    the liveness probe built on it has the kubelet restart the pod."""
    store = _LeaseStore()
    now = [0.0]

    async def scenario(elector: LeaderElector, terms: list[str]) -> None:
        assert elector.stalled() is None
        store.unblocked.clear()  # the next round's read hangs
        await asyncio.sleep(3 * FAST_LEASE.retry_s)
        now[0] += FAST_LEASE.renew_deadline_s
        assert elector.stalled() is None  # past the deadline, the round may still end it
        now[0] += FAST_LEASE.lease_s + 0.1
        assert "past its renewal deadline" in (elector.stalled() or "")
        now[0] += ROUND_LIMIT_S
        assert "made no progress" in (elector.stalled() or "")
        store.unblocked.set()
        await _until("a new term", lambda: terms == ["started", "stopped", "started"])
        assert elector.stalled() is None

    _campaign(store, scenario, clock=lambda: now[0])


def test_the_fence_refuses_writes_before_the_first_term_and_after_the_deadline() -> None:
    """Guards against a replica that writes without the Lease: nothing before its first term,
    and nothing from `renew_deadline_s` after the start of its last successful renewal."""
    store = _LeaseStore()
    now = [100.0]
    idle = LeaderElector(cast(KubeClient, store), FAST_LEASE, clock=lambda: now[0])
    with pytest.raises(LeadershipLost, match="does not hold the leader Lease ns/l"):
        idle.guard()

    async def scenario(elector: LeaderElector, terms: list[str]) -> None:
        store.unblocked.clear()  # no renewal from now on: the last began at t=100 s
        await asyncio.sleep(3 * FAST_LEASE.retry_s)
        now[0] = 100.0 + FAST_LEASE.renew_deadline_s - 0.01
        elector.guard()
        now[0] = 100.0 + FAST_LEASE.renew_deadline_s
        assert not elector.is_leading()
        with pytest.raises(LeadershipLost):
            elector.guard()
        store.unblocked.set()
        await _until("a new term", lambda: terms == ["started", "stopped", "started"])

    _campaign(store, scenario, clock=lambda: now[0])
