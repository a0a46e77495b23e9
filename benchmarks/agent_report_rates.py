"""Agent report fan-in benchmark (not a test): many TransferAgents reporting, few status writes.

On a fresh local control plane, one reference-engine PDDeployment with 32 prefill and 32
decode pods (pods marked Running/Ready by the script: there is no kubelet); 64 simulated
agents, one thread each, write their TransferAgent status through the real API server with
the per-PDDeployment agent ServiceAccount's token, every `--interval-seconds` (default 10 s,
the default reportIntervalSeconds), starting at random offsets; `--flapping` of them flip
between healthy and failing every other report. The operator runs as its own process.

Measured over `--seconds` (default 60), printed and saved as JSON under benchmarks/results/:
- agent writes per second (the agents' own count, and the API server's
  `apiserver_request_total{resource="transferagents"}` write verbs);
- operator status writes per second: PDDeployment status PUTs and pod transfer-ready
  condition PATCHes, from `pd_operator_status_writes_total` and from the API server's
  counters (`pddeployments/status`, `pods/status`), plus `pd_operator_transfer_reports_total`
  and `pd_operator_status_writes_coalesced_total`.
Run: `.venv/bin/python benchmarks/agent_report_rates.py [--agents 64] [--seconds 60]`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from pd_devcluster import (
    ControlPlaneHandle,
    Ports,
    service_account_kubeconfig,
    start_control_plane,
)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "devtools"))  # the test bed (pd_testbed)
from pd_testbed.kube_factories import make_agent  # noqa: E402

GROUP, VERSION = "pd.serving.dev", "v1alpha1"
NAME, NS = "bench", "default"
WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE")
MIB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def apiserver_writes(handle: ControlPlaneHandle) -> Counter[str]:
    """Write requests the API server served, by resource[/subresource]."""
    request = urllib.request.Request(f"{handle.server_url}/metrics")
    request.add_header("Authorization", f"Bearer {handle.token}")
    context = ssl.create_default_context(cafile=str(handle.ca_path))
    with urllib.request.urlopen(request, context=context, timeout=10) as response:
        text = response.read().decode()
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
        if labels.get("verb") in WRITE_VERBS:
            key = labels.get("resource", "") + (f"/{labels['subresource']}"
                                                if labels.get("subresource") else "")
            counts[key] += int(float(line.rsplit(" ", 1)[1]))
    return counts


def operator_metrics(port: int) -> Counter[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("pd_operator_") and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            kind = re.search(r'kind="([^"]*)"', line)
            key = f"{name}{{{kind.group(1)}}}" if kind and "status_writes" in name else name
            counts[key] += int(float(line.rsplit(" ", 1)[1]))
    return counts


class Agent(threading.Thread):
    """One pod's agent: create its TransferAgent, then report every interval."""

    def __init__(self, path: Path, pod: dict[str, Any], interval_s: float, flapping: bool,
                 stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.api = k8s_config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(path))
        self.pod, self.interval_s, self.flapping, self.stop_event = pod, interval_s, flapping, stop
        self.writes = 0
        self.errors = 0

    def report(self, n: int, objects: k8s.CustomObjectsApi) -> None:
        meta = self.pod["metadata"]
        role = meta["labels"]["pd.serving.dev/role"]
        failing = self.flapping and n % 2 == 1
        body = make_agent(
            meta["name"], role=role, deployment=NAME, namespace=NS, pod_uid=meta["uid"],
            report_time=datetime.now(UTC), healthy=not failing,
            window=(60, 30 if failing else 0),
            window_reasons={"GrantTimeout": 30 if failing else 0},
            totals=(n * 64 * MIB, n * 60, 0),
            ring={"capacityBytes": 16384 * MIB, "usedBytes": random.randint(0, 8000) * MIB,
                  "highWaterBytes": 8000 * MIB} if role == "decode" else {},
            transports=[("peer", "rc")])
        status = body.pop("status")
        if n == 0:
            objects.create_namespaced_custom_object(GROUP, VERSION, NS, "transferagents", body)
            self.writes += 1
        objects.patch_namespaced_custom_object_status(GROUP, VERSION, NS, "transferagents",
                                                      meta["name"], {"status": status})
        self.writes += 1

    def run(self) -> None:
        objects = k8s.CustomObjectsApi(self.api)
        n = 0
        while not self.stop_event.is_set():
            try:
                self.report(n, objects)
            except Exception:
                self.errors += 1
            n += 1
            self.stop_event.wait(self.interval_s)
        self.api.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", type=int, default=64, help="engine pods (half decode)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--interval-seconds", type=float, default=10.0)
    parser.add_argument("--status-interval-seconds", type=float, default=5.0)
    parser.add_argument("--flapping", type=int, default=4)
    args = parser.parse_args()

    state = Path(tempfile.mkdtemp(prefix="pd-bench-agents-"))
    handle = start_control_plane(state, Ports.free(), REPO / "crds", controller_manager=True)
    metrics_port = free_port()
    log = (state / "operator.log").open("w")
    operator = subprocess.Popen(
        [sys.executable, "-m", "pd_operator.cli", "run", "-n", NS, "--kubeconfig",
         str(handle.kubeconfig_path), "--metrics-port", str(metrics_port),
         "--status-interval-seconds", str(args.status_interval_seconds)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    stop = threading.Event()
    try:
        with handle.api_client() as api:
            objects, core = k8s.CustomObjectsApi(api), k8s.CoreV1Api(api)
            body: dict[str, Any] = yaml.safe_load((REPO / "examples/llama-70b.yaml").read_text())
            body["metadata"] = {"name": NAME, "namespace": NS}
            body["spec"]["engine"]["framework"] = "reference"
            body["spec"]["router"] = {"enabled": False}
            body["spec"]["prefill"]["replicas"] = args.agents // 2
            body["spec"]["decode"]["replicas"] = args.agents - args.agents // 2
            time.sleep(3)  # operator start-up (login, discovery, watches)
            objects.create_namespaced_custom_object(GROUP, VERSION, NS, "pddeployments", body)
            selector = f"pd.serving.dev/deployment={NAME},pd.serving.dev/role"
            deadline = time.monotonic() + 300
            while len(pods := core.list_namespaced_pod(NS, label_selector=selector).items) < \
                    args.agents:
                if time.monotonic() > deadline:
                    raise SystemExit(f"only {len(pods)} pods after 300 s")
                time.sleep(1)
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            for pod in pods:
                assert pod.metadata is not None and pod.metadata.name is not None
                core.patch_namespaced_pod_status(pod.metadata.name, NS, {"status": {
                    "phase": "Running", "conditions": [
                        {"type": t, "status": "True", "lastTransitionTime": stamp}
                        for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]}})
            while True:
                try:
                    path = service_account_kubeconfig(handle, NS, f"{NAME}-transfer-agent")
                    break
                except Exception:
                    time.sleep(1)
            time.sleep(3)  # the RoleBinding follows the ServiceAccount
            pod_dicts = [api.sanitize_for_serialization(p) for p in pods]
            agents = [Agent(path, pod, args.interval_seconds, i < args.flapping, stop)
                      for i, pod in enumerate(sorted(pod_dicts,
                                                     key=lambda p: p["metadata"]["name"]))]
            random.seed(1)
            for agent in agents:
                agent.start()
                time.sleep(args.interval_seconds / len(agents))  # spread like real pods
            time.sleep(args.interval_seconds)  # every agent has reported once: steady state
            op0, api0 = operator_metrics(metrics_port), apiserver_writes(handle)
            agent0 = sum(a.writes for a in agents)
            started = time.monotonic()
            time.sleep(args.seconds)
            elapsed = time.monotonic() - started
            op1, api1 = operator_metrics(metrics_port), apiserver_writes(handle)
            agent_writes = sum(a.writes for a in agents) - agent0
            stop.set()
            status = cast(dict[str, Any], objects.get_namespaced_custom_object(
                GROUP, VERSION, NS, "pddeployments", NAME))["status"]

        def rate(n: float) -> float:
            return round(n / elapsed, 3)

        op = {k: op1[k] - op0[k] for k in op1}
        api_delta = {k: api1[k] - api0[k] for k in api1 if api1[k] - api0[k]}
        pdd_writes = op.get("pd_operator_status_writes_total{PDDeployment}", 0)
        pod_writes = op.get("pd_operator_status_writes_total{Pod}", 0)
        result = {
            "agents": args.agents,
            "flapping_agents": args.flapping,
            "agent_report_interval_seconds": args.interval_seconds,
            "operator_status_interval_seconds": args.status_interval_seconds,
            "measured_seconds": round(elapsed, 1),
            "agent_writes": agent_writes,
            "agent_writes_per_second": rate(agent_writes),
            "apiserver_transferagent_writes": api_delta.get("transferagents/status", 0)
            + api_delta.get("transferagents", 0),
            "operator_reports_seen": op.get("pd_operator_transfer_reports_total", 0),
            "operator_triggers_coalesced": op.get("pd_operator_status_writes_coalesced_total", 0),
            "operator_pddeployment_status_writes": pdd_writes,
            "operator_pddeployment_status_writes_per_second": rate(pdd_writes),
            "operator_pod_gate_writes": pod_writes,
            "operator_pod_gate_writes_per_second": rate(pod_writes),
            "operator_all_api_writes": op.get("pd_operator_api_writes_total", 0),
            "apiserver_writes_by_resource": api_delta,
            "agent_errors": sum(a.errors for a in agents),
            "final_transfer_summary": status.get("transfer", {}).get("summary"),
            "final_reporting_pods": status.get("transfer", {}).get("reportingPods"),
            "cpus": os.cpu_count(),
            "kube_apiserver": "v1.20 (local dev cluster)",
        }
        print(json.dumps(result, indent=2))
        out = REPO / "benchmarks" / "results" / \
            f"agent_report_rates-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"saved {out}")
        return 0
    finally:
        stop.set()
        operator.send_signal(signal.SIGINT)
        try:
            operator.wait(timeout=20)
        except subprocess.TimeoutExpired:
            operator.kill()
        handle.stop()


if __name__ == "__main__":
    sys.exit(main())
