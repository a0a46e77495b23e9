"""Staging rollouts end to end on this machine, with real engines under steady load
(docs/failure-modes.md #25): control plane + operator (two leader-elected processes) + fake
kubelet + reference engines (real processes, real NIXL over loopback) whose agents resize their
staging pools in place.

One deployment (2 prefill TP1 + 2 decode TP2 pods, `rollout_harness.LiveFleet`) serves the
tests, in order:
1. grow then shrink the decode pool → each rollout completes, every engine runs the new size,
   no request fails, no engine restarts, never more than maxUnavailable pods resizing;
2. SIGKILL the leading operator right after the first batch's spec write → the standby
   takes over and the rollout continues from there (no pod is sent back, none twice) and
   completes, no request fails;
3. a size that hurts the first resized pod (TEST-ONLY `SizeFault`: its engine drops Grants
   while that size is in force) → the rollout pauses and rolls back by itself, status and
   Events name the pod and why, and traffic recovers.

Then engine rollouts (docs/failure-modes.md #41-#43) on the same fleet and load, whose
client pairs only same-key pods that are Ready and not leaving, as a router does:
4. an engine argument the engine refuses → the new pods exit at start, the rollout rolls
   back by itself, no serving pod was deleted, no request failed;
5. decode 3 -> 2 while the youngest decode holds requests in flight (their prefills slow)
   → an idle one leaves, the Event names it and every decode's load, no request fails
   (docs/failure-modes.md #54);
6. (marked `long`) a page-size change (a new KV-compatibility key) on the staged path
   (prefill TP1, decode TP2) → both roles roll surge first, each old pod deleted only once
   a pair of the new key serves and drained by its preStop hook (its own counters: no
   transfer of it failed while it rolled), no request failed.
Budget: about 4 minutes on 2 cores (about 2 more with `long`).
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from pd_devcluster import ControlPlaneHandle
from pd_testbed.engine_rollout import drained, engine_pods, failed_transfers
from pd_testbed.polling import wait_for
from pd_testbed.rollout_harness import (
    GROUP,
    NAME,
    VERSION,
    LiveFleet,
    SizeFault,
    discover_engines,
    live_fleet,
)
from pd_transfer.reference.load import Engine, post_json

pytestmark = [pytest.mark.e2e, pytest.mark.nixl, pytest.mark.timeout(600)]

MAX_UNAVAILABLE = 1
START, GROWN, SHRUNK = (8, 8), (16, 8), (4, 8)
HURTING = (12, 8)
ANALYSIS_HURTING_S = 10


def pods(fleet: LiveFleet) -> list[str]:
    """The fleet's four engine instances, sorted by name."""
    return sorted(fleet.instances())


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
    assert sorted(pids) == pods(fleet)
    # The spec watcher (a 0.2 s poll) must have seen every pod's starting size before the
    # first resize: once, the first batch's write came before its first poll.
    wait_for("the spec watcher to see every pod's starting size", lambda: all(
        fleet.specs_seen.get(pod) == [START] for pod in pods(fleet)), 30)
    for size in (GROWN, SHRUNK):
        started = time.monotonic()
        fleet.resize(size)
        done = fleet.wait_phase("Complete", to=size[0], timeout_s=150)
        window = fleet.log.window(started, time.monotonic())
        print(f"rollout to {size}: {time.monotonic() - started:.1f} s, load {window}, "
              f"{fleet.without_pair_s(started, time.monotonic())} s without a pair")
        assert window["served"] > 0 and window["failed"] == 0, window
        assert fleet.in_force() == dict.fromkeys(pods(fleet), size)
        assert sorted(done["updatedPods"]) == pods(fleet)
        assert done["summary"] == f"{size[0]}MiB"
    assert fleet.pids() == pids, "a hot resize restarted an engine"
    assert fleet.max_resizing == MAX_UNAVAILABLE
    reasons = [e["reason"] for e in fleet.events_with("StagingRolloutComplete", 2)]
    assert reasons.count("StagingRolloutStarted") == 2
    assert reasons.count("StagingRolloutComplete") == 2
    # Every pod's spec went START → GROWN → SHRUNK, each size exactly once.
    assert fleet.specs_seen == {pod: [START, GROWN, SHRUNK] for pod in pods(fleet)}, \
        fleet.specs_seen


def test_the_leader_killed_mid_rollout_hands_it_to_the_standby_under_load(
        fleet: LiveFleet) -> None:
    """Guards against a takeover that restarts the rollout from scratch, sends an updated
    pod back, forgets it was rolling out (the operator keeps no state but the status), or
    fails a request: the leading operator is SIGKILLed right after the first batch's spec
    write, while the load runs, and the standby finishes the rollout."""
    fleet.wait_phase("Complete", to=SHRUNK[0], timeout_s=30)
    pids = fleet.pids()
    started = time.monotonic()
    fleet.resize(START)
    first = wait_for("the first batch's spec write", lambda: [
        pod for pod, seen in fleet.specs_seen.items() if seen[-1] == START], 30)
    # Its replacement starts only after the look below: starting one takes seconds, by
    # which time the standby may have taken over and written the next batch.
    killed = fleet.operator.kill_leader(replace=False)
    assert first == fleet.instances("decode")[:1], first  # growing: decode rings first
    time.sleep(1.5)  # the batch resizes while no operator leads (the Lease has 4 s to run)
    assert sum(seen[-1] == START for seen in fleet.specs_seen.values()) == 1, (
        "not mid-way", fleet.specs_seen)
    fleet.operator.add_replica()  # the replacement joins as the standby's standby
    took_over = fleet.operator.leader(timeout_s=15)
    print(f"{took_over.name} took over from {killed.name} "
          f"{time.monotonic() - started:.1f} s after the resize")
    done = fleet.wait_phase("Complete", to=START[0], timeout_s=150)
    window = fleet.log.window(started, time.monotonic())
    print(f"rollout to {START} across a leader kill: {time.monotonic() - started:.1f} s, "
          f"load {window}")
    assert sorted(done["updatedPods"]) == pods(fleet)
    assert fleet.in_force() == dict.fromkeys(pods(fleet), START)
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
    bad = fleet.instances("decode")[0]  # growing: the first pod resized
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
        assert fleet.in_force() == dict.fromkeys(pods(fleet), START)
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


def _rollout(fleet: LiveFleet) -> dict[str, Any]:
    return dict((fleet.pdd().get("status") or {}).get("rollout") or {})


def _patch(fleet: LiveFleet, spec: dict[str, Any]) -> None:
    fleet.objects.patch_namespaced_custom_object(GROUP, VERSION, fleet.ns, "pddeployments",
                                                 NAME, {"spec": spec})


def test_a_revision_that_exits_at_start_rolls_back_without_touching_a_serving_pod(
        fleet: LiveFleet) -> None:
    """Guards against a bad revision replacing serving pods (docs/failure-modes.md #43)."""
    before = engine_pods(fleet.core, fleet.ns, NAME)
    args = fleet.pdd()["spec"]["engine"].get("args") or []
    started = time.monotonic()
    _patch(fleet, {"engine": {"args": [*args, "--no-such-engine-flag"]},
                   "rollout": {"maxRestarts": 1}})
    try:
        back = wait_for("the rollout to roll back by itself", lambda: _rollout(fleet), 180,
                        until=lambda r: r.get("phase") == "RolledBack")
        window = fleet.log.window(started, time.monotonic())
        print(f"rolled back in {time.monotonic() - started:.1f} s: {back['message']}; "
              f"load {window}")
        assert back["reason"] in ("CrashLoop", "StartFailed"), back
        assert set(back["failedRevisions"]) == {"prefill", "decode"}
        # Right after the size that hurt, decode-0's transfer gate may still be False: an
        # old pod that is not Ready is kept too, while no new pod serves.
        assert engine_pods(fleet.core, fleet.ns, NAME) == before
        assert window["served"] > 0 and window["failed"] == 0, window
    finally:  # the next test starts from the running revision either way
        _patch(fleet, {"engine": {"args": args}})
    wait_for("the spec back on the running revision", lambda: _rollout(fleet).get(
        "phase") == "Complete", 60)
    assert engine_pods(fleet.core, fleet.ns, NAME) == before


HELD = 8  # requests the busy decode holds: ahead of any idle one's share of the load
CONCURRENCY = 4  # the load's (the fleet fixture's)
HOLD_S = 3.0  # each held request's prefill is sent this long after its decode


def hold(decode: Engine, prefill: Engine, stop: threading.Event,
         answers: list[dict[str, Any]]) -> None:
    """Requests whose prefill is slow, back to back: the decode half posted, the prefill
    half `HOLD_S` later (the decode holds the request meanwhile, waiting for its KV)."""
    while not stop.is_set():
        room = f"held-{uuid.uuid4().hex[:12]}"
        with ThreadPoolExecutor(max_workers=1) as side:
            got = side.submit(post_json, decode.address, "/v1/decode", {
                "room": room, "num_tokens": 256, "prefill": [prefill.bootstrap],
                "timeout_seconds": 20}, 30)
            time.sleep(HOLD_S)
            sent = post_json(prefill.address, "/v1/prefill", {
                "room": room, "num_tokens": 256, "decode": [decode.bootstrap],
                "timeout_seconds": 20}, 30)
            answers += [got.result(), sent]


def test_a_decode_scale_down_under_load_keeps_the_one_holding_requests(
        fleet: LiveFleet) -> None:
    """Guards against a scale-down that removes the youngest (or highest) instance whatever
    it holds (docs/failure-modes.md #54): of three decodes the youngest holds requests in
    flight (decode requests whose prefill is slow), one of the two others leaves, named
    with its load in the Event, while the load runs; no request fails, held ones included."""
    _patch(fleet, {"decode": {"replicas": 3}})
    wait_for("a third decode reporting", lambda: len([
        a for a in fleet.agents() if a["spec"]["role"] == "decode"
        and ((a.get("status") or {}).get("endpoints") or {}).get("engine")]) == 3, 120)
    engines = wait_for("the third decode in the load's rotation",
                       discover_engines(fleet.core.api_client, fleet.ns, NAME), 60,
                       until=lambda e: len(e.decode) == 3)
    decodes = fleet.instances("decode")
    busy = decodes[-1]  # the youngest: what an age or ordinal rule would remove
    target = next(e for e in engines.decode if e.pod == busy)
    stop, answers = threading.Event(), []
    holders = [threading.Thread(target=hold, args=(target, engines.prefill[0], stop, answers),
                                daemon=True) for _ in range(HELD)]
    for holder in holders:
        holder.start()
    try:
        wait_for(f"{busy} reporting the requests it holds", lambda: next(
            (a.get("status") or {}).get("engineRequests") or 0 for a in fleet.agents()
            if a["metadata"]["name"] == busy), 30, until=lambda n: n > CONCURRENCY)
        started = time.monotonic()
        _patch(fleet, {"decode": {"replicas": 2}})
        wait_for("two decodes", lambda: len(fleet.instances("decode")) == 2, 60)
        left = next(d for d in decodes if d not in fleet.instances("decode"))
        wait_for(f"{left} drained and gone", lambda: left not in [
            p.metadata.name for p in fleet.core.list_namespaced_pod(fleet.ns).items], 90)
        ended = time.monotonic()
    finally:
        stop.set()
        for holder in holders:
            holder.join(60)
    (message,) = wait_for("the scale-down's DeletingInstance Event", lambda: [
        e["message"] for e in fleet.events() if e["reason"] == "DeletingInstance"
        and e["message"].startswith("decode 3 -> 2: ")], 10)
    # the requests in flight when the scale-down began, and those until the holders ended
    window = fleet.log.window(started - 5.0, time.monotonic())
    print(f"{message} ({ended - started:.1f} s); load {window}; "
          f"{len(answers)} held request halves")
    assert left != busy
    head = f"decode 3 -> 2: deleting instance {left} ("
    assert message.startswith(head) and ", the cheapest to lose; kept: " in message, message
    kept = dict(re.findall(r"(\S+) \((\d+) in flight", message.split("; kept: ")[1]))
    assert set(kept) == {d for d in decodes if d != left}, message
    assert int(kept[busy]) > CONCURRENCY, message
    assert int(message.removeprefix(head).split(" ")[0]) <= CONCURRENCY, message
    assert answers and all(a.get("state") == "Succeeded" for a in answers), [
        a for a in answers if a.get("state") != "Succeeded"][:3]
    assert window["served"] > 0 and window["failed"] == 0, window


@pytest.mark.long
def test_a_page_size_change_rolls_both_roles_surge_first_with_no_failed_request(
        fleet: LiveFleet) -> None:
    """Guards against a KV-compatibility change that fails requests or stops a pod with
    work in it (docs/failure-modes.md #41, #42).

    Marked `long` (`make test-long`): with `maxSurge: 2`, two waves of four engine starts
    beside the four serving engines and the load starved the serving pair on 2 cores (a
    2048-token transfer past its 10 s timeout; in CI a request past its 30 s deadline), and
    the analysis rightly failed the new revision. `maxSurge: 1` starts two engines at a
    time, in three waves."""
    old = engine_pods(fleet.core, fleet.ns, NAME)
    assert sorted(old) == pods(fleet)
    ips = {pod: fleet.core.read_namespaced_pod(pod, fleet.ns).status.pod_ip for pod in old}
    # The earlier tests failed transfers on purpose: the rollout must add none.
    failed_before = {pod: failed_transfers(f"{ip}:9400") for pod, ip in ips.items()}
    old_key = fleet.pdd()["status"]["decode"]["kvCompat"]
    seen: list[dict[str, Any]] = []
    started = time.monotonic()
    # maxSurge 1: one new pod per role at a time beside its old ones
    # (`tests/unit/operator/engine_rollout/test_engine_rollout_planner.py` steps it).
    _patch(fleet, {"prefill": {"pageSize": 32}, "decode": {"pageSize": 32},
                   "rollout": {"maxSurge": 1}})

    def rollout() -> dict[str, Any]:
        now = _rollout(fleet)
        if now.get("phase") in ("Progressing", "Canary"):
            seen.append(now)
        # A timeout shows the last rollout status and the load so far.
        return dict(now, load=fleet.log.window(started, time.monotonic()))

    done = wait_for("the rollout to complete", rollout, 480, interval_s=1.0,
                    until=lambda r: r.get("phase") in ("Complete", "RolledBack") and bool(seen))
    assert done["phase"] == "Complete", done
    window = fleet.log.window(started, time.monotonic())
    status = fleet.pdd()["status"]
    now = engine_pods(fleet.core, fleet.ns, NAME)
    print(f"page size rolled out in {time.monotonic() - started:.1f} s: load {window}")
    assert window["served"] > 0 and window["failed"] == 0, window
    # four new instances, each started once (one pod per instance), none of the old
    assert len(now) == 4 and not set(now) & set(old) and not set(now.values()) & set(
        old.values()), (old, now)
    assert status["prefill"]["kvCompat"] == status["decode"]["kvCompat"] != old_key
    assert any(r.get("keyChanged") for r in seen), seen[-1:]
    # Surge: each role had a new pod beside its 2 old ones, never more.
    counts = {(role["role"], sum(v.get("pods", 0) for v in role.get("revisions", [])))
              for r in seen for role in r.get("roles", [])}
    assert {role for role, pods in counts if pods == 3} == {"prefill", "decode"}, seen[-1:]
    assert max(pods for _, pods in counts) == 3, counts
    assert done["stableRevisions"] == {"prefill": status["prefill"]["revision"],
                                       "decode": status["decode"]["revision"]}
    for pod, uid in old.items():
        ended = drained(fleet.kubelet, fleet.ns, pod, uid)
        assert ended is not None, pod
        assert ended.failed == failed_before[pod], (pod, failed_before[pod], ended)
        assert ended.finished > 0, (pod, ended)
    # Every pod of the new key moves KV again.
    wait_for("TransferHealthy=True", lambda: fleet.condition("TransferHealthy").get(
        "status") == "True", 60)
