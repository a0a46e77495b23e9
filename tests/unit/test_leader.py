"""The leader election's pure parts: its timing rules and the write fence before and after
a term (the Lease itself is exercised against a real API server in
tests/integration/test_leader_election.py)."""

from __future__ import annotations

import pytest

from pd_operator.errors import LeadershipLost
from pd_operator.kube import KubeClient
from pd_operator.leader import LeaderElector, LeaseConfig


@pytest.mark.parametrize(("lease", "deadline", "retry"), [(10, 10, 2), (10, 7, 7), (10, 7, 0)])
def test_timing_that_lets_two_leaders_overlap_is_refused(lease: float, deadline: float,
                                                         retry: float) -> None:
    with pytest.raises(ValueError, match=r"0 < retry .* < renew deadline .* < lease duration"):
        LeaseConfig("l", "ns", "me", lease_s=lease, renew_deadline_s=deadline, retry_s=retry)


def test_the_fence_refuses_writes_before_the_first_term_and_after_the_deadline() -> None:
    now = [100.0]
    elector = LeaderElector(KubeClient.__new__(KubeClient), LeaseConfig("l", "ns", "me"),
                            clock=lambda: now[0])
    with pytest.raises(LeadershipLost, match="does not hold the leader Lease ns/l"):
        elector.guard()
    # A term as `_campaign` opens it: a renewal that started at t=100 s.
    elector._leading, elector._fence = True, 100.0 + elector.config.renew_deadline_s
    now[0] = 106.9
    elector.guard()
    now[0] = 107.0  # 7 s after the renewal began, with no newer one: no more writes
    assert not elector.is_leading()
    with pytest.raises(LeadershipLost):
        elector.guard()
