"""Operator scale benchmark (not a test): many PDDeployments on a fresh local control plane
(etcd, kube-apiserver, kube-controller-manager: the operator creates every engine instance's
pod and the Deployment controller the routers'; every pod stays Pending: there is no
scheduler or kubelet).

The operator runs as the chart runs it (`pd-operator run -A --leader-elect`, one replica).
PDDeployments are the repository's examples, varied (each example in turn, every third one
with other replica counts), in four namespaces. Two phases in one run:
1. `--first` (100) PDDeployments created at once: seconds until every one has its children
   (every engine instance's pod of both roles, and the router Deployment where it has one)
   and a written status (`status.observedGeneration` == `metadata.generation`);
2. `--count` (1000) more, created at once beside the first ones, measured the same way,
   with what they cost per PDDeployment: CPU seconds of every process (the operator, etcd,
   the API server, the controller-manager), the API server's requests (all clients) and the
   operator's own writes;
then, once the pod count has settled and the operator has sent no write for 20 s (the
reconciles the last pods' events queued, done; the time and the writes are reported):
- writes during `--idle-seconds` (60): the operator's own (`pd_operator_api_writes_total`,
  Lease renewals reported apart) and the API server's for all clients;
- the operator's peak and current RSS;
- `--edits` (40) edits one after another, each a PDDeployment's decode replicas changed:
  seconds from the PATCH until its decode instances number the new count (p50/p99/max);
- a check, once, that every PDDeployment's children are exactly what the builders make.
Results are printed and saved as JSON under benchmarks/results/.
Run: `.venv/bin/python benchmarks/operator_scale.py [--first 100] [--count 1000]`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client as k8s
from prometheus_client.parser import text_string_to_metric_families

from pd_devcluster import ControlPlaneHandle, Ports, start_control_plane
from pd_operator.api import parse_pdd
from pd_operator.api.naming import transfer_key_name
from pd_operator.build import Capabilities, build_children, child_key
from pd_testbed.operator_process import OperatorProcess

REPO = Path(__file__).resolve().parents[1]
WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE")
GROUP, VERSION, PLURAL = "pd.serving.dev", "v1alpha1", "pddeployments"
NAMESPACES = ("bench-a", "bench-b", "bench-c", "bench-d")
EXAMPLES = ("llama-70b.yaml", "deepseek-v3-mla.yaml", "qwen3-8b-vllm.yaml",
            "local-reference.yaml", "local-vllm.yaml")
METADATA_LIST = "application/json;as=PartialObjectMetadataList;v=v1;g=meta.k8s.io"
# v1.20 serves no policy/v1: the operator makes no PDBs there.
CAPS = Capabilities(pod_disruption_budgets=False)
Obj = dict[str, Any]


def apiserver_requests(handle: ControlPlaneHandle) -> dict[str, float]:
    """The API server's `apiserver_request_total` by `VERB resource[/subresource]`, all
    clients."""
    request = urllib.request.Request(f"{handle.server_url}/metrics")
    request.add_header("Authorization", f"Bearer {handle.token}")
    context = ssl.create_default_context(cafile=str(handle.ca_path))
    with urllib.request.urlopen(request, context=context, timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("apiserver_request_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
            sub = f"/{labels['subresource']}" if labels.get("subresource") else ""
            key = f"{labels.get('verb')} {labels.get('resource')}{sub}"
            found[key] = found.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def apiserver_writes(handle: ControlPlaneHandle) -> float:
    return sum(v for k, v in apiserver_requests(handle).items()
               if k.split(" ")[0] in (*WRITE_VERBS, "APPLY"))


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds each process has used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    used = {}
    for name, pid in pids.items():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        used[name] = (int(fields[11]) + int(fields[12])) / tick
    return used


def per_item(after: dict[str, float], before: dict[str, float], items: int,
             least: float = 0.1) -> dict[str, float]:
    """What each key grew by, per item, for the keys that grew by `least` per item or more."""
    return {k: round((v - before.get(k, 0.0)) / items, 3) for k, v in sorted(after.items())
            if v - before.get(k, 0.0) >= items * least}


def operator_writes(port: int) -> dict[str, float]:
    """The operator's `pd_operator_api_writes_total`, by `verb kind`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pd_operator_api_writes_total":
                key = f"{sample.labels['verb']} {sample.labels['kind']}"
                found[key] = found.get(key, 0.0) + sample.value
    return found


def rss_mib(pid: int) -> tuple[float, float]:
    """(peak, current) resident set of `pid`, MiB."""
    fields = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return (int(fields["VmHWM"].split()[0]) / 1024, int(fields["VmRSS"].split()[0]) / 1024)


def bodies(first: int, count: int) -> list[Obj]:
    """`first + count` PDDeployments: the examples in turn, every third with other counts."""
    templates = [next(doc for doc in yaml.safe_load_all((REPO / "examples" / name).read_text())
                      if doc and doc.get("kind") == "PDDeployment") for name in EXAMPLES]
    made = []
    for i in range(first + count):
        body: Obj = json.loads(json.dumps(templates[i % len(templates)]))
        body["metadata"] = {"name": f"pdd-{i:04d}", "namespace": NAMESPACES[i % len(NAMESPACES)]}
        if i % 3 == 0:
            body["spec"]["prefill"]["replicas"] = 1 + i % 2
            body["spec"]["decode"]["replicas"] = 1 + (i // 3) % 3
        made.append(body)
    return made


def converged(api: k8s.ApiClient, wanted: dict[tuple[str, str], set[str]]) -> set[tuple[str, str]]:
    """The wanted PDDeployments with a current status and their workloads. Read from the API
    server's watch cache (resourceVersion 0) as raw JSON, so that polling a thousand objects
    costs the API server and this process little."""
    objects, apps, core = k8s.CustomObjectsApi(api), k8s.AppsV1Api(api), k8s.CoreV1Api(api)

    def items(response: Any) -> list[Obj]:
        listed: list[Obj] = json.loads(response.data)["items"]
        return listed

    done = set()
    for namespace in NAMESPACES:
        listed = items(objects.list_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, resource_version="0", _preload_content=False))
        current = {item["metadata"]["name"] for item in listed
                   if (item.get("status") or {}).get("observedGeneration")
                   == item["metadata"]["generation"]}
        have = {f"Deployment/{d['metadata']['name']}" for d in items(
            apps.list_namespaced_deployment(namespace, resource_version="0",
                                            _preload_content=False))}
        # One engine instance per pod: `Pods/<deployment>-<role>/<count>`; the pods'
        # metadata only (a PartialObjectMetadataList), so polling four thousand of them
        # costs the API server a fraction of their whole objects.
        counts: dict[str, int] = {}
        for pod in items(core.list_namespaced_pod(
                namespace, resource_version="0", label_selector="pd.serving.dev/role",
                _preload_content=False, _headers={"Accept": METADATA_LIST})):
            labels = pod["metadata"]["labels"]
            key = f"{labels['pd.serving.dev/deployment']}-{labels['pd.serving.dev/role']}"
            counts[key] = counts.get(key, 0) + 1
        have |= {f"Pods/{key}/{n}" for key, n in counts.items()}
        for (ns, name), workloads in wanted.items():
            if ns == namespace and name in current and workloads <= have:
                done.add((ns, name))
    return done


def workloads(body: Obj) -> set[str]:
    """The router Deployment where there is one, and each role's count of pods."""
    pdd = parse_pdd(body)
    name = pdd.metadata.name
    return ({f"{c['kind']}/{c['metadata']['name']}" for c in build_children(pdd, CAPS)
             if c["kind"] == "Deployment"}
            | {f"Pods/{name}-prefill/{pdd.spec.prefill.replicas}",
               f"Pods/{name}-decode/{pdd.spec.decode.replicas}"})


def create_and_wait(api: k8s.ApiClient, batch: list[Obj], timeout_s: float) -> float:
    objects = k8s.CustomObjectsApi(api)
    wanted = {(b["metadata"]["namespace"], b["metadata"]["name"]): workloads(b) for b in batch}
    started = time.monotonic()
    for body in batch:
        objects.create_namespaced_custom_object(GROUP, VERSION, body["metadata"]["namespace"],
                                                PLURAL, body)
    created_s = time.monotonic() - started
    pending = set(wanted)
    while pending:
        elapsed = time.monotonic() - started
        if elapsed > timeout_s:
            raise SystemExit(f"{len(pending)} of {len(batch)} PDDeployments not converged "
                             f"after {timeout_s:.0f} s")
        time.sleep(1.0)
        pending -= converged(api, {k: wanted[k] for k in pending})
        print(f"  {elapsed:6.1f} s: {len(batch) - len(pending)}/{len(batch)} converged "
              f"(creates took {created_s:.1f} s)", flush=True)
    return time.monotonic() - started


def wait_for_stable_pods(core: k8s.CoreV1Api, *, quiet_s: float, timeout_s: float) -> int:
    started = last_change = time.monotonic()
    count = -1
    while time.monotonic() - started < timeout_s:
        now_count = len(core.list_pod_for_all_namespaces(resource_version="0").items)
        if now_count != count:
            count, last_change = now_count, time.monotonic()
        elif time.monotonic() - last_change >= quiet_s:
            break
        time.sleep(2.0)
    return count


def wait_for_operator_quiet(port: int, *, quiet_s: float, timeout_s: float) -> tuple[float, float]:
    """Seconds until the operator has sent no write (its Lease aside) for `quiet_s`, and
    the writes it sent meanwhile: the reconciles queued by the last pods' events, done."""
    def writes() -> float:
        return sum(v for k, v in operator_writes(port).items() if not k.endswith(" Lease"))

    started = last_change = time.monotonic()
    first = count = writes()
    while time.monotonic() - started < timeout_s:
        time.sleep(2.0)
        now_count = writes()
        if now_count != count:
            count, last_change = now_count, time.monotonic()
        elif time.monotonic() - last_change >= quiet_s:
            break
    return time.monotonic() - started, count - first


def edit_latencies(api: k8s.ApiClient, names: list[tuple[str, str]], edits: int) -> list[float]:
    """Seconds from each decode-replicas PATCH until the decode role has that many instances
    (pods not being deleted: without a node, a deleted pod is gone at once)."""
    objects, core = k8s.CustomObjectsApi(api), k8s.CoreV1Api(api)
    rng = random.Random(7)
    latencies = []

    def decodes(namespace: str, name: str) -> int:
        pods = core.list_namespaced_pod(namespace, label_selector=(
            f"pd.serving.dev/deployment={name},pd.serving.dev/role=decode")).items
        return sum(1 for p in pods if p.metadata is not None
                   and p.metadata.deletion_timestamp is None)

    for namespace, name in rng.sample(names, edits):
        replicas = decodes(namespace, name)
        wanted = 1 if replicas != 1 else 2
        started = time.monotonic()
        objects.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                               {"spec": {"decode": {"replicas": wanted}}})
        while decodes(namespace, name) != wanted:
            if time.monotonic() - started > 60:
                raise SystemExit(f"edit of {namespace}/{name} not reconciled in 60 s")
            time.sleep(0.02)
        latencies.append(time.monotonic() - started)
    return latencies


def children_exact(kube_api: k8s.ApiClient, batch: list[Obj]) -> list[str]:
    """Problems: children missing, or not the builders' (kinds and names). The engine
    instances (`converged` counts them) and their templates' records are not applied
    children."""
    from pd_operator.kube import CHILD_KINDS, CONTROLLER_REVISIONS, PDB, KubeClient  # noqa: PLC0415

    kube = KubeClient(kube_api)
    kinds = tuple(k for k in CHILD_KINDS if k not in (PDB, CONTROLLER_REVISIONS))
    objects = k8s.CustomObjectsApi(kube_api)
    problems = []
    for namespace in NAMESPACES:
        live: dict[str, set[tuple[Any, ...]]] = {}
        for obj in kube.list_children(namespace, "app.kubernetes.io/managed-by=pd-operator",
                                      kinds):
            owner = obj["metadata"]["labels"].get("pd.serving.dev/deployment", "")
            live.setdefault(owner, set()).add(child_key(obj))
        for body in (b for b in batch if b["metadata"]["namespace"] == namespace):
            name = body["metadata"]["name"]
            stored: Obj = objects.get_namespaced_custom_object(  # type: ignore[assignment]
                GROUP, VERSION, namespace, PLURAL, name)
            want = {child_key(c) for c in build_children(parse_pdd(stored), CAPS)}
            want.add(("v1", "Secret", namespace, transfer_key_name(name)))
            have = live.get(name, set())
            if have != want:
                problems.append(f"{namespace}/{name}: missing {sorted(want - have)}, "
                                f"extra {sorted(have - want)}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--first", type=int, default=100)
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--edits", type=int, default=40)
    parser.add_argument("--timeout-seconds", type=float, default=900.0)
    args = parser.parse_args()

    state = Path(tempfile.mkdtemp(prefix="pd-bench-"))
    handle = start_control_plane(state, Ports.free(), REPO / "crds", controller_manager=True)
    with handle.api_client() as api:
        core = k8s.CoreV1Api(api)
        for namespace in (*NAMESPACES, "pd-system"):
            core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=namespace)))
    # As the chart runs it: every namespace, leader election (its Lease in pd-system).
    operator = OperatorProcess.start(handle, "pd-system", "bench", state, all_namespaces=True)
    metrics_port = operator.metrics_port
    try:
        with handle.api_client() as api:
            made = bodies(args.first, args.count)
            time.sleep(5)  # operator start-up: login, watches, the Lease
            print(f"phase 1: {args.first} PDDeployments", flush=True)
            first_s = create_and_wait(api, made[:args.first], args.timeout_seconds)
            print(f"phase 2: {args.count} more", flush=True)
            pids = {"operator": operator.process.pid,
                    **{p.name: p.pid for p in handle.processes}}
            cpu_before, requests_before = cpu_seconds(pids), apiserver_requests(handle)
            writes_before = operator_writes(metrics_port)
            second_s = create_and_wait(api, made[args.first:], args.timeout_seconds)
            cpu_after, requests_after = cpu_seconds(pids), apiserver_requests(handle)
            writes_after = operator_writes(metrics_port)
            settle_started = time.monotonic()
            pods = wait_for_stable_pods(k8s.CoreV1Api(api), quiet_s=15.0, timeout_s=900.0)
            settle_s = time.monotonic() - settle_started
            quiet_s, catch_up_writes = wait_for_operator_quiet(metrics_port, quiet_s=20.0,
                                                              timeout_s=900.0)
            op_before, api_before = operator_writes(metrics_port), apiserver_writes(handle)
            time.sleep(args.idle_seconds)
            op_after, api_after = operator_writes(metrics_port), apiserver_writes(handle)
            peak, current = rss_mib(operator.process.pid)
            names = [(b["metadata"]["namespace"], b["metadata"]["name"]) for b in made]
            latencies = sorted(edit_latencies(api, names, args.edits))
            problems = children_exact(api, made)
        idle = {key: value - op_before.get(key, 0.0) for key, value in sorted(op_after.items())
                if value != op_before.get(key, 0.0)}
        result = {
            "first_pddeployments": args.first,
            "first_converge_seconds": round(first_s, 1),
            "more_pddeployments": args.count,
            "more_converge_seconds": round(second_s, 1),
            "more_cpu_seconds_per_pddeployment": per_item(cpu_after, cpu_before, args.count,
                                                          least=0.0),
            "more_requests_per_pddeployment_all_clients": per_item(
                requests_after, requests_before, args.count),
            "more_operator_writes_per_pddeployment": per_item(
                writes_after, writes_before, args.count, least=0.0),
            "more_operator_writes_total_per_pddeployment": round(sum(
                v - writes_before.get(k, 0.0) for k, v in writes_after.items()
                if not k.endswith(" Lease")) / args.count, 2),
            "more_apiserver_writes_per_pddeployment_all_clients": round(sum(
                v - requests_before.get(k, 0.0) for k, v in requests_after.items()
                if k.split(" ")[0] in (*WRITE_VERBS, "APPLY")) / args.count, 2),
            "pods_at_rest": pods,
            "pods_settled_after_seconds": round(settle_s, 1),
            "operator_quiet_after_seconds": round(quiet_s, 1),
            "operator_writes_until_quiet": catch_up_writes,
            "idle_seconds": args.idle_seconds,
            "idle_operator_writes": sum(v for k, v in idle.items() if not k.endswith(" Lease")),
            "idle_operator_lease_writes": sum(v for k, v in idle.items() if k.endswith(" Lease")),
            "idle_operator_writes_by_kind": idle,
            "idle_apiserver_writes_all_clients": api_after - api_before,
            "operator_peak_rss_mib": round(peak, 1),
            "operator_rss_mib_at_rest": round(current, 1),
            "edits": len(latencies),
            "edit_seconds_p50": round(statistics.median(latencies), 3),
            "edit_seconds_p99": round(latencies[min(len(latencies) - 1,
                                                    int(0.99 * len(latencies)))], 3),
            "edit_seconds_max": round(latencies[-1], 3),
            "children_problems": problems[:10],
            "cpus": os.cpu_count(),
            "kube_apiserver": "v1.20.2 (local dev cluster)",
        }
        print(json.dumps(result, indent=2))
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = REPO / "benchmarks" / "results" / f"operator_scale-{stamp}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"saved {out}")
        return 0 if not problems else 1
    finally:
        try:
            operator.terminate(timeout_s=20)
        except subprocess.TimeoutExpired:
            operator.kill()
        handle.stop()


if __name__ == "__main__":
    sys.exit(main())
