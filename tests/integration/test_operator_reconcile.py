"""The operator against a real control plane: children, truthful status, restoration,
scaling, revisions, restart mid-reconcile, invalid specs, garbage collection.

The operator runs in-process under `kopf.testing.KopfRunner`, serving only the test's
namespace, with a 1 s resync so that steady-state reconciles happen during the test. There
is no kubelet: the tests mark pods Ready by writing their status, as lws's envtest suite does.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from kopf.testing import KopfRunner
from kubernetes import client as k8s

from pd_operator import settings
from pd_operator.api import PDDeployment, PDDeploymentStatus
from pd_operator.build import Capabilities, build_children, child_key
from pd_operator.build.names import LABEL_TEMPLATE_HASH
from pd_operator.devcluster import ControlPlaneHandle
from pd_operator.kube import CHILD_KINDS, PDB, PODS, KubeClient
from pd_operator.metrics import RECONCILES, api_writes_total
from pd_operator.reconcile import Reconciler, first_difference
from pd_operator.workqueue import QueueTuning
from tests.integration.operator_runner import kopf_runner

pytestmark = [pytest.mark.apiserver, pytest.mark.timeout(90)]

REPO = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "pd.serving.dev", "v1alpha1", "pddeployments"
WAIT_S = 30.0
CAPS = Capabilities(pod_disruption_budgets=False)  # v1.20 serves no policy/v1
KINDS = tuple(k for k in CHILD_KINDS if k != PDB)
NAME = "llama-70b"

Obj = dict[str, Any]


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    """Poll `probe` until it returns something truthy; fail naming `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}; last seen: {last!r}")


def example_body(namespace: str) -> Obj:
    body: Obj = yaml.safe_load((REPO / "examples" / "llama-70b.yaml").read_text())
    body["metadata"]["namespace"] = namespace
    return body


@pytest.fixture
def kube(control_plane: ControlPlaneHandle) -> Iterator[KubeClient]:
    client = KubeClient(control_plane.api_client())
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def operator(control_plane: ControlPlaneHandle, namespace: str,
             monkeypatch: pytest.MonkeyPatch) -> Iterator[KopfRunner]:
    """The operator serving the test's namespace; asserts it ended without an exception."""
    with run_operator(control_plane, namespace, monkeypatch) as runner:
        yield runner
    assert runner.exception is None, runner.output
    assert runner.exit_code == 0, runner.output


def run_operator(control_plane: ControlPlaneHandle, namespace: str,
                 monkeypatch: pytest.MonkeyPatch) -> AbstractContextManager[KopfRunner]:
    monkeypatch.setenv("KUBECONFIG", str(control_plane.kubeconfig_path))
    # monkeypatch restores the process-wide config, so no later test inherits these.
    monkeypatch.setattr(settings, "_config", replace(
        settings.current(),
        kubeconfig=str(control_plane.kubeconfig_path),
        tuning=QueueTuning(workers=2, resync_s=1.0, base_backoff_s=0.2, max_backoff_s=2.0),
    ))
    return kopf_runner(["run", "--standalone", "-m", "pd_operator.handlers",
                        "--namespace", namespace], timeout=60)


class Cluster:
    """Test-side reads and writes, through the admin client."""

    def __init__(self, api: k8s.ApiClient, kube: KubeClient, namespace: str) -> None:
        self.api, self.kube, self.ns = api, kube, namespace
        self.objects = k8s.CustomObjectsApi(api)
        self.core = k8s.CoreV1Api(api)
        self.apps = k8s.AppsV1Api(api)

    def create(self, body: Obj) -> Obj:
        created: Obj = self.objects.create_namespaced_custom_object(
            GROUP, VERSION, self.ns, PLURAL, body)
        return created

    def pdd(self, name: str = NAME) -> Obj:
        got: Obj = self.objects.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL,
                                                             name)
        return got

    def patch_spec(self, patch: Obj, name: str = NAME) -> None:
        self.objects.patch_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name,
                                                    {"spec": patch})

    def desired(self, name: str = NAME) -> list[Obj]:
        return build_children(PDDeployment.model_validate(self.pdd(name)), CAPS)

    def live(self, name: str = NAME) -> dict[tuple[str, str, str, str], Obj]:
        selector = f"pd.serving.dev/deployment={name}"
        return {child_key(o): o for o in self.kube.list_children(self.ns, selector, KINDS)}

    def children_match(self, name: str = NAME) -> list[str]:
        """Problems: children missing or differing from the builder's manifests."""
        live = self.live(name)
        problems = []
        for want in self.desired(name):
            have = live.get(child_key(want))
            if have is None:
                problems.append(f"missing {want['kind']}/{want['metadata']['name']}")
                continue
            diff = first_difference(want, have)
            if diff is not None:
                problems.append(f"{want['kind']}/{want['metadata']['name']} differs at {diff}")
            if have["metadata"]["ownerReferences"] != want["metadata"]["ownerReferences"]:
                problems.append(f"{want['kind']}/{want['metadata']['name']} owner refs differ")
        return problems

    def status(self, name: str = NAME) -> Obj:
        return self.pdd(name).get("status") or {}

    def condition(self, type_: str, name: str = NAME) -> Obj:
        for c in self.status(name).get("conditions", []):
            if c["type"] == type_:
                return dict(c)
        return {}

    def pods(self, role: str | None = None) -> list[Obj]:
        """Engine pods (the router's pods carry no role label)."""
        selector = f"pd.serving.dev/deployment={NAME},pd.serving.dev/role" + \
            (f"={role}" if role else "")
        return self.kube.list_objects(PODS, self.ns, selector)

    def mark_all_ready(self) -> None:
        """Every pod of the PDDeployment, the router's included, becomes Running and Ready."""
        for pod in self.kube.list_objects(PODS, self.ns, f"pd.serving.dev/deployment={NAME}"):
            self.mark_ready(pod)

    def mark_ready(self, pod: Mapping[str, Any]) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        conditions = [{"type": t, "status": "True", "lastTransitionTime": now}
                      for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
        self.core.patch_namespaced_pod_status(pod["metadata"]["name"], self.ns, {
            "status": {"phase": "Running", "conditions": conditions}})





@pytest.fixture
def cluster(kube_client: k8s.ApiClient, kube: KubeClient, namespace: str) -> Cluster:
    return Cluster(kube_client, kube, namespace)


def successes() -> float:
    return RECONCILES.labels(result="success")._value.get()


def test_children_pods_and_status_follow_the_pddeployment(operator: KopfRunner,
                                                           cluster: Cluster) -> None:
    """Children equal the builders' manifests, pods get exact names, status counts the
    current revision only and turns Ready when the pods are; a steady state writes nothing.
    Guards against a status computed from the spec instead of the pods (FAILURES 20)."""
    cluster.create(example_body(cluster.ns))
    wait_for("every child to equal the builder's manifest", lambda: not cluster.children_match())
    names = wait_for("4 engine pods", lambda: sorted(p["metadata"]["name"] for p in cluster.pods())
                     if len(cluster.pods()) == 4 else None)
    assert names == [f"{NAME}-decode-0", f"{NAME}-decode-1", f"{NAME}-prefill-0",
                     f"{NAME}-prefill-1"]

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
    sts = cluster.live()[("apps/v1", "StatefulSet", cluster.ns, f"{NAME}-prefill")]
    assert status["prefill"]["revision"] == \
        sts["spec"]["template"]["metadata"]["labels"][LABEL_TEMPLATE_HASH]

    cluster.mark_all_ready()
    wait_for("Ready=True", lambda: cluster.condition("Ready").get("status") == "True")
    stored = cluster.status()
    assert stored["prefill"]["summary"] == "2/2" and stored["decode"]["summary"] == "2/2"
    assert stored["phase"] == "Ready"
    assert cluster.condition("Progressing")["reason"] == "ReconcileComplete"
    # Every field we write is declared in the CRD: the stored status round-trips exactly.
    assert PDDeploymentStatus.model_validate(stored).to_wire() == stored

    # Steady state: several resync reconciles, not one write request.
    writes, done = api_writes_total(), successes()
    wait_for("3 more reconciles", lambda: successes() >= done + 3, timeout_s=10)
    assert api_writes_total() - writes == 0
    assert cluster.status() == stored


def test_edited_deleted_and_scaled_children_are_restored(operator: KopfRunner,
                                                         cluster: Cluster) -> None:
    """Hand edits are undone, a deleted child comes back, and the scale subresource drives
    the decode StatefulSet. Guards against create-only reconciles (STYLE anti-pattern 1)."""
    cluster.create(example_body(cluster.ns))
    wait_for("children", lambda: not cluster.children_match())
    sts_name = f"{NAME}-prefill"
    cluster.apps.patch_namespaced_stateful_set(sts_name, cluster.ns, {"spec": {"template": {
        "spec": {"containers": [{"name": "engine", "image": "evil:latest"}]}}}})
    cluster.core.patch_namespaced_service(f"{NAME}-decode", cluster.ns, [
        {"op": "replace", "path": "/spec/ports/0/port", "value": 1234}])
    cluster.core.delete_namespaced_config_map(f"{NAME}-transfer", cluster.ns)
    wait_for("the edited and deleted children to be restored",
             lambda: not cluster.children_match())
    image = cluster.apps.read_namespaced_stateful_set(sts_name, cluster.ns) \
        .spec.template.spec.containers[0].image
    assert image == "lmsysorg/sglang:latest"

    cluster.objects.patch_namespaced_custom_object_scale(
        GROUP, VERSION, cluster.ns, PLURAL, NAME, {"spec": {"replicas": 3}})
    wait_for("the decode StatefulSet to follow the scale subresource", lambda: cluster.apps
             .read_namespaced_stateful_set(f"{NAME}-decode", cluster.ns).spec.replicas == 3)
    scale = cluster.objects.get_namespaced_custom_object_scale(GROUP, VERSION, cluster.ns,
                                                              PLURAL, NAME)
    assert scale["spec"]["replicas"] == 3
    wait_for("status to report 3 decode pods", lambda: cluster.status()
             .get("decode", {}).get("replicas") == 3)

    # Deleting the PDDeployment lets the garbage collector remove every child.
    cluster.objects.delete_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, NAME)
    wait_for("children to be garbage-collected", lambda: not cluster.live())


def test_old_revision_pods_never_count_as_ready_or_updated(operator: KopfRunner,
                                                           cluster: Cluster) -> None:
    """After an image change, Ready old pods count neither as updated nor as ready.
    Guards against readiness taken from the previous revision (FAILURES 20)."""
    cluster.create(example_body(cluster.ns))
    wait_for("4 pods", lambda: len(cluster.pods()) == 4)
    cluster.mark_all_ready()
    wait_for("Ready=True", lambda: cluster.condition("Ready").get("status") == "True")
    old_revision = cluster.status()["prefill"]["revision"]

    cluster.patch_spec({"engine": {"image": "lmsysorg/sglang:v2"}})

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
    field, a Warning Event, and no child at all (FAILURES 23: nothing half-created)."""
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
    done = successes() + RECONCILES.labels(result="invalid")._value.get()
    wait_for("2 more reconciles", lambda: successes()
             + RECONCILES.labels(result="invalid")._value.get() >= done + 2, timeout_s=10)
    assert cluster.live() == {}, "an invalid PDDeployment must not get children"


def test_operator_killed_mid_reconcile_converges_after_restart(
        control_plane: ControlPlaneHandle, cluster: Cluster, kube: KubeClient,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reconcile that dies right after its first apply (as a killed process would) leaves
    one child and no status; a fresh operator converges to every child and a full status
    (FAILURES 24)."""

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
