"""End to end on this machine: control plane + operator (in-process) + fake kubelet +
reference engines (real processes, real NIXL over loopback) + steady load.

One deployment (examples/local-reference.yaml: 2 prefill TP1 pods, 2 decode TP2 pods,
staged transfers) is brought up once for the module; the tests then run in order:
1. steady load → every pod's TransferAgent reports moved bytes, status.transfer shows the
   totals and a watermark per pod, TransferHealthy=True;
2. dropped grants on one decode pod → TransferHealthy=False naming it, its readiness gate
   False, a Warning Event (docs/failure-modes.md #20);
3. that pod's engine killed → its report turns stale, the pod Unknown (docs/failure-modes.md #22);
4. a second deployment forced onto TCP with RDMA required → TransportVerified=False
   (docs/failure-modes.md #21).
Budget: about 3 minutes on 2 cores, dominated by process start-up and the health windows.
"""

from __future__ import annotations

import json
import random
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s

from pd_devcluster import ControlPlaneHandle
from pd_devcluster.kubelet import FakeKubelet
from pd_devcluster.processes import stop_process
from pd_operator import settings
from pd_operator.workqueue import QueueTuning
from pd_testbed.operator_runner import kopf_runner
from pd_testbed.polling import wait_for
from pd_testbed.rollout_harness import discover_engines
from pd_transfer.reference.load import (
    Engine,
    Engines,
    LoadConfig,
    LoadReport,
    post_json,
    run_load,
)

pytestmark = [pytest.mark.e2e, pytest.mark.nixl, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
GROUP, VERSION = "pd.serving.dev", "v1alpha1"
NAME = "local-reference"
TCP_NAME = "tcp-only"
WINDOW_S, STALE_S = 8, 10
CONCURRENCY = 2  # requests the steady load keeps in flight at most

Obj = dict[str, Any]


def body(namespace: str, name: str = NAME) -> Obj:
    pdd: Obj = yaml.safe_load((REPO / "examples" / "local-reference.yaml").read_text())
    pdd["metadata"] = {"name": name, "namespace": namespace}
    pdd["spec"]["transfer"]["health"] = {"windowSeconds": WINDOW_S, "maxFailureRatio": 0.05,
                                         "reportIntervalSeconds": 5,
                                         "staleAfterSeconds": STALE_S}
    return pdd


@dataclass
class Deployment:
    handle: ControlPlaneHandle
    namespace: str
    objects: k8s.CustomObjectsApi
    core: k8s.CoreV1Api
    kubelet: FakeKubelet
    load_stop: threading.Event
    load_report: LoadReport

    def pdd(self, name: str = NAME) -> Obj:
        got: Obj = self.objects.get_namespaced_custom_object(GROUP, VERSION, self.namespace,
                                                             "pddeployments", name)
        return got

    def condition(self, type_: str, name: str = NAME) -> Obj:
        conditions = (self.pdd(name).get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == type_), {})

    def agents(self, name: str = NAME) -> list[Obj]:
        listed: Obj = self.objects.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "transferagents",
            label_selector=f"pd.serving.dev/deployment={name}")
        return list(listed["items"])

    def instance(self, role: str, index: int) -> str:
        """The name of the role's engine instance of `index`."""
        pods = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"pd.serving.dev/deployment={NAME},"
                                           f"pd.serving.dev/role={role}").items
        return next(p.metadata.name for p in pods
                    if p.metadata.name.rsplit("-", 1)[-1] == str(index))

    def gate(self, pod: str) -> Obj:
        status = self.core.read_namespaced_pod(pod, self.namespace).status
        return next(({"status": c.status, "reason": c.reason} for c in status.conditions or []
                     if c.type == "pd.serving.dev/transfer-ready"), {})


@pytest.fixture(scope="module")
def deployment(control_plane: ControlPlaneHandle, kube_client: k8s.ApiClient,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    core = k8s.CoreV1Api(kube_client)
    namespace = core.create_namespace(k8s.V1Namespace(
        metadata=k8s.V1ObjectMeta(generate_name="pde2e-"))).metadata.name
    objects = k8s.CustomObjectsApi(kube_client)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KUBECONFIG", str(control_plane.kubeconfig_path))
        patch.setattr(settings, "_config", replace(
            settings.current(), kubeconfig=str(control_plane.kubeconfig_path),
            tuning=QueueTuning(workers=2, resync_s=2.0, base_backoff_s=0.2, max_backoff_s=2.0,
                               status_interval_s=1.0)))
        with kopf_runner(["run", "--standalone", "-m", "pd_operator.handlers",
                          "--namespace", namespace], timeout=60) as runner:
            prefix = f"127.{random.randint(100, 250)}.{random.randint(1, 250)}."
            # The node has an RDMA device plugin (rdma/ib, the spec's default resource):
            # the TCP-fallback test runs pods that request it.
            kubelet = FakeKubelet(control_plane, tmp_path_factory.mktemp("kubelet"),
                                  namespace=namespace, ip_prefix=prefix,
                                  extended_resources=("rdma/ib",))
            kubelet_stop = threading.Event()
            kubelet_thread = threading.Thread(target=kubelet.run, args=(kubelet_stop, 0.5),
                                              daemon=True)
            kubelet_thread.start()
            objects.create_namespaced_custom_object(GROUP, VERSION, namespace,
                                                    "pddeployments", body(namespace))
            load_stop, report = threading.Event(), LoadReport()
            config = LoadConfig(namespace=namespace, deployment=NAME, rate=4.0,
                                duration_s=3600, tokens=200, concurrency=CONCURRENCY,
                                timeout_s=10.0,
                                discover_s=2.0, progress_s=30.0)

            def drive() -> None:
                result = run_load(config, discover_engines(kube_client, namespace, NAME),
                                  stop=load_stop)
                report.__dict__.update(result.__dict__)

            load_thread = threading.Thread(target=drive, daemon=True)
            load_thread.start()
            try:
                yield Deployment(control_plane, namespace, objects, core, kubelet, load_stop,
                                 report)
            finally:
                load_stop.set()
                load_thread.join(30)
                kubelet_stop.set()
                kubelet_thread.join(60)
                core.delete_namespace(namespace)
        assert runner.exception is None, runner.output


def test_steady_load_fills_transfer_status_for_every_pod(deployment: Deployment) -> None:
    agents = wait_for("4 TransferAgents reporting moved bytes", lambda: (
        a if len(a := deployment.agents()) == 4
        and all((x.get("status") or {}).get("bytesTotal", 0) > 0 for x in a) else None), 120)
    assert {a["spec"]["role"] for a in agents} == {"prefill", "decode"}
    for agent in agents:
        status = agent["status"]
        assert status["podUID"] == agent["metadata"]["ownerReferences"][0]["uid"]
        assert status["endpoints"]["bootstrap"].startswith(deployment.kubelet.ip_prefix)
        assert status["transports"], f"{agent['metadata']['name']}: no transport seen"
    # Each pod names its ranks' agents (one per rank: TP 1 prefills, TP 2 decodes) and holds
    # state for peers of the other role only, each at the agents that peer reports now.
    own = {a["metadata"]["name"]: a["status"]["agents"] for a in agents}
    for agent in agents:
        name, status = agent["metadata"]["name"], agent["status"]
        assert len(status["agents"]) == (1 if agent["spec"]["role"] == "prefill" else 2), name
        other = "decode" if agent["spec"]["role"] == "prefill" else "prefill"
        assert status["peers"] and all(f"-{other}-" in p["pod"] for p in status["peers"]), name
        assert all(set(p["agents"]) <= set(own[p["pod"]]) for p in status["peers"]), name
    # Every engine's own requests are read (pd_reference_requests_running): never more than
    # the load keeps in flight (2), and not listed unknown.
    for agent in agents:
        name, status = agent["metadata"]["name"], agent["status"]
        assert "engineRequests" not in status.get("unknown", []), name
        assert 0 <= status["engineRequests"] <= CONCURRENCY, (name, status["engineRequests"])
    _held_prefill_is_reported(deployment)
    transfer = wait_for("status.transfer with a watermark per pod and TransferHealthy=True",
                        lambda: _healthy_transfer(deployment), 60)
    assert transfer["totals"]["bytes"] > 0
    assert transfer.get("stalePeers", []) == []
    decode_pools = [w for w in transfer["watermarks"] if w["role"] == "decode"]
    assert decode_pools and all(w["poolMiB"] > 0 for w in decode_pools)
    assert deployment.load_report.succeeded > 0 or deployment.load_report.requests == 0


def _held_prefill_is_reported(deployment: Deployment) -> None:
    """A prefill request the test holds (the reference answers a prefill once its decode
    pulled the KV, and the test sends that decode only later) is in its pod's
    engineRequests at the next report, load or no load; then it completes."""
    statuses = {a["metadata"]["name"]: a["status"] for a in deployment.agents()}
    first = deployment.instance("prefill", 0)
    prefill, decode = statuses[first], statuses[deployment.instance("decode", 0)]
    room, timeout_s = f"held-{random.getrandbits(48):012x}", 60.0
    with ThreadPoolExecutor(max_workers=1) as side:
        sent = side.submit(post_json, prefill["endpoints"]["engine"], "/v1/prefill",
                           {"room": room, "num_tokens": 64,
                            "decode": [decode["endpoints"]["bootstrap"]],
                            "timeout_seconds": timeout_s}, timeout_s + 10)
        held_from = datetime.now(UTC)

        def held_report() -> Obj | None:
            status = next(a["status"] for a in deployment.agents()
                          if a["metadata"]["name"] == first)
            written = datetime.fromisoformat(status["reportTime"].replace("Z", "+00:00"))
            return status if written > held_from + timedelta(seconds=1) else None

        status = wait_for(f"{first} reporting after the request was held",
                          held_report, 30)
        got = post_json(decode["endpoints"]["engine"], "/v1/decode",
                        {"room": room, "num_tokens": 64,
                         "prefill": [prefill["endpoints"]["bootstrap"]],
                         "timeout_seconds": timeout_s}, timeout_s + 10)
        assert (got["state"], sent.result()["state"]) == ("Succeeded", "Succeeded"), got
    assert 1 <= status["engineRequests"] <= 1 + CONCURRENCY, status["engineRequests"]


def _healthy_transfer(deployment: Deployment) -> Obj | None:
    transfer = (deployment.pdd().get("status") or {}).get("transfer") or {}
    pods = {w["pod"] for w in transfer.get("watermarks") or []}
    healthy = deployment.condition("TransferHealthy").get("status") == "True"
    return transfer if len(pods) == 4 and healthy and transfer["totals"]["bytes"] > 0 else None


def _engine_of(deployment: Deployment, pod: str) -> str:
    agent = next(a for a in deployment.agents() if a["metadata"]["name"] == pod)
    return str(agent["status"]["endpoints"]["engine"])


def test_failing_decode_pod_turns_transfer_health_false(deployment: Deployment) -> None:
    pod = deployment.instance("decode", 0)
    request = urllib.request.Request(
        f"http://{_engine_of(deployment, pod)}/v1/faults",
        data=json.dumps({"set": {"drop_grants": 1.0}}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert json.loads(response.read()) == {"faults": {"drop_grants": 1.0}}
    condition = wait_for("TransferHealthy=False", lambda: (
        c if (c := deployment.condition("TransferHealthy")).get("status") == "False"
        else None), WINDOW_S + 30)
    assert pod in condition["message"], condition
    gate = wait_for(f"{pod}'s readiness gate False",
                    lambda: g if (g := deployment.gate(pod)).get("status") == "False" else None,
                    30)
    assert gate["reason"] == "TransferFailing"
    # Events follow the status write and the gate patches: wait for it, do not race it.
    wait_for("a Warning Event: TransferHealthy is False", lambda: any(
        e.type == "Warning" and "TransferHealthy is False" in (e.message or "")
        for e in deployment.core.list_namespaced_event(deployment.namespace).items), 15)


def test_killed_engine_report_turns_stale(deployment: Deployment) -> None:
    pod = deployment.instance("decode", 1)
    record = deployment.kubelet.process_of(deployment.namespace, pod)
    assert record is not None
    stop_process(record, grace_s=0.0)  # SIGTERM then SIGKILL at once: the agent stops too
    stale = wait_for(f"{pod} listed stale", lambda: (
        t if pod in (t := (deployment.pdd().get("status") or {}).get("transfer") or {}).get(
            "stalePods", []) else None), STALE_S + 30)
    assert pod in stale["stalePods"]
    gate = wait_for(f"{pod}'s gate ReportStale", lambda: (
        g if (g := deployment.gate(pod)).get("reason") == "ReportStale" else None), 20)
    assert gate["status"] == "False"


def test_tcp_with_rdma_required_is_not_verified(deployment: Deployment) -> None:
    deployment.load_stop.set()  # free the cores for the second deployment
    deployment.objects.delete_namespaced_custom_object(GROUP, VERSION, deployment.namespace,
                                                       "pddeployments", NAME)
    tcp = body(deployment.namespace, TCP_NAME)
    tcp["spec"]["prefill"]["replicas"] = 1
    tcp["spec"]["decode"]["replicas"] = 1
    tcp["spec"]["network"] = {"rdma": {"enabled": True, "required": True}}
    tcp["spec"]["transfer"]["transport"] = {"ucxTransports": ["tcp"]}
    deployment.objects.create_namespaced_custom_object(GROUP, VERSION, deployment.namespace,
                                                       "pddeployments", tcp)
    agents = wait_for("both tcp-only engines reporting", lambda: (
        a if len(a := deployment.agents(TCP_NAME)) == 2 and all(
            (x.get("status") or {}).get("endpoints", {}).get("engine") for x in a) else None),
        120)
    # Its pods are not Ready (RDMA required, none verified): the load is given them as
    # their TransferAgents report them.
    engines = Engines(*(tuple(Engine(a["metadata"]["name"], a["status"]["endpoints"]["engine"],
                                     a["status"]["endpoints"]["bootstrap"])
                              for a in agents if a["spec"]["role"] == role)
                        for role in ("prefill", "decode")))
    report = run_load(LoadConfig(namespace=deployment.namespace, deployment=TCP_NAME,
                                 rate=5.0, duration_s=3.0, tokens=64, concurrency=1),
                      lambda: engines, say=lambda _: None)
    assert report.succeeded > 0, report.to_json()
    condition = wait_for("TransportVerified=False", lambda: (
        c if (c := deployment.condition("TransportVerified", TCP_NAME)).get("status")
        == "False" else None), 60)
    assert condition["reason"] == "TCPFallback" and "tcp" in condition["message"]
