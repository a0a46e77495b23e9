"""`pd-operator demo`: the whole product on this machine, in one command (dev tooling).

Builds the toolchain if needed, starts (or reuses) the local control plane with the CRDs
generated from the models, runs the operator and the fake kubelet (`kubelet.py`) against it
as recorded daemons (so `pd-operator dev-cluster down` stops them with the rest), applies
the example PDDeployments and waits until the operator has written their status. The
reference-engine example (`examples/local-reference.yaml`) then runs for real: its four
engine pods start as local processes, their agents report into TransferAgents, and a light
`pd-transfer load` (a recorded daemon too, with the deployment's own agent ServiceAccount)
keeps KV moving over NIXL, so `kubectl get pdd` shows live transfer health and watermarks.
The other examples need GPUs and stay Pending.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import kubernetes.client as k8s
import yaml

from pd_operator.api import crd as crd_gen
from pd_operator.devcluster.cluster import (
    ControlPlaneHandle,
    apply_crds,
    load_handle,
    save_handle,
    service_account_kubeconfig,
    start_control_plane,
)
from pd_operator.devcluster.components import Ports
from pd_operator.devcluster.errors import DevClusterError
from pd_operator.devcluster.processes import is_running, spawn_daemon
from pd_operator.devcluster.toolchain import ensure_toolchain

OPERATOR_PROCESS = "pd-operator"
KUBELET_PROCESS = "dev-kubelet"
LOAD_PROCESS = "demo-load"
REFERENCE_EXAMPLE = "local-reference"
DEMO_METRICS_PORT = 18080
GROUP, VERSION, PLURAL = "pd.serving.dev", "v1alpha1", "pddeployments"


def _say(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


def _generated_crds_dir() -> Path:
    directory = Path(tempfile.mkdtemp(prefix="pd-operator-crds-"))
    crd_gen.write(directory)
    return directory


def ensure_control_plane(state_dir: Path) -> ControlPlaneHandle:
    ensure_toolchain()
    crds_dir = _generated_crds_dir()
    try:
        handle = load_handle(state_dir)
        if handle is not None and handle.is_running():
            _say(f"control plane already running at {handle.server_url}")
            with handle.api_client() as api:
                apply_crds(api, crds_dir)
            return handle
        _say("starting kube-apiserver, etcd and kube-controller-manager on 127.0.0.1")
        return start_control_plane(state_dir, Ports(), crds_dir=crds_dir, controller_manager=True)
    finally:
        shutil.rmtree(crds_dir, ignore_errors=True)


def ensure_operator(handle: ControlPlaneHandle) -> ControlPlaneHandle:
    """Start the operator as a daemon recorded with the control plane, unless one runs."""
    for record in handle.processes:
        if record.name == OPERATOR_PROCESS and is_running(record):
            _say(f"operator already running (pid {record.pid})")
            return handle
    argv = [sys.executable, "-m", "pd_operator", "run", "--all-namespaces",
            "--metrics-port", str(DEMO_METRICS_PORT)]
    env = dict(os.environ, KUBECONFIG=str(handle.kubeconfig_path))
    log_path = handle.state_dir / "logs" / "pd-operator.log"
    record = spawn_daemon(OPERATOR_PROCESS, argv, log_path, env=env)
    _say(f"operator started (pid {record.pid}), log: {log_path}")
    others = tuple(r for r in handle.processes if r.name != OPERATOR_PROCESS)
    updated = replace(handle, processes=(*others, record))
    save_handle(updated)
    return updated


def _ensure_daemon(handle: ControlPlaneHandle, name: str, argv: list[str],
                   env: dict[str, str]) -> ControlPlaneHandle:
    """Start `argv` as a daemon recorded with the control plane, unless `name` runs."""
    for record in handle.processes:
        if record.name == name and is_running(record):
            _say(f"{name} already running (pid {record.pid})")
            return handle
    log_path = handle.state_dir / "logs" / f"{name}.log"
    record = spawn_daemon(name, argv, log_path, env=env)
    _say(f"{name} started (pid {record.pid}), log: {log_path}")
    updated = replace(handle, processes=(*(r for r in handle.processes if r.name != name),
                                         record))
    save_handle(updated)
    return updated


def ensure_kubelet(handle: ControlPlaneHandle) -> ControlPlaneHandle:
    """The fake kubelet: runs `pd-transfer engine` pods as local processes (dev tooling)."""
    argv = [sys.executable, "-m", "pd_operator", "dev-cluster", "kubelet",
            "--state-dir", str(handle.state_dir)]
    return _ensure_daemon(handle, KUBELET_PROCESS, argv,
                          dict(os.environ, KUBECONFIG=str(handle.kubeconfig_path)))


def ensure_load(handle: ControlPlaneHandle, namespace: str) -> ControlPlaneHandle:
    """A light, long-running `pd-transfer load` against the reference example, as the
    deployment's agent ServiceAccount (it only lists TransferAgents)."""
    kubeconfig = service_account_kubeconfig(handle, namespace,
                                            f"{REFERENCE_EXAMPLE}-transfer-agent")
    argv = [sys.executable, "-m", "pd_transfer.cli", "load", "--namespace", namespace,
            "--deployment", REFERENCE_EXAMPLE, "--rate", "4", "--concurrency", "2",
            "--tokens", "200", "--duration-seconds", "86400", "--timeout-seconds", "15"]
    return _ensure_daemon(handle, LOAD_PROCESS, argv,
                          dict(os.environ, KUBECONFIG=str(kubeconfig)))


def wait_for_transfers(api: k8s.ApiClient, namespace: str, timeout_s: float) -> int:
    """Wait until every TransferAgent of the reference example reports moved bytes."""
    objects = k8s.CustomObjectsApi(api)
    deadline = time.monotonic() + timeout_s
    moving = 0
    while time.monotonic() < deadline:
        agents = _as_dict(objects.list_namespaced_custom_object(
            GROUP, VERSION, namespace, "transferagents",
            label_selector=f"pd.serving.dev/deployment={REFERENCE_EXAMPLE}"))["items"]
        moving = sum(1 for a in agents if (a.get("status") or {}).get("bytesTotal", 0) > 0)
        if agents and moving == len(agents) >= 4:
            return moving
        time.sleep(1.0)
    _say(f"only {moving} TransferAgents report moved bytes after {timeout_s:.0f} s; see the "
         f"engine logs under the state dir's kubelet/ folder")
    return moving


def apply_examples(api: k8s.ApiClient, examples_dir: Path, namespace: str) -> list[str]:
    """Server-side apply every PDDeployment manifest in `examples_dir` into `namespace`."""
    objects = k8s.CustomObjectsApi(api)
    names = []
    for path in sorted(examples_dir.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if not document or document.get("kind") != "PDDeployment":
                continue
            name = document["metadata"]["name"]
            document["metadata"]["namespace"] = namespace
            objects.patch_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, document,
                field_manager="pd-operator-demo", force=True,
                _content_type="application/apply-patch+yaml",
            )
            names.append(name)
            _say(f"applied {path.name} as {namespace}/{name}")
    if not names:
        raise DevClusterError(f"no PDDeployment manifests found in {examples_dir}")
    return names


def _as_dict(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DevClusterError(f"the API server returned {type(value).__name__}, not an object")
    return value


def wait_for_status(api: k8s.ApiClient, namespace: str, names: list[str],
                    timeout_s: float) -> dict[str, Any]:
    """Wait until the operator has written a status for the current generation of each."""
    objects = k8s.CustomObjectsApi(api)
    deadline = time.monotonic() + timeout_s
    pending = set(names)
    bodies: dict[str, Any] = {}
    while pending and time.monotonic() < deadline:
        for name in sorted(pending):
            body = _as_dict(
                objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            )
            status = body.get("status") or {}
            if status.get("observedGeneration") == body["metadata"]["generation"]:
                bodies[name] = body
                pending.discard(name)
        time.sleep(0.5)
    if pending:
        raise DevClusterError(
            f"the operator wrote no status for {sorted(pending)} within {timeout_s:.0f} s; "
            "see its log (path printed above)"
        )
    return bodies


# Live staging watermarks per pod, from the PDDeployment's status.transfer.
_WATERMARKS = ('jsonpath={range .status.transfer.watermarks[*]}{.pod}{"\\t"}{.role}'
               '{"\\tpool "}{.poolMiB}{" MiB, used "}{.usedMiB}{" MiB, high water "}'
               '{.highWaterMiB}{" MiB\\n"}{end}')


def _show(handle: ControlPlaneHandle, namespace: str, bodies: dict[str, Any]) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl:
        env = dict(os.environ, KUBECONFIG=str(handle.kubeconfig_path))
        for args in (["get", "pdd", "-n", namespace],
                     ["get", "transferagents", "-n", namespace],
                     ["get", "pdd", REFERENCE_EXAMPLE, "-n", namespace, "-o", _WATERMARKS],
                     ["get", "pods", "-n", namespace,
                      "-l", "app.kubernetes.io/managed-by=pd-operator", "-o", "wide"]):
            print(f"\n$ kubectl {' '.join(args)}", flush=True)
            subprocess.run([kubectl, *args], env=env, check=False)
        return
    print(f"{'NAME':<16}{'READY':<8}{'PREFILL':<10}{'DECODE':<10}{'TRANSFER':<10}STAGING")
    for name, body in sorted(bodies.items()):
        status = body["status"]
        ready = next((c["status"] for c in status.get("conditions", [])
                      if c["type"] == "Ready"), "Unknown")
        print(f"{name:<16}{ready:<8}{status['prefill']['summary']:<10}"
              f"{status['decode']['summary']:<10}{status['transfer']['summary']:<10}"
              f"{status['stagingRollout']['summary']}")
    print(json.dumps({n: b["status"]["conditions"] for n, b in bodies.items()}, indent=2))


def run_demo(state_dir: Path, examples_dir: Path, namespace: str, timeout_s: float) -> int:
    started = time.monotonic()
    handle = ensure_kubelet(ensure_operator(ensure_control_plane(state_dir)))
    with handle.api_client() as api:
        core = k8s.CoreV1Api(api)
        try:
            core.read_namespace(namespace)
        except k8s.ApiException as exc:
            if exc.status != 404:
                raise
            core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=namespace)))
        names = apply_examples(api, examples_dir, namespace)
        bodies = wait_for_status(api, namespace, names, timeout_s)
        _say(f"{len(bodies)} PDDeployments reconciled; {time.monotonic() - started:.1f} s")
        if REFERENCE_EXAMPLE in names:
            handle = ensure_load(handle, namespace)
            moving = wait_for_transfers(api, namespace, timeout_s)
            _say(f"{moving} reference engine pods move KV over NIXL; "
                 f"{time.monotonic() - started:.1f} s in all")
            bodies = wait_for_status(api, namespace, names, timeout_s)
    _show(handle, namespace, bodies)
    print(
        f"\n{REFERENCE_EXAMPLE} runs for real: a fake kubelet (dev tooling) starts its "
        "`pd-transfer engine` pods as local processes and a light load moves KV between them.\n"
        "The other examples need GPUs and a real kubelet, so their pods stay Pending.\n"
        f'Use it:   eval "$({sys.argv[0]} dev-cluster env)"; kubectl describe pdd -n {namespace}\n'
        f"Stop it:  {sys.argv[0]} dev-cluster down   (stops the operator too)"
    )
    return 0
