"""Transfer health end to end against a real API server: pods' agents write TransferAgents
with their own ServiceAccount's token, the operator (in-process) aggregates them into
`status.transfer`, the transfer conditions, the pods' readiness gates and Events.

There is no kubelet: the test marks pods Running/Ready itself and plays the agents,
writing each report as the in-pod agent does (create the TransferAgent, then its status).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from kopf.testing import KopfRunner
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from pd_devcluster import ControlPlaneHandle
from pd_operator.build.names import TRANSFER_READY_CONDITION, agent_service_account
from pd_testbed.cluster import NAME, STALE_AFTER_S, Cluster, agent_api_client, reference_body
from pd_testbed.kube_factories import make_agent
from pd_testbed.polling import wait_for

pytestmark = [pytest.mark.apiserver, pytest.mark.timeout(120)]

GROUP, VERSION, AGENTS = "pd.serving.dev", "v1alpha1", "transferagents"
MIB = 1024 * 1024
RING = {"capacityBytes": 16384 * MIB, "usedBytes": 512 * MIB, "highWaterBytes": 3000 * MIB}

Obj = dict[str, Any]


class Agents:
    """The pods' agents, writing with the per-PDDeployment agent ServiceAccount's token."""

    def __init__(self, api: k8s.ApiClient, namespace: str, pods: list[Obj]) -> None:
        self.objects = k8s.CustomObjectsApi(api)
        self.ns = namespace
        self.pods = {p["metadata"]["name"]: p for p in pods}
        self.last: dict[str, Obj] = {}

    def report(self, pod: str, **fields: Any) -> None:
        """Write one report of `pod` (created on first use), fields as for `make_agent`."""
        meta = self.pods[pod]["metadata"]
        role = meta["labels"]["pd.serving.dev/role"]
        fields = {"ring": RING if role == "decode" else {},
                  "transports": [("peer", "rc")], "window": (50, 0),
                  "totals": (100 * MIB, 500, 0), **fields}
        body = make_agent(pod, role=role, deployment=NAME, namespace=self.ns,
                          pod_uid=meta["uid"], report_time=datetime.now(UTC), **fields)
        status = body.pop("status")
        if pod not in self.last:
            try:
                self.objects.create_namespaced_custom_object(GROUP, VERSION, self.ns, AGENTS,
                                                             body)
            except ApiException as exc:
                if exc.status != 409:
                    raise
        self.objects.patch_namespaced_custom_object_status(GROUP, VERSION, self.ns, AGENTS,
                                                           pod, {"status": status})
        self.last[pod] = fields

    def refresh(self, *pods: str) -> None:
        for pod in pods:
            self.report(pod, **self.last[pod])


def start_fleet(control_plane: ControlPlaneHandle, cluster: Cluster) -> Agents:
    """Create the PDDeployment, wait for its 4 pods and the agent identity, mark pods Ready
    and have every agent report healthy."""
    cluster.create(reference_body(cluster.ns))
    wait_for("4 engine pods", lambda: cluster.pods() if len(cluster.pods()) == 4
                    else None)
    wait_for("the agent ServiceAccount and its RoleBinding", lambda: len([
        k for k in cluster.live() if k[3] == agent_service_account(NAME)]) == 3)
    cluster.mark_all_ready()
    agents = Agents(agent_api_client(control_plane, cluster.ns), cluster.ns, cluster.pods())
    for pod in sorted(agents.pods):
        agents.report(pod)
    return agents


def gate(cluster: Cluster, pod: str) -> Obj:
    body = cluster.core.read_namespaced_pod_status(pod, cluster.ns).to_dict()
    for c in body["status"].get("conditions") or []:
        if c["type"] == TRANSFER_READY_CONDITION:
            return dict(c)
    return {}


def refreshing(agents: Agents, pods: tuple[str, ...], probe: Callable[[], Any]) -> \
        Callable[[], Any]:
    """`probe`, with `pods`' agents re-reporting every 2 s meanwhile (as live agents do)."""
    last = [0.0]

    def run() -> Any:
        if time.monotonic() - last[0] > 2.0:
            agents.refresh(*pods)
            last[0] = time.monotonic()
        return probe()

    return run


def test_reports_aggregate_and_a_failing_decode_pod_turns_health_false(
        reporting_operator: KopfRunner, control_plane: ControlPlaneHandle,
        cluster: Cluster) -> None:
    """Bytes and watermarks of every pod reach status.transfer; one decode pod failing turns
    TransferHealthy False with its reason and name, its gate False and a Warning Event.
    Guards against docs/failure-modes.md #20: every pod Ready while transfers fail."""
    agents = start_fleet(control_plane, cluster)
    pods = sorted(agents.pods)
    wait_for("TransferHealthy=True",
             lambda: cluster.condition("TransferHealthy").get("status") == "True")
    transfer = wait_for("4 reporting pods", lambda: cluster.status()["transfer"] if cluster
                        .status().get("transfer", {}).get("reportingPods") == 4 else None)
    assert transfer["totals"]["bytes"] == 4 * 100 * MIB
    assert sorted(w["pod"] for w in transfer["watermarks"]) == pods
    decode_marks = [w for w in transfer["watermarks"] if w["role"] == "decode"]
    assert all(w["poolMiB"] == 4096 and w["highWaterMiB"] == 3000.0 for w in decode_marks)
    assert transfer["summary"] == "Healthy"
    assert cluster.condition("TransportVerified")["status"] == "True"
    assert cluster.condition("StagingPoolReady")["status"] == "True"
    wait_for("every pod's transfer gate True",
             lambda: all(gate(cluster, p).get("status") == "True" for p in pods))
    wait_for("Ready=True", lambda: cluster.condition("Ready").get("status") == "True")

    failing = cluster.instance("decode", 1)
    agents.report(failing, window=(40, 30), healthy=False,
                  window_reasons={"GrantTimeout": 30}, last_error="no grant in 10 s")
    healthy = wait_for("TransferHealthy=False", lambda: cluster.condition("TransferHealthy")
                       if cluster.condition("TransferHealthy").get("status") == "False"
                       else None, timeout_s=STALE_AFTER_S)  # within the report's freshness
    assert healthy["reason"] == "GrantTimeout"
    assert failing in healthy["message"]
    # Already False: the operator writes the pods' gates before the status that reports them.
    assert gate(cluster, failing)["status"] == "False"
    assert gate(cluster, failing)["reason"] == "TransferFailing"
    assert gate(cluster, cluster.instance("decode", 0))["status"] == "True"
    assert cluster.condition("Ready")["reason"] == "TransferUnhealthy"
    assert cluster.status()["transfer"]["summary"].startswith("Failing")

    def warning() -> list[Any]:
        return [e for e in cluster.core.list_namespaced_event(cluster.ns).items
                if e.type == "Warning" and e.reason == "TransferFailing"
                and failing in (e.message or "") and e.involved_object.name == NAME]

    wait_for("a Warning Event naming the pod", warning)


def test_silent_agent_turns_unknown_and_tcp_fallback_is_caught(
        reporting_operator: KopfRunner, control_plane: ControlPlaneHandle,
        cluster: Cluster) -> None:
    """A pod whose agent stops reporting becomes Unknown after staleAfterSeconds (its gate
    False ReportStale), never stale-healthy (docs/failure-modes.md #22); a pod reporting tcp while
    RDMA
    is required turns TransportVerified False naming it (docs/failure-modes.md #21)."""
    agents = start_fleet(control_plane, cluster)
    wait_for("TransferHealthy=True",
             lambda: cluster.condition("TransferHealthy").get("status") == "True")
    silent = cluster.instance("prefill", 1)
    others = tuple(p for p in sorted(agents.pods) if p != silent)
    fallback = cluster.instance("decode", 0)
    agents.report(fallback, transports=[(cluster.instance("prefill", 0), "tcp")])

    verified = wait_for("TransportVerified=False", refreshing(agents, others, lambda: (
        cluster.condition("TransportVerified")
        if cluster.condition("TransportVerified").get("status") == "False" else None)))
    assert verified["reason"] == "TCPFallback"
    assert f"{fallback} uses tcp" in verified["message"]

    healthy = wait_for("the silent pod's report to turn stale", refreshing(
        agents, others, lambda: cluster.condition("TransferHealthy")
        if cluster.condition("TransferHealthy").get("status") == "Unknown" else None),
        timeout_s=STALE_AFTER_S + 15)
    assert healthy["reason"] == "ReportsStale" and silent in healthy["message"]
    assert cluster.status()["transfer"]["stalePods"] == [silent]
    assert cluster.status()["transfer"]["summary"] == "Unknown"
    wait_for("the silent pod's gate False", refreshing(agents, others, lambda: gate(
        cluster, silent).get("reason") == "ReportStale"))
    assert gate(cluster, silent)["status"] == "False"
    assert all(gate(cluster, p)["status"] == "True" for p in others)


def test_gates_follow_reports_while_a_spec_update_is_refused(
        reporting_operator: KopfRunner, control_plane: ControlPlaneHandle,
        cluster: Cluster) -> None:
    """A refused spec update leaves the last valid generation's pods serving, so their
    transfer gates keep following their reports: a pod that recovers gets its gate back, a
    pod that starts failing loses it (docs/failure-modes.md #36)."""
    agents = start_fleet(control_plane, cluster)
    pods = tuple(sorted(agents.pods))
    wait_for("every pod's transfer gate True",
             lambda: all(gate(cluster, p).get("status") == "True" for p in pods))
    recovering, breaking = cluster.instance("decode", 1), cluster.instance("prefill", 0)
    agents.report(recovering, window=(40, 30), healthy=False,
                  window_reasons={"GrantTimeout": 30}, last_error="no grant in 10 s")
    wait_for(f"{recovering}'s gate False", refreshing(agents, pods, lambda: gate(
        cluster, recovering).get("status") == "False"), timeout_s=STALE_AFTER_S)

    cluster.patch_spec({"prefill": {"parallelism": {"tensor": 3}}})  # 8 KV heads over 3 ranks
    wait_for("SpecValid=False", refreshing(agents, pods, lambda: cluster.condition(
        "SpecValid").get("status") == "False"))
    agents.report(recovering, window=(50, 0), healthy=True, window_reasons={},
                  last_error="")
    wait_for(f"{recovering}'s gate True again, the spec still invalid", refreshing(
        agents, pods, lambda: gate(cluster, recovering).get("status") == "True"),
        timeout_s=STALE_AFTER_S)
    agents.report(breaking, window=(40, 30), healthy=False,
                  window_reasons={"GrantTimeout": 30}, last_error="no grant in 10 s")
    failing = wait_for(f"{breaking}'s gate False, the spec still invalid", refreshing(
        agents, pods, lambda: (g if (g := gate(cluster, breaking)).get("status") == "False"
                               else None)), timeout_s=STALE_AFTER_S)
    assert failing["reason"] == "TransferFailing"
    assert cluster.condition("SpecValid")["status"] == "False"
    assert cluster.status()["phase"] == "Invalid"
    assert {p: gate(cluster, p)["status"] for p in pods} == {
        cluster.instance("decode", 0): "True", cluster.instance("decode", 1): "True",
        cluster.instance("prefill", 0): "False", cluster.instance("prefill", 1): "True"}
