"""Staging rollouts end to end on this machine, with real engines under steady load
(docs/failure-modes.md #25): control plane + operator (its own process) + fake kubelet + reference
engines (real processes, real NIXL over loopback) whose agents resize their staging pools in
place.

One deployment (2 prefill TP1 + 2 decode TP2 pods, `rollout_harness.LiveFleet`) serves the
tests, in order:
1. grow then shrink the decode pool → each rollout completes, every engine runs the new size,
   no request fails, no engine restarts, never more than maxUnavailable pods resizing;
2. SIGKILL the operator right after the first batch's spec write, start a new one → the
   rollout continues from there (no pod is sent back, none twice) and completes, no request
   fails;
3. a size that hurts the first resized pod (TEST-ONLY `SizeFault`: its engine drops Grants
   while that size is in force) → the rollout pauses and rolls back by itself, status and
   Events name the pod and why, and traffic recovers.
Budget: about 4 minutes on 2 cores.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client as k8s

from pd_devcluster import ControlPlaneHandle
from pd_testbed.polling import wait_for
from pd_testbed.rollout_harness import NAME, LiveFleet, SizeFault, live_fleet

pytestmark = [pytest.mark.e2e, pytest.mark.nixl, pytest.mark.timeout(480)]

MAX_UNAVAILABLE = 1
START, GROWN, SHRUNK = (8, 8), (16, 8), (4, 8)
HURTING = (12, 8)
ANALYSIS_HURTING_S = 10
PODS = sorted(f"{NAME}-{role}-{i}" for role in ("prefill", "decode") for i in range(2))


@pytest.fixture(scope="module")
def fleet(control_plane: ControlPlaneHandle, kube_client: k8s.ApiClient,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveFleet]:
    with live_fleet(control_plane, kube_client, Path(tmp_path_factory.mktemp("rollout")),
                    analysis_s=2, max_unavailable=MAX_UNAVAILABLE, rate=6.0, tokens=2048,
                    concurrency=4) as live:
        yield live


def test_grow_then_shrink_under_load_without_failures_or_restarts(fleet: LiveFleet) -> None:
    """Guards against a resize that drops in-flight requests or restarts the engine."""
    fleet.wait_phase("Idle", to=START[0], timeout_s=30)
    pids = fleet.pids()
    assert sorted(pids) == PODS
    # The spec watcher (a 0.2 s poll) must have seen every pod's starting size before the
    # first resize: once, the first batch's write came before its first poll.
    wait_for("the spec watcher to see every pod's starting size", lambda: all(
        fleet.specs_seen.get(pod) == [START] for pod in PODS), 30)
    for size in (GROWN, SHRUNK):
        started = time.monotonic()
        fleet.resize(size)
        done = fleet.wait_phase("Complete", to=size[0], timeout_s=150)
        window = fleet.log.window(started, time.monotonic())
        print(f"rollout to {size}: {time.monotonic() - started:.1f} s, load {window}")
        assert window["served"] > 0 and window["failed"] == 0, window
        assert fleet.in_force() == dict.fromkeys(PODS, size)
        assert sorted(done["updatedPods"]) == PODS
        assert done["summary"] == f"{size[0]}MiB"
    assert fleet.pids() == pids, "a hot resize restarted an engine"
    assert fleet.max_resizing == MAX_UNAVAILABLE
    reasons = [e["reason"] for e in fleet.events_with("StagingRolloutComplete", 2)]
    assert reasons.count("StagingRolloutStarted") == 2
    assert reasons.count("StagingRolloutComplete") == 2
    # Every pod's spec went START → GROWN → SHRUNK, each size exactly once.
    assert fleet.specs_seen == {pod: [START, GROWN, SHRUNK] for pod in PODS}, fleet.specs_seen


def test_operator_killed_mid_rollout_continues_after_restart(fleet: LiveFleet) -> None:
    """Guards against a restarted operator that restarts the rollout from scratch, sends an
    updated pod back, or forgets it was rolling out (it keeps no state but the status)."""
    fleet.wait_phase("Complete", to=SHRUNK[0], timeout_s=30)
    pids = fleet.pids()
    started = time.monotonic()
    fleet.resize(START)
    first = wait_for("the first batch's spec write", lambda: [
        pod for pod, seen in fleet.specs_seen.items() if seen[-1] == START], 30)
    fleet.operator.kill()
    assert first == [f"{NAME}-decode-0"], first  # growing: decode rings first
    time.sleep(3)  # the batch resizes while no operator runs
    assert sum(seen[-1] == START for seen in fleet.specs_seen.values()) == 1, "not mid-way"
    fleet.operator.start()
    done = fleet.wait_phase("Complete", to=START[0], timeout_s=150)
    window = fleet.log.window(started, time.monotonic())
    print(f"rollout to {START} across an operator kill: {time.monotonic() - started:.1f} s, "
          f"load {window}")
    assert sorted(done["updatedPods"]) == PODS
    assert fleet.in_force() == dict.fromkeys(PODS, START)
    for pod, seen in fleet.specs_seen.items():
        assert seen[-2:] == [SHRUNK, START] and seen.count(START) == 2, (pod, seen)
    assert window["failed"] == 0, window
    assert fleet.pids() == pids
    assert fleet.max_resizing == MAX_UNAVAILABLE
    reasons = [e["reason"] for e in fleet.events_with("StagingRolloutComplete", 3)]
    assert reasons.count("StagingRolloutStarted") == 3  # the new operator did not start over
    assert reasons.count("StagingRolloutComplete") == 3


def test_a_size_that_hurts_rolls_back_and_traffic_recovers(fleet: LiveFleet) -> None:
    """Guards against a rollout that keeps going (or stops without undoing) while the pods
    it already resized fail their transfers."""
    fleet.wait_phase("Complete", to=START[0], timeout_s=30)
    pids = fleet.pids()
    bad = f"{NAME}-decode-0"  # growing: the first pod resized
    fault = SizeFault(fleet, bad, HURTING)
    fault.start()
    try:
        # Long enough for the bad pod's failures to reach its report (first failures after
        # ~grantSeconds, then a report at once on the health flip) within its analysis.
        fleet.resize(HURTING, analysis_s=ANALYSIS_HURTING_S)
        back = fleet.wait_phase("RolledBack", timeout_s=150)
        recovered_from = time.monotonic()
        print(f"rolled back: {back}")
        assert fault.switched_on == 1
        assert bad in back["message"], back["message"]
        assert "rolled back to decodePoolMiB=8" in back["message"]
        assert back["summary"] == f"{START[0]}MiB RolledBack"
        assert fleet.in_force() == dict.fromkeys(PODS, START)
        assert fleet.max_resizing == MAX_UNAVAILABLE
        assert fleet.pids() == pids
        warnings = {e["reason"]: e["message"] for e in fleet.events_with("StagingRolledBack")
                    if e["type"] == "Warning"}
        assert bad in warnings["StagingRollbackStarted"]
        assert "rolled back" in warnings["StagingRolledBack"]
        # The others never took the size that hurt: the rollout stopped at the first batch.
        assert all(HURTING not in seen for pod, seen in fleet.specs_seen.items() if pod != bad)
        window = wait_for("traffic served again without failures",
                          lambda: fleet.log.window(recovered_from + 2, time.monotonic()), 60,
                          until=lambda w: w["served"] >= 10 and w["failed"] == 0)
        print(f"after the rollback: {window}")
    finally:
        fault.done.set()
        fault.join(10)
