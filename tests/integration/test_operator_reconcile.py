"""The operator against a real control plane: children, truthful status, restoration,
scaling, revisions, restart mid-reconcile, invalid specs, garbage collection.

The operator runs in-process under `kopf.testing.KopfRunner`, serving only the test's
namespace, with a 1 s resync so that steady-state reconciles happen during the test. There
is no kubelet: the tests mark pods Ready by writing their status, as lws's envtest suite does.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import pytest
from kopf.testing import KopfRunner

from pd_devcluster import ControlPlaneHandle
from pd_operator.api import PDDeploymentStatus
from pd_operator.build.names import LABEL_TEMPLATE_HASH
from pd_operator.kube import KubeClient
from pd_operator.metrics import RECONCILES, api_writes_total
from pd_operator.reconcile import Reconciler
from pd_testbed.cluster import (
    CAPS,
    GROUP,
    NAME,
    PLURAL,
    VERSION,
    Cluster,
    example_body,
)
from pd_testbed.operator_runner import reconcile_successes, run_operator
from pd_testbed.polling import wait_for

pytestmark = [pytest.mark.apiserver, pytest.mark.timeout(90)]

Obj = dict[str, Any]


def test_children_pods_and_status_follow_the_pddeployment(operator: KopfRunner,
                                                           cluster: Cluster) -> None:
    """Children equal the builders' manifests, pods get exact names, status counts the
    current revision only and turns Ready when the pods are; a steady state writes nothing.
    Guards against a status computed from the spec instead of the pods (docs/failure-modes.md
    #20)."""
    cluster.create(example_body(cluster.ns))
    wait_for("every child to equal the builder's manifest", lambda: not cluster.children_match())
    names = wait_for("4 engine pods", lambda: sorted(p["metadata"]["name"] for p in cluster.pods())
                     if len(cluster.pods()) == 4 else None)
    revision = {p["metadata"]["labels"]["pd.serving.dev/role"]:
                p["metadata"]["labels"][LABEL_TEMPLATE_HASH] for p in cluster.pods()}
    # <name>-<role>-<4 characters of the revision>-<index>: one instance per pod
    assert names == [f"{NAME}-decode-{revision['decode'][:4]}-0",
                     f"{NAME}-decode-{revision['decode'][:4]}-1",
                     f"{NAME}-prefill-{revision['prefill'][:4]}-0",
                     f"{NAME}-prefill-{revision['prefill'][:4]}-1"]
    assert all(p["metadata"]["labels"]["pd.serving.dev/instance"] == p["metadata"]["name"]
               for p in cluster.pods())

    def counted() -> Obj | None:
        s = cluster.status()
        return s if s.get("prefill", {}).get("updatedReplicas") == 2 and \
            s.get("decode", {}).get("updatedReplicas") == 2 else None

    status = wait_for("status to count 2 updated pods per role", counted)
    assert status["observedGeneration"] == 1
    assert {c["type"] for c in status["conditions"]} == {
        "SpecValid", "Ready", "Progressing", "Degraded", "TransferHealthy",
        "TransportVerified", "StagingPoolReady"}
    assert status["prefill"]["replicas"] == 2 and status["prefill"]["readyReplicas"] == 0
    assert status["decode"]["summary"] == "0/2"
    assert status["decode"]["selector"] == \
        f"pd.serving.dev/deployment={NAME},pd.serving.dev/role=decode"
    assert cluster.condition("Ready")["status"] == "False"
    assert cluster.condition("Ready")["reason"] == "ReplicasNotReady"
    assert cluster.condition("TransferHealthy")["reason"] == "NoReports"
    assert status["stagingRollout"]["summary"] == "4096MiB"
    assert status["transfer"]["summary"] == "NoReports"
    assert status["prefill"]["revision"] == revision["prefill"]

    cluster.mark_all_ready()
    wait_for("Ready=True", lambda: cluster.condition("Ready").get("status") == "True")
    stored = cluster.status()
    assert stored["prefill"]["summary"] == "2/2" and stored["decode"]["summary"] == "2/2"
    assert stored["phase"] == "Ready"
    assert cluster.condition("Progressing")["reason"] == "ReconcileComplete"
    # Every field we write is declared in the CRD: the stored status round-trips exactly.
    assert PDDeploymentStatus.model_validate(stored).to_wire() == stored

    # Steady state: several resync reconciles, not one write request.
    writes, done = api_writes_total(), reconcile_successes()
    wait_for("3 more reconciles", lambda: reconcile_successes() >= done + 3, timeout_s=10)
    assert api_writes_total() - writes == 0
    assert cluster.status() == stored


def test_edited_deleted_and_scaled_children_are_restored(operator: KopfRunner,
                                                         cluster: Cluster) -> None:
    """Hand edits are undone, a deleted child comes back, and the scale subresource drives
    the decode instances. Guards against create-only reconciles (a deleted or hand-edited
    child must be restored)."""
    body = example_body(cluster.ns)
    cluster.create(body)
    wait_for("children", lambda: not cluster.children_match())
    cluster.core.patch_namespaced_service(f"{NAME}-decode", cluster.ns, [
        {"op": "replace", "path": "/spec/ports/0/port", "value": 1234}])
    cluster.core.delete_namespaced_config_map(f"{NAME}-transfer", cluster.ns)
    wait_for("the edited and deleted children to be restored",
             lambda: not cluster.children_match())

    cluster.objects.patch_namespaced_custom_object_scale(
        GROUP, VERSION, cluster.ns, PLURAL, NAME, {"spec": {"replicas": 3}})
    wait_for("a third decode instance, from the scale subresource",
             lambda: len(cluster.instances("decode")) == 3)
    scale = cluster.objects.get_namespaced_custom_object_scale(GROUP, VERSION, cluster.ns,
                                                              PLURAL, NAME)
    assert scale["spec"]["replicas"] == 3
    wait_for("status to report 3 decode pods", lambda: cluster.status()
             .get("decode", {}).get("replicas") == 3)

    # Deleting the PDDeployment lets the garbage collector remove every child.
    cluster.objects.delete_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, NAME)
    wait_for("children to be garbage-collected", lambda: not cluster.live()
             and not cluster.records() and not cluster.pods())


def test_old_revision_pods_never_count_as_ready_or_updated(operator: KopfRunner,
                                                           cluster: Cluster) -> None:
    """After an image change, Ready old pods count neither as updated nor as ready.
    Guards against readiness taken from the previous revision (docs/failure-modes.md #20)."""
    cluster.create(example_body(cluster.ns))
    wait_for("4 pods", lambda: len(cluster.pods()) == 4)
    cluster.mark_all_ready()
    wait_for("Ready=True", lambda: cluster.condition("Ready").get("status") == "True")
    old_revision = cluster.status()["prefill"]["revision"]

    cluster.patch_spec({"engine": {"image": "ghcr.io/pd-operator/vllm-pd-transfer:0.32.1"}})

    def truthful_mid_rollout() -> str | None:
        status = cluster.status()
        role = status.get("prefill", {})
        if status.get("observedGeneration") != 2 or role.get("revision") == old_revision:
            return None
        pods = cluster.pods("prefill")
        new = [p for p in pods if p["metadata"]["labels"][LABEL_TEMPLATE_HASH]
               == role["revision"]]
        old_ready = [p for p in pods if p["metadata"]["labels"][LABEL_TEMPLATE_HASH]
                     == old_revision and any(c["type"] == "Ready" and c["status"] == "True"
                                             for c in p["status"].get("conditions", []))]
        if not old_ready or role.get("updatedReplicas") != len(new):
            return None
        assert role["readyReplicas"] == 0, f"old-revision pods counted as ready: {role}"
        return "ok"

    wait_for("a status with Ready old-revision pods not counted", truthful_mid_rollout)
    assert cluster.condition("Ready")["status"] == "False"
    assert cluster.condition("Progressing")["reason"] == "RollingUpdate"


def test_invalid_spec_is_reported_and_creates_nothing(operator: KopfRunner,
                                                      cluster: Cluster) -> None:
    """A spec only the operator can reject (no CEL on 1.20) gets SpecValid=False naming the
    field, a Warning Event, and no child at all (docs/failure-modes.md #23: nothing
    half-created)."""
    body = example_body(cluster.ns)
    body["spec"]["prefill"]["parallelism"] = {"tensor": 3}  # 8 KV heads over 3 ranks
    cluster.create(body)
    wait_for("SpecValid=False", lambda: cluster.condition("SpecValid").get("status") == "False")
    condition = cluster.condition("SpecValid")
    assert condition["reason"] == "InvalidSpec"
    assert "spec.prefill.parallelism" in condition["message"]
    assert cluster.status()["phase"] == "Invalid"

    def warning() -> list[Any]:
        events = cluster.core.list_namespaced_event(cluster.ns).items
        return [e for e in events if e.type == "Warning" and e.reason == "InvalidSpec"
                and e.involved_object.name == NAME]

    wait_for("a Warning Event", warning)
    done = reconcile_successes() + RECONCILES.labels(result="invalid")._value.get()
    wait_for("2 more reconciles", lambda: reconcile_successes()
             + RECONCILES.labels(result="invalid")._value.get() >= done + 2, timeout_s=10)
    assert cluster.live() == {}, "an invalid PDDeployment must not get children"


def test_operator_killed_mid_reconcile_converges_after_restart(
        control_plane: ControlPlaneHandle, cluster: Cluster, kube: KubeClient,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reconcile that dies right after its first apply (as a killed process would) leaves
    one child and no status; a fresh operator converges to every child and a full status
    (docs/failure-modes.md #24)."""

    class Killed(Exception):
        pass

    def kill(_manifest: Mapping[str, Any]) -> None:
        raise Killed

    cluster.create(example_body(cluster.ns))
    with pytest.raises(Killed):
        Reconciler(kube, CAPS, after_apply=kill).reconcile(cluster.ns, NAME)
    assert len(cluster.live()) == 1
    assert cluster.status() == {}

    with run_operator(control_plane, cluster.ns, monkeypatch) as runner:
        wait_for("all children", lambda: not cluster.children_match())
        wait_for("a status", lambda: cluster.status().get("observedGeneration") == 1)
    assert runner.exception is None, runner.output
    assert len(cluster.live()) == len(cluster.desired())
    status = copy.deepcopy(cluster.status())
    assert {c["type"] for c in status["conditions"]} >= {"SpecValid", "Ready", "Progressing"}
