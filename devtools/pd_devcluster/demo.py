"""`pd-dev demo`: the whole product on this machine, in one command (dev tooling).

Builds the toolchain and the vLLM virtualenv if needed (at the same time: one is compile
bound, the other download bound), starts (or reuses) the local control plane with the CRDs
generated from the models, runs the operator and the fake kubelet (`kubelet.py`) against it
as recorded daemons (so `pd-dev cluster down` stops them with the rest), applies
the examples and waits until the operator has written their status. Two run for real:

- `examples/local-reference.yaml`: four reference-engine pods as local processes, their
  agents reporting into TransferAgents, and a light `pd-transfer load` (a recorded daemon
  that lists the engine pods, as a router does) keeping KV moving over NIXL;
- `examples/local-vllm.yaml`: a vLLM prefill and decode pod (vLLM's CPU backend, moving KV
  with PDTransferConnector) and the router; the demo sends a completion through the router
  and shows it.

So `kubectl get pdd` shows live transfer health and watermarks. The other examples need
GPUs and stay Pending.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import kubernetes.client as k8s
import yaml

from pd_devcluster.cluster import (
    ControlPlaneHandle,
    apply_crds,
    load_handle,
    save_handle,
    start_control_plane,
)
from pd_devcluster.components import Ports
from pd_devcluster.errors import DevClusterError
from pd_devcluster.processes import is_running, spawn_daemon
from pd_devcluster.toolchain import ensure_toolchain
from pd_devcluster.vllm_env import ensure_vllm_env
from pd_operator.api import crd as crd_gen

OPERATOR_PROCESS = "pd-operator"
KUBELET_PROCESS = "dev-kubelet"
LOAD_PROCESS = "demo-load"
REFERENCE_EXAMPLE = "local-reference"
VLLM_EXAMPLE = "local-vllm"
# A prompt of token ids (the tiny model has no tokenizer).
DEMO_PROMPT = [17, 230, 9, 512, 77, 64, 901, 3, 44, 618, 25, 380]
DEMO_METRICS_PORT = 18080
GROUP, VERSION, PLURAL = "pd.serving.dev", "v1alpha1", "pddeployments"


def _say(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


def _generated_crds_dir() -> Path:
    directory = Path(tempfile.mkdtemp(prefix="pd-operator-crds-"))
    crd_gen.write(directory)
    return directory


def ensure_builds() -> None:
    """The control plane's binaries and the vLLM virtualenv, built at the same time."""
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="demo-build") as pool:
        vllm = pool.submit(ensure_vllm_env)
        ensure_toolchain()
        vllm.result()


def ensure_control_plane(state_dir: Path) -> ControlPlaneHandle:
    ensure_builds()
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


def kubelet_argv(state_dir: Path) -> list[str]:
    """The fake kubelet's command line: `pd-dev cluster kubelet` in this interpreter."""
    return [sys.executable, "-m", "pd_devcluster", "cluster", "kubelet",
            "--state-dir", str(state_dir)]


def ensure_kubelet(handle: ControlPlaneHandle) -> ControlPlaneHandle:
    """The fake kubelet: runs `pd-transfer engine` pods as local processes (dev tooling)."""
    return _ensure_daemon(handle, KUBELET_PROCESS, kubelet_argv(handle.state_dir),
                          dict(os.environ, KUBECONFIG=str(handle.kubeconfig_path)))


def ensure_load(handle: ControlPlaneHandle, namespace: str) -> ControlPlaneHandle:
    """A light, long-running `pd-transfer load` against the reference example, with the
    control plane's kubeconfig (it lists the engine pods: Ready, not leaving, by key)."""
    argv = [sys.executable, "-m", "pd_transfer.cli", "load", "--namespace", namespace,
            "--deployment", REFERENCE_EXAMPLE, "--rate", "4", "--concurrency", "2",
            "--tokens", "200", "--duration-seconds", "86400", "--timeout-seconds", "15"]
    return _ensure_daemon(handle, LOAD_PROCESS, argv,
                          dict(os.environ, KUBECONFIG=str(handle.kubeconfig_path)))


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


_DEMO_MANAGER = "pd-operator-demo"
_APPLY = "application/apply-patch+yaml"


def apply_examples(api: k8s.ApiClient, examples_dir: Path, namespace: str) -> list[str]:
    """Server-side apply every example manifest in `examples_dir` into `namespace` (its
    ConfigMaps, then its PDDeployments); the names of the PDDeployments applied."""
    objects, core = k8s.CustomObjectsApi(api), k8s.CoreV1Api(api)
    names = []
    for path in sorted(examples_dir.glob("*.yaml")):
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
        for document in sorted(documents, key=lambda d: d.get("kind") == "PDDeployment"):
            kind, name = document.get("kind"), document["metadata"]["name"]
            document["metadata"]["namespace"] = namespace
            if kind == "ConfigMap":
                core.patch_namespaced_config_map(
                    name, namespace, document, field_manager=_DEMO_MANAGER, force=True,
                    _content_type=_APPLY)
                continue
            if kind != "PDDeployment":
                raise DevClusterError(f"{path.name}: the demo applies ConfigMaps and "
                                      f"PDDeployments only, not {kind}")
            objects.patch_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, document,
                field_manager=_DEMO_MANAGER, force=True, _content_type=_APPLY)
            names.append(name)
            _say(f"applied {path.name} as {namespace}/{name}")
    if not names:
        raise DevClusterError(f"no PDDeployment manifests found in {examples_dir}")
    return names


def _router_address(api: k8s.ApiClient, namespace: str, name: str) -> str | None:
    """host:port of a Ready router pod of `name`, None while there is none."""
    listed = k8s.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"pd.serving.dev/deployment={name},"
                                  "app.kubernetes.io/component=router")
    pods = _as_dict(api.sanitize_for_serialization(listed))["items"]  # type: ignore[no-untyped-call]
    for pod in pods:
        status = pod.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in status.get("conditions") or [])
        ports = {p.get("name"): p["containerPort"]
                 for p in pod["spec"]["containers"][0].get("ports") or []}
        if ready and status.get("podIP") and "http" in ports:
            return f"{status['podIP']}:{ports['http']}"
    return None


def serve_completion(api: k8s.ApiClient, namespace: str, timeout_s: float) -> str | None:
    """Wait for the vLLM example's router to be Ready (engines of both roles), send it one
    completion and return its answer (None, said why, when it did not come)."""
    deadline = time.monotonic() + timeout_s
    address = None
    next_note = time.monotonic() + 30
    while time.monotonic() < deadline:
        address = _router_address(api, namespace, VLLM_EXAMPLE)
        if address is not None:
            break
        if time.monotonic() >= next_note:
            _say(f"waiting for the {VLLM_EXAMPLE} router to see a ready prefill and decode "
                 f"engine (vLLM starts in about a minute on 2 cores)")
            next_note += 30
        time.sleep(2.0)
    if address is None:
        _say(f"the {VLLM_EXAMPLE} router is not Ready after {timeout_s:.0f} s; see the engine "
             "logs under the state dir's kubelet/ folder")
        return None
    # The engines run without a tokenizer: token ids in, token ids out.
    body = json.dumps({"model": "tiny-llama", "prompt": DEMO_PROMPT, "max_tokens": 8,
                       "temperature": 0, "return_token_ids": True}).encode()
    request = urllib.request.Request(f"http://{address}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        _say(f"the completion through the router at {address} failed: {exc}")
        return None
    tokens = answer["choices"][0].get("token_ids")
    if not tokens:
        _say(f"the completion through the router at {address} returned no tokens: {answer}")
        return None
    line = (f"POST http://{address}/v1/completions prompt={DEMO_PROMPT} max_tokens=8 -> "
            f"{tokens} ({time.monotonic() - started:.2f} s, prefill and decode pods through "
            f"the router, KV moved by pd_transfer)")
    _say(line)
    return line


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
    completion = None
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
        if VLLM_EXAMPLE in names:
            completion = serve_completion(api, namespace, max(timeout_s, 300.0))
            _say(f"vLLM P/D served through its router; {time.monotonic() - started:.1f} s "
                 "in all")
        bodies = wait_for_status(api, namespace, names, timeout_s)
    _show(handle, namespace, bodies)
    if completion is not None:
        print(f"\n{completion}")
    print(
        f"\n{REFERENCE_EXAMPLE} and {VLLM_EXAMPLE} run for real: a fake kubelet (dev tooling) "
        "starts their pods as local processes (reference engines; vLLM's CPU backend from "
        "the cached vLLM virtualenv, and the router).\n"
        "The other examples need GPUs and a real kubelet, so their pods stay Pending.\n"
        f'Use it:   eval "$({sys.argv[0]} cluster env)"; kubectl describe pdd -n {namespace}\n'
        f"Roll a new staging pool size out to the live vLLM engines (no restart):\n"
        f"          kubectl patch pdd {VLLM_EXAMPLE} -n {namespace} --type merge -p "
        """'{"spec":{"transfer":{"staging":{"decodePoolMiB":32}}}}'\n"""
        f"          kubectl get pdd -n {namespace} -w\n"
        f"Stop it:  {sys.argv[0]} cluster down   (stops the operator too)"
    )
    return 0
