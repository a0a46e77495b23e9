"""The operator against an API server that misbehaves, for real: the kube-apiserver restarted
mid-reconcile, an object deleted behind its back while its watches were down, etcd paused
for 20 s, a rival writer that makes its writes conflict (409), API Priority and Fairness
refusing it (429), and one kind forbidden by RBAC. Each fault ends with the children
exactly what the builders make, a current status, and the operator still running.

These faults would disturb every other test, so the module has a control plane of its own
(etcd, kube-apiserver, kube-controller-manager). One operator process serves it for the
whole module, as the chart runs it (`pd-operator run --leader-elect`), under a
ServiceAccount whose ClusterRole the tests edit; one PDDeployment is edited by each test.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from pd_devcluster import (
    ControlPlaneHandle,
    Ports,
    restart_apiserver,
    service_account_kubeconfig,
    start_control_plane,
)
from pd_operator.kube import KubeClient
from pd_testbed.checkout import CRDS_DIR
from pd_testbed.cluster import NAME, Cluster, reference_body
from pd_testbed.operator_process import OperatorProcess
from pd_testbed.polling import wait_for

pytestmark = [pytest.mark.apiserver, pytest.mark.timeout(240)]

NAMESPACE = "faults"
OPERATOR_SA = "pd-operator"
ROLE = "pd-operator-faults"
# Everything the operator touches, as broad rules the tests narrow: RBAC has no "deny", so
# a kind is forbidden by leaving its group out.
GROUPS = ("", "apps", "rbac.authorization.k8s.io", "policy", "pd.serving.dev",
          "coordination.k8s.io", "networking.k8s.io")


@dataclass
class Bed:
    """The module's control plane, its operator and the PDDeployment the tests edit."""

    plane: ControlPlaneHandle
    api: k8s.ApiClient
    cluster: Cluster
    operator: OperatorProcess
    kubeconfig: Path
    logs: Path
    restarts: int = 0

    def revive(self) -> None:
        """Start the operator again if it exited, as the kubelet restarts a container. kopf
        stops when a watch is answered 404, which a CRD's route is while a restarted API
        server has not yet loaded the CRDs; the process then ends within its exit grace
        (`EXIT_GRACE_S`), even when kopf's stop hangs on its own watchers."""
        if not self.operator.alive:
            self.restarts += 1
            self.operator = OperatorProcess.start(
                self.plane, NAMESPACE, f"faults-{self.restarts}", self.logs,
                kubeconfig=self.kubeconfig, extra_args=["--verbose"])

    def restart_apiserver(self, down_s: float = 0.0,
                          while_down: Callable[[], None] | None = None) -> None:
        self.plane = restart_apiserver(self.plane, down_s=down_s, while_down=while_down)

    def pid(self, name: str) -> int:
        return next(r.pid for r in self.plane.processes if r.name == name)

    def all_logs(self) -> str:
        """Every operator process's log so far, oldest first."""
        return "".join(p.read_text(errors="replace")
                       for p in sorted(self.logs.glob("operator-faults*.log"),
                                       key=lambda p: (len(p.name), p.name)))

    def converged(self) -> list[str]:
        """What is still off: children, a status behind the spec, Degraded."""
        self.revive()
        try:
            problems = self.cluster.children_match()
            pdd = self.cluster.pdd()
        except (ApiException, OSError) as exc:
            return [f"API: {exc}"]
        status = pdd.get("status") or {}
        if status.get("observedGeneration") != pdd["metadata"]["generation"]:
            problems.append(f"status at generation {status.get('observedGeneration')} of "
                            f"{pdd['metadata']['generation']}")
        degraded: dict[str, Any] = next(
            (c for c in status.get("conditions", []) if c["type"] == "Degraded"), {})
        if degraded.get("status") == "True":
            problems.append(f"Degraded: {degraded.get('message')}")
        return problems

    def wait(self, what: str, probe: Callable[[], Any], timeout_s: float,
             interval_s: float = 0.3) -> Any:
        """`wait_for` with the operator revived before each look (a kubelet does not wait
        for a test to restart its container) and its log shown on failure."""
        def look() -> Any:
            self.revive()
            return probe()
        return wait_for(what, look, timeout_s, interval_s, explain=self.explain)

    def explain(self) -> str:
        """Shown when a wait fails: the operator's own log lines, latest last."""
        return f"--- the operator's last log lines ---\n{self.operator.notable()}"

    def wait_converged(self, what: str, timeout_s: float = 90) -> None:
        wait_for(what, self.converged, timeout_s, interval_s=0.5, until=lambda p: p == [],
                 explain=self.explain)
        assert self.operator.alive, self.operator.log()
        print(f"operator processes restarted so far: {self.restarts}")

    def grant(self, groups: tuple[str, ...]) -> None:
        rbac = k8s.RbacAuthorizationV1Api(self.api)
        role = rbac.read_cluster_role(ROLE)
        role.rules = [k8s.V1PolicyRule(api_groups=[g], resources=["*"], verbs=["*"])
                      for g in groups]
        rbac.replace_cluster_role(ROLE, role)


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    state = tmp_path_factory.mktemp("faults")
    plane = start_control_plane(state / "plane", Ports.free(), CRDS_DIR, controller_manager=True)
    api = plane.api_client()
    operator: OperatorProcess | None = None
    try:
        core, rbac = k8s.CoreV1Api(api), k8s.RbacAuthorizationV1Api(api)
        core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=NAMESPACE)))
        core.create_namespaced_service_account(
            NAMESPACE, k8s.V1ServiceAccount(metadata=k8s.V1ObjectMeta(name=OPERATOR_SA)))
        rbac.create_cluster_role(k8s.V1ClusterRole(
            metadata=k8s.V1ObjectMeta(name=ROLE),
            rules=[k8s.V1PolicyRule(api_groups=[g], resources=["*"], verbs=["*"])
                   for g in GROUPS]))
        rbac.create_cluster_role_binding(k8s.V1ClusterRoleBinding(
            metadata=k8s.V1ObjectMeta(name=ROLE),
            role_ref=k8s.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole",
                                   name=ROLE),
            subjects=[k8s.RbacV1Subject(kind="ServiceAccount", name=OPERATOR_SA,
                                        namespace=NAMESPACE)]))
        kubeconfig = service_account_kubeconfig(plane, NAMESPACE, OPERATOR_SA)
        operator = OperatorProcess.start(plane, NAMESPACE, "faults", state,
                                         kubeconfig=kubeconfig, extra_args=["--verbose"])
        cluster = Cluster(api, KubeClient(plane.api_client()), NAMESPACE)
        cluster.create(reference_body(NAMESPACE))
        bed = Bed(plane, api, cluster, operator, kubeconfig, state)
        bed.wait_converged("the PDDeployment's children and status", 60)
        yield bed
        operator = bed.operator
        print(f"--- operator ---\n{operator.log()}")
    finally:
        if operator is not None:
            operator.kill()
        api.close()  # type: ignore[no-untyped-call]
        plane.stop()


def replicas(bed: Bed, role: str) -> int:
    """The role's engine instances that are not being deleted."""
    return len(bed.cluster.instances(role))


def test_an_apiserver_restart_mid_reconcile_ends_with_every_child_applied(bed: Bed) -> None:
    """Guards against a half-applied edit: the API server stops right after the prefill
    instances of an edit that also changes the decode ones were created; the operator's
    requests fail, its watches break and come back expired (410), and it finishes the
    edit."""
    before = bed.operator.counter('pd_operator_reconciles_total{result=error}')
    bed.cluster.patch_spec({"prefill": {"replicas": 3}, "decode": {"replicas": 3}})
    bed.wait("the prefill instances to take the edit", lambda: replicas(bed, "prefill") == 3,
             15, interval_s=0.01)
    bed.restart_apiserver(down_s=3.0)
    bed.wait_converged("every child after the restart")
    assert (replicas(bed, "prefill"), replicas(bed, "decode")) == (3, 3)
    print(f"failed reconciles during the restart: "
          f"{bed.operator.counter('pd_operator_reconciles_total{result=error}') - before:.0f}")
    # The watches came back (kopf restarts an expired one with a fresh listing), so an edit
    # now is seen at once, not at the next resync.
    bed.cluster.patch_spec({"prefill": {"replicas": 2}, "decode": {"replicas": 2}})
    bed.wait("the next edit", lambda: replicas(bed, "decode") == 2, 10)
    assert "Restarting the watch-stream" in bed.all_logs()


def test_a_child_deleted_while_the_watches_were_down_is_recreated(bed: Bed) -> None:
    """Guards against a cache that keeps an object whose deletion no watch delivered: the
    transfer ConfigMap is deleted in etcd itself while the API server is stopped, so no
    DELETED event ever exists (the restarted server's watch cache starts after it, and the
    operator's watches, resuming from before it, are told 410 Gone and list again). The
    operator must notice and create it again."""
    config_map = f"{NAME}-transfer"
    bed.cluster.core.read_namespaced_config_map(config_map, NAMESPACE)
    log_before, restarts_before = len(bed.all_logs()), bed.restarts

    def delete_in_etcd() -> None:
        key = f"/registry/configmaps/{NAMESPACE}/{config_map}".encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{bed.plane.ports.etcd_client}/v3/kv/deleterange",
            data=json.dumps({"key": base64.b64encode(key).decode()}).encode(), method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            assert json.loads(response.read()).get("deleted") == "1"

    bed.restart_apiserver(while_down=delete_in_etcd)
    bed.wait("the ConfigMap to be recreated", lambda: config_map in {
        c.metadata.name for c in bed.cluster.core.list_namespaced_config_map(NAMESPACE).items
        if c.metadata is not None}, 90)
    bed.wait_converged("every child")
    log = bed.all_logs()[log_before:]
    if bed.restarts == restarts_before:
        assert "deleted while the watches were down" in log  # found by the audit, not by luck
    else:  # kopf stopped on a 404 meanwhile: the new process's cache never held it
        print("the operator was restarted; its fresh cache found the ConfigMap missing")


def test_etcd_paused_for_20_s_then_the_edit_completes(bed: Bed) -> None:
    """Guards against a reconcile or a leader election wedged by a storage stall: every
    request hangs for 20 s (the leader cannot renew its Lease and stops writing), then the
    operator takes the Lease again and finishes the edit it was making."""
    bed.cluster.patch_spec({"decode": {"replicas": 3}})
    etcd = bed.pid("etcd")
    os.kill(etcd, signal.SIGSTOP)
    try:
        time.sleep(20)
    finally:
        os.kill(etcd, signal.SIGCONT)
    resumed = time.monotonic()
    bed.wait_converged("every child after etcd resumed", 90)
    print(f"converged {time.monotonic() - resumed:.1f} s after etcd resumed")
    assert replicas(bed, "decode") == 3
    # `bed.operator` is read at each look: a revived operator is another process.
    bed.wait("the operator to lead again", lambda: bed.operator.leads(), 30)  # noqa: PLW0108


def test_a_rival_writer_makes_writes_conflict_and_the_edit_still_lands(bed: Bed) -> None:
    """Guards against a status lost to 409s: another client rewrites the PDDeployment's
    metadata, so the operator's status writes (made with the resourceVersion it read)
    conflict; it re-reads and lands them. The rival writes back to back until the operator
    has seen a conflict (so one surely happens, however loaded the machine), then every
    20 ms while the edit must still land."""
    objects = k8s.CustomObjectsApi(bed.api)
    stop, back_to_back = threading.Event(), threading.Event()
    back_to_back.set()

    def rival() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            objects.patch_namespaced_custom_object(
                "pd.serving.dev", "v1alpha1", NAMESPACE, "pddeployments", NAME,
                {"metadata": {"annotations": {"example.com/rival": str(n)}}})
            if not back_to_back.is_set():
                time.sleep(0.02)

    def conflicted() -> float:
        return bed.operator.counter("pd_operator_reconciles_total{result=conflict}")

    before = conflicted()
    thread = threading.Thread(target=rival, daemon=True)
    thread.start()
    try:
        # A new generation whatever the tests before left: its status must be written.
        bed.cluster.patch_spec({"decode": {"replicas": 3 if replicas(bed, "decode") == 2 else 2}})
        bed.wait("a status write to conflict", lambda: conflicted() > before, 30,
                 interval_s=0.05)
        back_to_back.clear()
        bed.wait_converged("the edit under a rival writer")
    finally:
        stop.set()
        thread.join()
    print(f"conflicted reconciles: {conflicted() - before:.0f}")


def test_throttled_by_priority_and_fairness_it_backs_off_and_converges(bed: Bed) -> None:
    """Guards against an operator that gives up (or hammers) when the API server sheds its
    load: a FlowSchema puts its ServiceAccount in a priority level of one seat that rejects
    what it cannot seat (429); several edits at once still all land."""
    # flowcontrol.apiserver.k8s.io/v1beta1 is what a v1.20 server serves; the client has no
    # typed API for it any more, the generic one builds the same requests.
    objects = k8s.CustomObjectsApi(bed.api)
    flow = ("flowcontrol.apiserver.k8s.io", "v1beta1")
    level = "pd-operator-throttled"
    objects.create_cluster_custom_object(*flow, "prioritylevelconfigurations", {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1beta1",
        "kind": "PriorityLevelConfiguration", "metadata": {"name": level},
        "spec": {"type": "Limited", "limited": {"assuredConcurrencyShares": 1,
                                                "limitResponse": {"type": "Reject"}}}})
    objects.create_cluster_custom_object(*flow, "flowschemas", {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1beta1", "kind": "FlowSchema",
        "metadata": {"name": level},
        "spec": {"priorityLevelConfiguration": {"name": level}, "matchingPrecedence": 100,
                 "rules": [{"subjects": [{"kind": "ServiceAccount", "serviceAccount": {
                     "name": OPERATOR_SA, "namespace": NAMESPACE}}],
                     "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"],
                                        "resources": ["*"], "namespaces": ["*"],
                                        "clusterScope": True}]}]}})
    def done(name: str) -> bool:
        return (bed.cluster.children_match(name) == []
                and bed.cluster.status(name).get("observedGeneration") == 1)

    created: list[str] = []
    try:
        rejected_before, rejected = _rejected(bed, level), 0.0
        # Four at once, whose reconciles run side by side: a burst the one seat refuses
        # some of. A burst may be served one request at a time by chance; up to 3 are made.
        for burst in range(3):
            names = [f"throttled-{burst}-{copy}" for copy in range(4)]
            for name in names:
                body = reference_body(NAMESPACE)
                body["metadata"]["name"] = name
                bed.cluster.create(body)
                created.append(name)
            for name in names:
                bed.wait(f"{name}'s children and status", partial(done, name), 120,
                         interval_s=1.0)
            rejected = _rejected(bed, level) - rejected_before
            print(f"after burst {burst + 1}: requests of the operator refused with 429: "
                  f"{rejected:.0f}")
            if rejected > 0:
                break
        assert rejected > 0
        assert bed.operator.alive
    finally:
        objects.delete_cluster_custom_object(*flow, "flowschemas", level)
        objects.delete_cluster_custom_object(*flow, "prioritylevelconfigurations", level)
        for name in created:
            objects.delete_namespaced_custom_object(
                "pd.serving.dev", "v1alpha1", NAMESPACE, "pddeployments", name)


def test_a_forbidden_kind_is_named_in_degraded_and_recovers_once_granted(bed: Bed) -> None:
    """Guards against silence (or a crash) when RBAC lacks one kind: with networking.k8s.io
    taken away, an edit of the NetworkPolicies is refused; Degraded says which verb on which
    resource, a Warning Event says the same, every other child still follows the spec, and
    once the permission is back the operator finishes by itself."""
    bed.grant(tuple(g for g in GROUPS if g != "networking.k8s.io"))
    try:
        bed.cluster.patch_spec({"decode": {"replicas": 1}})
        k8s.NetworkingV1Api(bed.api).delete_collection_namespaced_network_policy(NAMESPACE)
        degraded: dict[str, Any] = bed.wait("Degraded naming the refused kind", lambda: next(
            (c for c in bed.cluster.status().get("conditions", [])
             if c["type"] == "Degraded" and c["status"] == "True"), None), 60)
        assert "networkpolicies" in degraded["message"] and "forbidden" in degraded["message"]
        assert replicas(bed, "decode") == 1  # the other children followed the edit
        assert bed.operator.alive
    finally:
        bed.grant(GROUPS)
    bed.wait_converged("the NetworkPolicies once granted", 120)


def _rejected(bed: Bed, level: str) -> float:
    request = urllib.request.Request(f"{bed.plane.server_url}/metrics")
    request.add_header("Authorization", f"Bearer {bed.plane.token}")
    context = ssl.create_default_context(cafile=str(bed.plane.ca_path))
    with urllib.request.urlopen(request, context=context, timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("apiserver_flowcontrol_rejected_requests_total{")
               and f'priority_level="{level}"' in line)
