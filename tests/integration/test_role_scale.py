"""Each role of a PDDeployment scales through its own `PDRole` (a `/scale` subresource), on a
real control plane: the operator in-process (`kopf.testing.KopfRunner`), the API server's
own scale subresource and validation, and the real kube-controller-manager's HPA
controller reading the scale target. No kubelet: pods are counted, never run.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from kopf.testing import KopfRunner
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient

from pd_testbed.checkout import EXAMPLES_DIR
from pd_testbed.cluster import GROUP, NAME, PLURAL, VERSION, Cluster, example_body
from pd_testbed.polling import wait_for

pytestmark = [pytest.mark.apiserver, pytest.mark.timeout(120)]

Obj = dict[str, Any]
ROLES = "pdroles"
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


def sts_replicas(cluster: Cluster, name: str) -> int:
    return int(cluster.apps.read_namespaced_stateful_set(name, cluster.ns).spec.replicas)


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

    # The scale target moves the PDDeployment, and so the StatefulSet.
    scale(cluster, PREFILL, 3)
    prefill = wait_for("prefill scaled to 3 through its PDRole",
                       lambda: settled(cluster, PREFILL, 3))
    assert sts_replicas(cluster, PREFILL) == 3
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
    assert sts_replicas(cluster, DECODE) == 1

    # Scale to 0 keeps the role's objects and no pod.
    scale(cluster, DECODE, 0)
    wait_for("decode at 0 pods", lambda: settled(cluster, DECODE, 0))
    assert sts_replicas(cluster, DECODE) == 0
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
    assert sts_replicas(cluster, PREFILL) == 1


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
