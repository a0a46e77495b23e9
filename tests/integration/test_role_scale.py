"""Each role of a PDDeployment scales through its own `PDRole` (a `/scale` subresource), on a
real control plane: the operator in-process (`kopf.testing.KopfRunner`), or as two
`pd-operator run --leader-elect` processes where a leader is killed (`OperatorReplicas`),
the API server's own scale subresource and validation, and the real
kube-controller-manager's HPA controller reading the scale target. No kubelet: pods are
counted, never run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from kopf.testing import KopfRunner
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient

from pd_devcluster import ControlPlaneHandle
from pd_testbed.checkout import EXAMPLES_DIR
from pd_testbed.cluster import GROUP, NAME, PLURAL, VERSION, Cluster, example_body
from pd_testbed.operator_process import OperatorReplicas
from pd_testbed.polling import wait_for

pytestmark = [pytest.mark.apiserver, pytest.mark.timeout(120)]

Obj = dict[str, Any]
ROLES = "pdroles"
RECORD = "pd.serving.dev/operator-replicas"
PREFILL, DECODE = f"{NAME}-prefill", f"{NAME}-decode"
AUTOSCALING = EXAMPLES_DIR / "autoscaling"


def pdrole(cluster: Cluster, name: str) -> Obj | None:
    try:
        found: Obj = cluster.objects.get_namespaced_custom_object(
            GROUP, VERSION, cluster.ns, ROLES, name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return found


def scale(cluster: Cluster, name: str, replicas: int) -> None:
    cluster.objects.patch_namespaced_custom_object_scale(
        GROUP, VERSION, cluster.ns, ROLES, name, {"spec": {"replicas": replicas}})


def instances(cluster: Cluster, name: str) -> int:
    """The engine instances of the PDRole `name`'s role (none is deleting)."""
    return len(cluster.instances(name.rsplit("-", 1)[-1]))


def settled(cluster: Cluster, name: str, replicas: int) -> Obj | None:
    """The PDRole once its spec, the PDDeployment's count and its status all say
    `replicas` and its generation is acknowledged."""
    role = pdrole(cluster, name)
    if role is None:
        return None
    status = role.get("status") or {}
    key = "prefill" if name == PREFILL else "decode"
    done = (role["spec"]["replicas"] == replicas
            and cluster.pdd()["spec"][key]["replicas"] == replicas
            and status.get("deploymentReplicas") == replicas
            and status.get("replicas") == replicas
            and status.get("observedGeneration") == role["metadata"]["generation"])
    return role if done else None


def test_each_role_scales_through_its_pdrole_and_the_last_edit_wins(
        operator: KopfRunner, cluster: Cluster) -> None:
    """Guards against a role that only the PDDeployment can scale (no `kubectl scale`, HPA
    or KEDA on prefill), and against two counts that drift apart."""
    cluster.create(example_body(cluster.ns))
    prefill = wait_for("the prefill PDRole settled at the example's 2",
                       lambda: settled(cluster, PREFILL, 2))
    owner = prefill["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("PDDeployment", NAME, True)
    assert prefill["spec"] == {"pdDeployment": NAME, "role": "prefill", "replicas": 2}
    assert prefill["status"] == {
        "replicas": 2, "readyReplicas": 0, "deploymentReplicas": 2, "observedGeneration": 1,
        "selector": f"pd.serving.dev/deployment={NAME},pd.serving.dev/role=prefill"}
    wait_for("the decode PDRole settled at 2", lambda: settled(cluster, DECODE, 2))

    # The scale target moves the PDDeployment, and so the instances.
    scale(cluster, PREFILL, 3)
    prefill = wait_for("prefill scaled to 3 through its PDRole",
                       lambda: settled(cluster, PREFILL, 3))
    assert wait_for("3 prefill instances", lambda: instances(cluster, PREFILL) == 3)
    assert prefill["status"]["message"] == (
        "spec.prefill.replicas set to 3 (was 2) from PDRole llama-70b-prefill, generation 2")
    assert cluster.objects.get_namespaced_custom_object_scale(
        GROUP, VERSION, cluster.ns, ROLES, PREFILL)["status"] == {
        "replicas": 3,
        "selector": f"pd.serving.dev/deployment={NAME},pd.serving.dev/role=prefill"}

    # An edit of the PDDeployment (its own /scale moves decode) moves the PDRole.
    cluster.objects.patch_namespaced_custom_object_scale(
        GROUP, VERSION, cluster.ns, PLURAL, NAME, {"spec": {"replicas": 1}})
    decode = wait_for("the decode PDRole to follow the PDDeployment's 1",
                      lambda: settled(cluster, DECODE, 1))
    assert decode["status"]["message"] == (
        "spec.replicas set to 1 (was 2) from the PDDeployment's spec.decode.replicas")
    assert wait_for("1 decode instance", lambda: instances(cluster, DECODE) == 1)

    # Scale to 0 keeps the role's objects and no pod.
    scale(cluster, DECODE, 0)
    wait_for("decode at 0 pods", lambda: settled(cluster, DECODE, 0))
    assert wait_for("no decode instance", lambda: instances(cluster, DECODE) == 0)
    scale(cluster, DECODE, 1)
    wait_for("decode back at 1", lambda: settled(cluster, DECODE, 1))

    # Counts the API refuses, with a message naming the field and the limit; nothing moves.
    for bad, limit in ((-1, "greater than or equal to 0"), (10001, "less than or equal to 10000")):
        with pytest.raises(ApiException) as refused:
            scale(cluster, PREFILL, bad)
        assert refused.value.status == 422
        assert "spec.replicas" in refused.value.body and limit in refused.value.body
    assert cluster.pdd()["spec"]["prefill"]["replicas"] == 3

    # A deleted PDRole comes back with the PDDeployment's count.
    uid = prefill["metadata"]["uid"]
    cluster.objects.delete_namespaced_custom_object(GROUP, VERSION, cluster.ns, ROLES, PREFILL)
    back = wait_for("the prefill PDRole recreated at 3", lambda: (
        r if (r := settled(cluster, PREFILL, 3)) and r["metadata"]["uid"] != uid else None))
    assert back["spec"]["replicas"] == 3

    # One whose deployment label was edited away is still this role's scale target.
    cluster.objects.patch_namespaced_custom_object(
        GROUP, VERSION, cluster.ns, ROLES, PREFILL,
        {"metadata": {"labels": {"pd.serving.dev/deployment": None}}})
    scale(cluster, PREFILL, 1)
    wait_for("prefill scaled to 1 through its unlabelled PDRole",
             lambda: settled(cluster, PREFILL, 1))
    assert wait_for("1 prefill instance", lambda: instances(cluster, PREFILL) == 1)


def test_the_example_hpas_on_the_controller_manager_can_scale_each_role(
        operator: KopfRunner, cluster: Cluster) -> None:
    """Guards against a scale target an autoscaler cannot use (no selector, no /scale), and
    an example HPA the API server would refuse: `examples/autoscaling/hpa.yaml` as shipped
    (this control plane serves its autoscaling/v2 fields as autoscaling/v2beta2), and the
    real kube-controller-manager's HPA controller reads each PDRole's scale (AbleToScale)
    and then asks for the example's external metric, which no adapter serves here."""
    cluster.create(example_body(cluster.ns))
    for name in (PREFILL, DECODE):
        wait_for(f"{name} settled", lambda name=name: settled(cluster, name, 2))
    hpas = DynamicClient(cluster.api).resources.get(api_version="autoscaling/v2beta2",
                                                    kind="HorizontalPodAutoscaler")
    shipped = [d for d in yaml.safe_load_all((AUTOSCALING / "hpa.yaml").read_text()) if d]
    assert [d["spec"]["scaleTargetRef"]["name"] for d in shipped] == [PREFILL, DECODE]
    for hpa in shipped:
        assert hpa["apiVersion"] == "autoscaling/v2"
        hpas.create(body={**hpa, "apiVersion": "autoscaling/v2beta2"}, namespace=cluster.ns)

    def condition(name: str, type_: str, status: str) -> Obj | None:
        found = hpas.get(name=name, namespace=cluster.ns).to_dict()
        return next((c for c in (found.get("status") or {}).get("conditions") or []
                     if c["type"] == type_ and c["status"] == status), None)

    for name in (PREFILL, DECODE):
        able = wait_for(f"the HPA of {name} AbleToScale=True",
                        lambda name=name: condition(name, "AbleToScale", "True"), timeout_s=60)
        assert able["reason"] == "SucceededGetScale", able
        inactive = wait_for(f"the HPA of {name} asking for its external metric",
                            lambda name=name: condition(name, "ScalingActive", "False"),
                            timeout_s=60)
        assert inactive["reason"] == "FailedGetExternalMetric", inactive


def test_a_pdrole_the_killed_leader_created_never_overrides_the_pddeployments_edit(
        control_plane: ControlPlaneHandle, cluster: Cluster, tmp_path: Path) -> None:
    """Guards against a PDRole the operator created itself taken for a user's edit: two
    replicas under leader election, the leader SIGKILLed as soon as its PDRoles exist
    (generation 1 never acknowledged in status.observedGeneration), then the PDDeployment's
    decode count edited 2 -> 3. The standby that takes over keeps 3 and moves the PDRole to
    it (a platform team's leader failover had set the PDDeployment back to 2). An edit
    through the PDRole's /scale (an autoscaler) still wins, and once carried over, the next
    edit of the PDDeployment moves the PDRole again (`docs/failure-modes.md #53`)."""
    started = time.monotonic()
    operators = OperatorReplicas(control_plane, cluster.ns, tmp_path)
    try:
        leader = operators.leader()
        standby = next(p for p in operators.live if p is not leader)
        cluster.create(example_body(cluster.ns))
        wait_for("the leader to create the decode PDRole",
                 lambda: pdrole(cluster, DECODE), 30, interval_s=0.02)
        operators.kill_leader(replace=False)
        created = pdrole(cluster, DECODE)
        assert created is not None
        if (created.get("status") or {}).get("observedGeneration"):
            # The leader acknowledged it before the kill landed: undo that, as if it had died
            # before its status write (the state this test is about, every run).
            print("the killed leader had acknowledged the decode PDRole: status cleared")
            cluster.objects.patch_namespaced_custom_object_status(
                GROUP, VERSION, cluster.ns, ROLES, DECODE, {"status": None})
            created = pdrole(cluster, DECODE)
            assert created is not None
        assert created["metadata"]["generation"] == 1
        assert created["spec"]["replicas"] == 2
        assert created["metadata"]["annotations"][RECORD] == "2"
        assert not (created.get("status") or {}).get("observedGeneration")

        cluster.patch_spec({"decode": {"replicas": 3}})

        def settled_keeping_3() -> Obj | None:
            kept = cluster.pdd()["spec"]["decode"]["replicas"]
            assert kept == 3, f"the PDDeployment's edit was lost: decode.replicas {kept}"
            return settled(cluster, DECODE, 3)

        wait_for("the standby to lead", standby.leads, 20, interval_s=0.2)
        decode = wait_for("the decode PDRole to follow the PDDeployment's 3", settled_keeping_3,
                          30, explain=standby.notable)
        assert decode["status"]["message"] == (
            "spec.replicas set to 3 (was 2) from the PDDeployment's spec.decode.replicas")
        assert decode["metadata"]["annotations"][RECORD] == "3"

        # An autoscaler's edit through /scale still wins over the PDDeployment's count.
        scale(cluster, DECODE, 4)
        decode = wait_for("decode scaled to 4 through its PDRole",
                          lambda: settled(cluster, DECODE, 4), 30, explain=standby.notable)
        # generation 1 created, 2 the operator's copy of 3, 3 the autoscaler's 4
        assert decode["status"]["message"] == (
            "spec.decode.replicas set to 4 (was 3) from PDRole llama-70b-decode, generation 3")
        assert decode["metadata"]["annotations"][RECORD] == "4"

        # Carried over, that edit is no longer new: the PDDeployment's next edit moves it.
        cluster.patch_spec({"decode": {"replicas": 1}})
        wait_for("the decode PDRole to follow the PDDeployment's 1",
                 lambda: settled(cluster, DECODE, 1), 30, explain=standby.notable)
        assert not operators.errors(), "\n".join(operators.errors())
    finally:
        print(operators.stop())
    print(f"leader killed, taken over and three edits carried in "
          f"{time.monotonic() - started:.1f} s")
