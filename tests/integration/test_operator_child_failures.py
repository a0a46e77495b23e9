"""The operator against a real control plane (kube-apiserver and kube-controller-manager
v1.20): engine instances the API server refuses to create (a ResourceQuota of zero pods)
surface as Degraded, and PDDeployment names at and past the longest one whose children all
fit. No kubelet runs, so pods stay Pending.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client as k8s

from pd_operator.api.naming import MAX_NAME_LENGTH
from pd_operator.build.names import LABEL_DEPLOYMENT, LABEL_ROLE
from pd_operator.kube import PODS
from pd_operator.metrics import RECONCILES
from pd_testbed.cluster import KINDS, NAME, Cluster, example_body
from pd_testbed.polling import wait_for

pytestmark = [pytest.mark.apiserver, pytest.mark.timeout(120)]

Obj = dict[str, Any]
QUOTA = "no-pods"


def named(cluster: Cluster, name: str) -> Obj:
    body = example_body(cluster.ns)
    body["metadata"]["name"] = name
    return body


def pods_of(cluster: Cluster, name: str) -> list[Obj]:
    """The engine pods of PDDeployment `name` (the router's carry no role label)."""
    return cluster.kube.list_objects(PODS, cluster.ns, f"{LABEL_DEPLOYMENT}={name},{LABEL_ROLE}")


def reconciles() -> float:
    return sum(RECONCILES.labels(result=r)._value.get() for r in ("success", "invalid"))


@pytest.mark.usefixtures("operator")
def test_instances_the_quota_refuses_make_degraded_until_they_exist(
        cluster: Cluster) -> None:
    """With a `pods: 0` quota the instances' pods are refused: the PDDeployment turns
    Degraded=True naming the refused pod, the quota and what to change; once the quota is
    deleted the pods are created and Degraded clears. Guards against a child failure the
    user cannot see (docs/failure-modes.md #29): a PDDeployment "Progressing: Creating"
    forever while its pods could not be created."""
    cluster.core.create_namespaced_resource_quota(cluster.ns, k8s.V1ResourceQuota(
        metadata=k8s.V1ObjectMeta(name=QUOTA), spec=k8s.V1ResourceQuotaSpec(hard={"pods": "0"})))
    # Quota admission enforces `status.hard`, which the quota controller fills in.
    wait_for("the quota to be in force", lambda: (cluster.core.read_namespaced_resource_quota(
        QUOTA, cluster.ns).status.hard or {}).get("pods") == "0")
    cluster.create(example_body(cluster.ns))

    condition = wait_for("Degraded=True", lambda: (c := cluster.condition("Degraded")).get(
        "status") == "True" and c)
    assert condition["reason"] == "ReconcileFailed"
    # The API server's own message: the quota admission refusing the pod by name.
    revision = cluster.status()["prefill"]["revision"]
    assert f'pods "{NAME}-prefill-{revision[:4]}-0" is forbidden: exceeded quota: {QUOTA}' \
        in condition["message"]
    assert condition["message"].startswith(f"POST /api/v1/namespaces/{cluster.ns}/pods was "
                                           "refused by the namespace's ResourceQuota (")
    assert condition["message"].endswith("Raise the quota, or lower the replicas.")
    assert cluster.status()["phase"] == "Degraded"
    assert pods_of(cluster, NAME) == []

    cluster.core.delete_namespaced_resource_quota(QUOTA, cluster.ns)
    wait_for("the 4 engine pods", lambda: len(pods_of(cluster, NAME)) == 4, timeout_s=60)
    wait_for("Degraded to clear",
             lambda: cluster.condition("Degraded").get("status") == "False", timeout_s=30)
    assert cluster.condition("Degraded")["reason"] == "AsExpected"
    # Every pod exists and runs the current revision; none is Ready (no kubelet). The status
    # that saw them created may still say Progressing: the next, on their events, says so.
    wait_for("phase Pending", lambda: cluster.status().get("phase") == "Pending",
             timeout_s=30)


@pytest.mark.usefixtures("operator")
def test_longest_name_gets_pods_and_one_more_character_gets_nothing(
        cluster: Cluster) -> None:
    """A 45-character name is refused with SpecValid=False naming the 44 limit and the label
    that would not fit, and no child of any kind is created; a 44-character name gets its
    instances' pods (each name 63 characters or fewer: a hostname). Guards against names
    that passed validation yet did not fit the API's limits (docs/failure-modes.md #29): a
    long name half-created children, or workloads whose pods could never exist."""
    assert MAX_NAME_LENGTH == 44
    too_long, longest = "llama-" + "x" * 39, "llama-" + "y" * 38
    assert (len(too_long), len(longest)) == (45, 44)

    refused = cluster.create(named(cluster, too_long))
    wait_for("SpecValid=False",
             lambda: cluster.condition("SpecValid", too_long).get("status") == "False")
    condition = cluster.condition("SpecValid", too_long)
    assert condition["reason"] == "InvalidSpec"
    assert f"metadata.name '{too_long}' (45 characters) is too long" in condition["message"]
    assert "(64 > 63). Use at most 44 characters." in condition["message"]
    assert cluster.status(too_long)["phase"] == "Invalid"
    done = reconciles()
    wait_for("2 more reconciles", lambda: reconciles() >= done + 2, timeout_s=10)

    cluster.create(named(cluster, longest))
    names = wait_for("the 44-character name's 4 pods", lambda: sorted(
        p["metadata"]["name"] for p in pods_of(cluster, longest))
        if len(pods_of(cluster, longest)) == 4 else None, timeout_s=60)
    status = cluster.status(longest)
    token = {role: status[role]["revision"][:4] for role in ("prefill", "decode")}
    assert names == [f"{longest}-decode-{token['decode']}-0",
                     f"{longest}-decode-{token['decode']}-1",
                     f"{longest}-prefill-{token['prefill']}-0",
                     f"{longest}-prefill-{token['prefill']}-1"]
    # <name>-prefill-<4>-<index>: 44 + 9 + 4 + 2 = 59 here, 63 with the largest index.
    assert all(len(n) <= 63 for n in names)
    wait_for("SpecValid=True", lambda: cluster.condition("SpecValid", longest),
             until=lambda c: c.get("status") == "True")

    # Nothing anywhere in the namespace belongs to, or is named after, the refused one.
    uid = refused["metadata"]["uid"]
    strays = [f"{ref.kind}/{obj['metadata']['name']}"
              for ref in (*KINDS, PODS) for obj in cluster.kube.list_objects(ref, cluster.ns, "")
              if obj["metadata"]["name"].startswith(too_long)
              or any(o.get("uid") == uid for o in obj["metadata"].get("ownerReferences") or [])]
    assert strays == []
