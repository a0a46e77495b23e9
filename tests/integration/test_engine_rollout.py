"""Engine rollouts (spec.rollout, pd_operator.engine_rollout) against a real control plane:
the operator creates and deletes each engine instance's pod itself and keeps each revision's
template in a ControllerRevision, which a rollback reads; it runs in-process, or as two
leader-elected processes where its leader is killed.

There is no kubelet. `pd_testbed.ready_kubelet.Kubelet` stands in for one: it marks a pod
Running and Ready a moment after it appears (or, for a revision told to crash, reports its
engine container restarting in CrashLoopBackOff). Pods have no node, so the API server
removes a deleted pod at once: the drain itself is tested end to end with real engines
(tests/e2e/test_vllm_cluster.py). While the rollout runs, the stand-in also samples each
role's Ready pods, so a pod deleted before its replacement served shows as a dip.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from kopf.testing import KopfRunner

from pd_devcluster import ControlPlaneHandle
from pd_operator.build.names import LABEL_TEMPLATE_HASH
from pd_operator.kube import CONTROLLER_REVISIONS, EVENTS, STATEFULSETS
from pd_testbed.cluster import NAME, Cluster, example_body
from pd_testbed.operator_process import OperatorReplicas
from pd_testbed.polling import wait_for
from pd_testbed.ready_kubelet import Kubelet

pytestmark = [pytest.mark.apiserver, pytest.mark.timeout(120)]

Obj = dict[str, Any]
PREFILL, DECODE = 1, 2


def rollout(cluster: Cluster) -> Obj:
    return dict(cluster.status().get("rollout") or {})


def revisions(cluster: Cluster, role: str) -> list[str]:
    return sorted(p["metadata"]["labels"][LABEL_TEMPLATE_HASH] for p in cluster.pods(role))


def events(cluster: Cluster) -> list[str]:
    """The reasons of the PDDeployment's Events, oldest first."""
    listed = [e for e in cluster.kube.list_objects(EVENTS, cluster.ns, "")
              if e["involvedObject"]["name"] == NAME and e["involvedObject"]["kind"]
              == "PDDeployment"]
    return [str(e["reason"]) for e in sorted(
        listed, key=lambda e: (e["metadata"]["creationTimestamp"], e["metadata"]["name"]))]


def recorded(cluster: Cluster, role: str) -> list[str]:
    """The revisions whose template the role's ControllerRevisions keep."""
    return sorted(r["metadata"]["labels"][LABEL_TEMPLATE_HASH] for r in cluster.kube.list_objects(
        CONTROLLER_REVISIONS, cluster.ns,
        f"pd.serving.dev/deployment={NAME},pd.serving.dev/role={role}"))


def settled(cluster: Cluster, kubelet: Kubelet) -> dict[str, str]:
    """Create the example (1 prefill, 2 decode), wait until every pod serves and the
    rollout reads Idle; the revision per role."""
    body = example_body(cluster.ns)
    body["spec"]["prefill"]["replicas"] = PREFILL
    body["spec"]["decode"]["replicas"] = DECODE
    body["spec"]["router"] = {"enabled": False}
    cluster.create(body)
    wait_for("Ready=True", lambda: cluster.condition("Ready").get("status") == "True", 60)
    status = wait_for("the rollout status to read Idle", lambda: rollout(cluster)
                      .get("phase") == "Idle" and cluster.status())
    kubelet.reset()
    return {role: status[role]["revision"] for role in ("prefill", "decode")}


def test_an_argument_change_surges_each_role_and_never_dips(
        operator: KopfRunner, cluster: Cluster, kubelet: Kubelet) -> None:
    """Guards against a rollout that deletes an old instance before its replacement serves,
    that starts a new engine twice (a surge pod and then a replacement), or that leaves surge
    instances or old revisions behind."""
    old = settled(cluster, kubelet)
    old_uids = {p["metadata"]["uid"] for p in cluster.pods()}
    before = set(kubelet.uids)
    assert cluster.kube.list_objects(STATEFULSETS, cluster.ns,
                                     f"pd.serving.dev/deployment={NAME}") == []
    cluster.patch_spec({"engine": {"env": [{"name": "ROLLOUT_TEST", "value": "1"}]}})
    done = wait_for("the rollout to complete", lambda: rollout(cluster).get("phase")
                    == "Complete" and rollout(cluster), 90)
    status = cluster.status()
    new = {role: status[role]["revision"] for role in ("prefill", "decode")}
    assert new["prefill"] != old["prefill"] and new["decode"] != old["decode"]
    assert revisions(cluster, "prefill") == [new["prefill"]] * PREFILL
    assert revisions(cluster, "decode") == [new["decode"]] * DECODE
    assert not {p["metadata"]["uid"] for p in cluster.pods()} & old_uids
    # each new engine started exactly once: one pod per instance, named after its revision
    assert len(kubelet.uids - before) == PREFILL + DECODE
    for role, count in (("prefill", PREFILL), ("decode", DECODE)):
        assert cluster.instances(role) == [f"{NAME}-{role}-{new[role][:4]}-{i}"
                                           for i in range(count)]
        assert recorded(cluster, role) == sorted([old[role], new[role]])
    # never fewer Ready pods than desired; one surge pod per role at most
    assert dict(kubelet.least_ready) == {"prefill": PREFILL, "decode": DECODE}
    assert dict(kubelet.most_pods) == {"prefill": PREFILL + 1, "decode": DECODE + 1}
    assert done["stableRevisions"] == new and done["summary"] == "Complete"
    assert done["keyChanged"] is False and done["failedRevisions"] == {}
    assert [(r["role"], r["toRevision"], r["desired"], r["surge"]) for r in done["roles"]] == [
        ("prefill", new["prefill"], PREFILL, 0), ("decode", new["decode"], DECODE, 0)]
    assert cluster.condition("Progressing")["reason"] == "ReconcileComplete"
    seen = wait_for("the rollout's Events", lambda: (e := events(cluster)) and
                    "RolloutComplete" in e and e)
    assert seen.count("RolloutStarted") == 1
    assert seen.count("DrainingOldInstance") == PREFILL + DECODE
    assert cluster.children_match() == []


def test_a_revision_that_crashes_at_start_rolls_back_and_stays_refused(
        operator: KopfRunner, cluster: Cluster, kubelet: Kubelet) -> None:
    """Guards against a failed revision replacing serving instances, a rollback that starts
    an engine of the good revision again while its instances still serve, or a retry
    loop."""
    old = settled(cluster, kubelet)
    old_uids = sorted(p["metadata"]["uid"] for p in cluster.pods())
    kubelet.only = set(old.values())  # any other revision's engine exits at start
    cluster.patch_spec({"engine": {"args": ["--exits-at-start"]}})
    # The bad revision may start, crash and be rolled back between two looks at the status:
    # it is known from the pods the kubelet crashed.
    back = wait_for("the rollout to roll back", lambda: rollout(cluster).get("phase")
                    == "RolledBack" and rollout(cluster), 90)
    assert back["reason"] == "CrashLoop"
    assert "restarted 3 times" in back["message"]
    assert "rolled back to the last good revision" in back["message"]
    failed = back["failedRevisions"]
    assert failed.keys() == {"prefill", "decode"}
    assert set(failed.values()).isdisjoint(old.values())
    assert kubelet.crashed and all(kubelet.crashed[role] == {failed[role]}
                                   for role in kubelet.crashed), (kubelet.crashed, failed)
    assert back["stableRevisions"] == old
    # the old instances served throughout, and none was started again
    assert sorted(p["metadata"]["uid"] for p in cluster.pods()) == old_uids
    assert dict(kubelet.least_ready) == {"prefill": PREFILL, "decode": DECODE}
    for role in ("prefill", "decode"):
        assert recorded(cluster, role) == sorted([old[role], failed[role]])
    progressing = cluster.condition("Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False", "RolledBack")
    seen = wait_for("the Warning Events", lambda: (e := events(cluster)) and
                    "RolledBack" in e and e)
    assert "RolloutFailed" in seen
    # it stays refused: no pod of the bad revision comes back
    time.sleep(3)
    assert sorted(p["metadata"]["uid"] for p in cluster.pods()) == old_uids
    assert rollout(cluster)["phase"] == "RolledBack"
    # a fixed spec rolls forward
    kubelet.only = None
    kubelet.reset()
    cluster.patch_spec({"engine": {"args": ["--fixed"]}})
    wait_for("the fixed spec to roll out", lambda: rollout(cluster).get("phase") == "Complete",
             90)
    assert rollout(cluster)["failedRevisions"] == {}
    assert dict(kubelet.least_ready) == {"prefill": PREFILL, "decode": DECODE}


def step(cluster: Cluster) -> tuple[Any, ...]:
    """Where the rollout stands: its phase and, per role, the surge asked for and each
    revision's pods, Ready and draining counts. A new value is a step taken."""
    status = rollout(cluster)
    return (status.get("phase"), tuple(
        (r["role"], r.get("surge", 0), tuple((v["revision"], v.get("pods", 0), v.get("ready", 0),
                                              v.get("draining", 0)) for v in r["revisions"]))
        for r in status.get("roles", [])))


@pytest.mark.timeout(300)
def test_the_leader_killed_at_every_step_carries_on_without_a_step_twice(
        control_plane: ControlPlaneHandle, namespace: str, tmp_path: Path,
        cluster: Cluster, kubelet: Kubelet) -> None:
    """Guards against a rollout that a new leader forgets, restarts, or repeats (a pod
    deleted twice, an extra surge): two operator processes under leader election, and after
    every step the rollout takes the leader is SIGKILLed and replaced; the standby finishes
    each step from the API's state alone."""
    operators = OperatorReplicas(control_plane, namespace, tmp_path)
    try:
        old = settled(cluster, kubelet)
        before = set(kubelet.uids)
        cluster.patch_spec({"engine": {"env": [{"name": "ROLLOUT_TEST", "value": "2"}]}})
        started = wait_for("the rollout to start", lambda: rollout(cluster).get("phase")
                           == "Progressing" and rollout(cluster), 30)
        steps = [step(cluster)]
        while steps[-1][0] != "Complete":
            operators.kill_leader()
            seen = steps[-1]
            steps.append(wait_for(f"a step after {seen}", lambda: step(cluster),
                                  60, interval_s=0.05, until=seen.__ne__))
            assert len(steps) < 40, steps
        print(f"leaders killed: {len(steps) - 1}; steps: {steps}")
        time.sleep(2)  # an Event follows its status write: let the last ones land
        settled_events = events(cluster)
    finally:
        print(operators.stop())
    done = rollout(cluster)
    assert done["startedAt"] == started["startedAt"]  # one rollout, carried on
    assert done["stableRevisions"] != old
    status = cluster.status()
    assert revisions(cluster, "prefill") == [status["prefill"]["revision"]] * PREFILL
    assert revisions(cluster, "decode") == [status["decode"]["revision"]] * DECODE
    # new pods: one per instance, nothing twice
    assert len(kubelet.uids - before) == PREFILL + DECODE
    assert dict(kubelet.least_ready) == {"prefill": PREFILL, "decode": DECODE}
    assert dict(kubelet.most_pods) == {"prefill": PREFILL + 1, "decode": DECODE + 1}
    # A leader killed between a status write and its Event leaves that Event unsent (Events
    # are best effort, and the step that wrote Complete may be the killed leader's): never
    # more than one per old pod, one start, one end.
    assert settled_events.count("DrainingOldInstance") <= PREFILL + DECODE
    assert settled_events.count("RolloutStarted") <= 1
    assert settled_events.count("RolloutComplete") <= 1
    # The same end state as one uninterrupted run: every child and instance as the spec
    # builds it.
    assert cluster.children_match() == []
