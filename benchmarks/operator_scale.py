"""Operator scale benchmark (not a test): 100 PDDeployments on a fresh local control plane.

Measures (printed, and saved as JSON under benchmarks/results/):
- seconds from creating 100 PDDeployments at once until every one has all its children and
  a written status (observedGeneration 1);
- write requests during the following idle period (default 60 s), from the operator's own
  `pd_operator_api_writes_total` and from the API server's `apiserver_request_total`
  (verbs POST/PUT/PATCH/DELETE; the latter also counts the controller-manager's writes, so it
  is an upper bound);
- the operator process's peak RSS (VmHWM).
Run: `.venv/bin/python benchmarks/operator_scale.py [--count 100] [--idle-seconds 60]`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client as k8s

from pd_devcluster import ControlPlaneHandle, Ports, start_control_plane
from pd_operator.api import PDDeployment
from pd_operator.build import Capabilities, build_children

REPO = Path(__file__).resolve().parents[1]
WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def apiserver_writes(handle: ControlPlaneHandle) -> float:
    request = urllib.request.Request(f"{handle.server_url}/metrics")
    request.add_header("Authorization", f"Bearer {handle.token}")
    context = ssl.create_default_context(cafile=str(handle.ca_path))
    with urllib.request.urlopen(request, context=context, timeout=10) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("apiserver_request_total{"):
            verb = re.search(r'verb="([A-Z]+)"', line)
            if verb and verb.group(1) in WRITE_VERBS:
                total += float(line.rsplit(" ", 1)[1])
    return total


def operator_writes(port: int) -> dict[str, float]:
    """The operator's `pd_operator_api_writes_total`, by `verb kind`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pd_operator_api_writes_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
            key = f"{labels.get('verb', '?')} {labels.get('kind', '?')}"
            found[key] = found.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def wait_for_stable_pods(core: k8s.CoreV1Api, *, quiet_s: float, timeout_s: float) -> float:
    """Seconds until the number of pods in `default` has not changed for `quiet_s`."""
    started = last_change = time.monotonic()
    count = -1
    while time.monotonic() - started < timeout_s:
        now_count = len(core.list_namespaced_pod("default").items)
        if now_count != count:
            count, last_change = now_count, time.monotonic()
        elif time.monotonic() - last_change >= quiet_s:
            break
        time.sleep(1.0)
    return time.monotonic() - started


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--timeout-seconds", type=float, default=600.0)
    args = parser.parse_args()

    state = Path(tempfile.mkdtemp(prefix="pd-bench-"))
    handle = start_control_plane(state, Ports.free(), REPO / "crds", controller_manager=True)
    metrics_port = free_port()
    log = (state / "operator.log").open("w")
    operator = subprocess.Popen(
        [sys.executable, "-m", "pd_operator.cli", "run", "-A", "--kubeconfig",
         str(handle.kubeconfig_path), "--metrics-port", str(metrics_port)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        with handle.api_client() as api:
            objects = k8s.CustomObjectsApi(api)
            template: dict[str, Any] = yaml.safe_load((REPO / "examples/llama-70b.yaml")
                                                      .read_text())
            time.sleep(3)  # operator start-up (login, discovery, watches)
            started = time.monotonic()
            for i in range(args.count):
                body = json.loads(json.dumps(template))
                body["metadata"] = {"name": f"bench-{i:03d}", "namespace": "default"}
                objects.create_namespaced_custom_object("pd.serving.dev", "v1alpha1",
                                                        "default", "pddeployments", body)
            expected = {}
            pending = {f"bench-{i:03d}" for i in range(args.count)}
            while pending:
                if time.monotonic() - started > args.timeout_seconds:
                    raise SystemExit(f"{len(pending)} PDDeployments not converged")
                listed: list[dict[str, Any]] = objects.list_namespaced_custom_object(
                    "pd.serving.dev", "v1alpha1", "default", "pddeployments")["items"]  # type: ignore[index]
                for item in listed:
                    if item.get("status", {}).get("observedGeneration") == 1:
                        name = item["metadata"]["name"]
                        expected[name] = len(build_children(PDDeployment.model_validate(item),
                                                            Capabilities(False)))
                sts = k8s.AppsV1Api(api).list_namespaced_stateful_set("default").items
                have = {(s.metadata.labels or {}).get("pd.serving.dev/deployment")
                        for s in sts if s.metadata is not None}
                pending = {n for n in pending if not (n in expected and n in have)}
                time.sleep(0.5)
            converge_s = time.monotonic() - started
            # The controller-manager keeps creating the StatefulSets' pods after that (and
            # each new pod is a status change the operator must write): idle starts once the
            # pod count has not moved for 10 s.
            settle_s = wait_for_stable_pods(k8s.CoreV1Api(api), quiet_s=10.0, timeout_s=300.0)
            op_before, api_before = operator_writes(metrics_port), apiserver_writes(handle)
            time.sleep(args.idle_seconds)
            op_after, api_after = operator_writes(metrics_port), apiserver_writes(handle)
        result = {
            "pddeployments": args.count,
            "converge_seconds": round(converge_s, 2),
            "pods_settled_after_seconds": round(settle_s, 2),
            "idle_seconds": args.idle_seconds,
            "idle_operator_writes": sum(op_after.values()) - sum(op_before.values()),
            "idle_operator_writes_by_kind": {
                key: value - op_before.get(key, 0.0) for key, value in sorted(op_after.items())
                if value != op_before.get(key, 0.0)},
            "idle_apiserver_writes_all_clients": api_after - api_before,
            "operator_peak_rss_mib": round(peak_rss_mib(operator.pid), 1),
            "cpus": os.cpu_count(),
            "kube_apiserver": "v1.20.2 (local dev cluster)",
        }
        print(json.dumps(result, indent=2))
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = REPO / "benchmarks" / "results" / f"operator_scale-{stamp}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"saved {out}")
        return 0
    finally:
        operator.send_signal(signal.SIGINT)
        try:
            operator.wait(timeout=20)
        except subprocess.TimeoutExpired:
            operator.kill()
        handle.stop()


if __name__ == "__main__":
    sys.exit(main())
