"""DEV TOOLING, not the product: a fake kubelet that runs reference engines as processes.

The local control plane has no scheduler and no kubelet, so pods stay Pending. For the
end-to-end demo and tests this plays the kubelet's part for exactly one kind of pod: those
labelled ``app.kubernetes.io/managed-by=pd-operator`` whose container command is
``pd-transfer engine ...`` (framework ``reference``). Every other pod stays Pending.

For each such pod, once (``sync_once``, polled):
- a distinct loopback IP ``<ip_prefix>N`` (all of 127.0.0.0/8 is local on Linux), so every
  pod can bind its own engine/bootstrap/metrics ports as it would in a cluster;
- the container's environment resolved as a kubelet would: plain values, downward-API
  ``fieldRef`` (``metadata.name/namespace/uid``, ``status.podIP``, ``spec.nodeName``,
  ``spec.serviceAccountName``, labels/annotations), ``configMapKeyRef``;
- ConfigMap and Secret volumes written under the pod's directory (Secret files with the
  volume's ``defaultMode``, 0644 when unset, as a kubelet does); their mount paths are
  rewritten in the command and the environment (no mount namespaces here), so
  ``PD_TRANSFER_CONFIG`` points at the pod's copy of ``transfer.json`` and
  ``PD_TRANSFER_AUTH_KEY_FILE`` at its copy of the transfer key. A pod whose Secret does not
  exist yet is not started (retried at the next sync), like a kubelet's ContainerCreating.
  Secret files follow their Secret at every sync (a rotated transfer key reaches running
  engines, as a kubelet's periodic volume sync does), each replaced atomically and only
  when its content changed; a deleted Secret leaves the last files in place. ConfigMap files
  are written once, at start;
- ``KUBECONFIG`` = a token for the pod's ServiceAccount (``service_account_kubeconfig``),
  so the in-pod agent runs with the per-PDDeployment RBAC, not as admin;
- the engine started as a recorded daemon (``processes.spawn_daemon``), one log per pod;
- the pod status patched: phase Running, podIP, containerStatuses, and conditions
  ContainersReady (the engine's ``GET /health``) and Ready (ContainersReady AND every
  readiness-gate condition True, as a kubelet computes it). Gate conditions are set by
  the operator; this never writes them.
A pod that disappears has its process stopped. A process that dies is NOT restarted (the
container shows terminated, the pod not Ready): tests kill an engine on purpose.
Records of the running engines are kept in ``<work_dir>/kubelet.json`` so
``pd-operator dev-cluster down`` stops them even if the kubelet itself was killed.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import sys
import threading
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from pd_operator.devcluster.cluster import ControlPlaneHandle, service_account_kubeconfig
from pd_operator.devcluster.errors import DevClusterError
from pd_operator.devcluster.processes import (
    ProcessRecord,
    is_running,
    spawn_daemon,
    stop_process,
)

__all__ = [
    "ENGINE_COMMAND",
    "FakeKubelet",
    "resolve_env",
    "stop_recorded_engines",
    "write_secret_volume",
]

ENGINE_COMMAND: Final = ("pd-transfer", "engine")
MANAGED_SELECTOR: Final = "app.kubernetes.io/managed-by=pd-operator"
NODE_NAME: Final = "dev-kubelet"
STATE_FILE: Final = "kubelet.json"
_log = logging.getLogger("pd_operator.devcluster.kubelet")

Obj = dict[str, Any]


@dataclass
class _PodProcess:
    uid: str
    namespace: str
    name: str
    ip: str
    port: int
    record: ProcessRecord
    started_at: str
    last_status: Obj | None = None
    # (Secret name, directory, defaultMode) of each Secret volume, refreshed at every sync.
    secret_volumes: list[tuple[str, Path, int | None]] = field(default_factory=list)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def is_engine_pod(pod: Obj) -> bool:
    containers = pod.get("spec", {}).get("containers") or []
    return bool(containers) and tuple(containers[0].get("command", [])[:2]) == ENGINE_COMMAND


def _field(pod: Obj, path: str, ip: str) -> str:
    meta = pod.get("metadata", {})
    simple = {
        "metadata.name": meta.get("name", ""), "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""), "status.podIP": ip, "status.hostIP": "127.0.0.1",
        "spec.nodeName": NODE_NAME,
        "spec.serviceAccountName": pod.get("spec", {}).get("serviceAccountName", ""),
    }
    if path in simple:
        return str(simple[path])
    for kind in ("labels", "annotations"):
        prefix = f"metadata.{kind}['"
        if path.startswith(prefix) and path.endswith("']"):
            return str((meta.get(kind) or {}).get(path[len(prefix):-2], ""))
    raise DevClusterError(f"fieldRef {path!r} is not supported by the fake kubelet")


def resolve_env(pod: Obj, container: Obj, ip: str, config_maps: dict[str, Obj],
                mounts: dict[str, str]) -> dict[str, str]:
    """The container's environment as a kubelet resolves it (see module docstring);
    values starting with a mount path are rewritten to the emulated directory."""
    env: dict[str, str] = {}
    for var in container.get("env") or []:
        name, source = var["name"], var.get("valueFrom")
        if source is None:
            value = str(var.get("value", ""))
        elif "fieldRef" in source:
            value = _field(pod, source["fieldRef"]["fieldPath"], ip)
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            value = str((config_maps.get(ref["name"], {}).get("data") or {}).get(ref["key"], ""))
        else:
            raise DevClusterError(f"env {name}: only value, fieldRef and configMapKeyRef are "
                                  f"supported by the fake kubelet")
        env[name] = _rewrite(value, mounts)
    return env


# A kubelet's default for Secret volume files (the API's default defaultMode).
SECRET_DEFAULT_MODE: Final = 0o644


def write_secret_volume(directory: Path, secret: Obj, mode: int | None) -> bool:
    """The files of a Secret volume: each data key decoded, with `mode` (None: 0644).

    A file is replaced (write aside, then rename: a reader sees the old or the new content,
    never a mix) only when its content changed; returns whether any was.
    """
    directory.mkdir(parents=True, exist_ok=True)
    file_mode = SECRET_DEFAULT_MODE if mode is None else mode
    changed = False
    for key, encoded in sorted((secret.get("data") or {}).items()):
        content = base64.b64decode(encoded)
        path = directory / key
        if path.is_file() and path.read_bytes() == content:
            continue
        aside = directory / f".{key}.new"
        aside.unlink(missing_ok=True)
        with os.fdopen(os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(content)
            os.fchmod(f.fileno(), file_mode)  # exactly the pod's mode, whatever the umask
        os.replace(aside, path)
        changed = True
    return changed


def _rewrite(value: str, mounts: dict[str, str]) -> str:
    for mount_path, local in mounts.items():
        if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
            return local + value[len(mount_path):]
    return value


def _engine_port(command: list[str]) -> int:
    for flag, value in itertools.pairwise(command):
        if flag == "--port":
            return int(value)
    raise DevClusterError(f"engine command without --port: {command}")


class FakeKubelet:
    """Runs the engine pods of ``namespace`` (None: every namespace); see module doc."""

    def __init__(self, handle: ControlPlaneHandle, work_dir: Path, *,
                 namespace: str | None = None, ip_prefix: str = "127.0.1.",
                 extra_env: dict[str, str] | None = None) -> None:
        self.handle = handle
        self.work_dir = work_dir
        self.namespace = namespace
        self.ip_prefix = ip_prefix
        self.extra_env = {"UCX_NET_DEVICES": "lo", **(extra_env or {})}
        self._api = handle.api_client()
        self._core = k8s.CoreV1Api(self._api)
        self._pods: dict[str, _PodProcess] = {}
        self._used_ips: set[str] = set()
        self._lock = threading.Lock()
        self.work_dir.mkdir(parents=True, exist_ok=True)

    # Loop -------------------------------------------------------------------------------------

    def run(self, stop: threading.Event, poll_s: float = 1.0) -> None:
        """Sync until ``stop`` is set, then stop every engine this kubelet started."""
        try:
            while not stop.is_set():
                try:
                    self.sync_once()
                except (ApiException, DevClusterError, OSError) as exc:
                    _log.warning("fake kubelet sync failed (retrying): %s", exc)
                stop.wait(poll_s)
        finally:
            self.stop_all()

    def sync_once(self) -> None:
        if self.namespace is None:
            listed = self._core.list_pod_for_all_namespaces(label_selector=MANAGED_SELECTOR)
        else:
            listed = self._core.list_namespaced_pod(self.namespace,
                                                    label_selector=MANAGED_SELECTOR)
        pods = [self._plain(p) for p in listed.items]
        seen: set[str] = set()
        for pod in pods:
            if not is_engine_pod(pod) or pod["metadata"].get("deletionTimestamp"):
                continue
            uid = pod["metadata"]["uid"]
            seen.add(uid)
            with self._lock:
                running = self._pods.get(uid)
            if running is None:
                try:
                    running = self._start(pod)
                except (ApiException, DevClusterError) as exc:
                    _log.warning("cannot start pod %s/%s yet: %s", pod["metadata"]["namespace"],
                                 pod["metadata"]["name"], exc)
                    continue
            self._update_status(pod, running)
        with self._lock:
            gone = [p for uid, p in self._pods.items() if uid not in seen]
        for process in gone:
            self._stop(process)
        self._refresh_secret_volumes()

    def _refresh_secret_volumes(self) -> None:
        """Rewrite the Secret volume files of running pods whose Secret changed."""
        with self._lock:
            volumes = [(p.namespace, *v) for p in self._pods.values() for v in p.secret_volumes]
        secrets: dict[tuple[str, str], Obj | None] = {}
        for namespace, secret_name, directory, mode in volumes:
            if (namespace, secret_name) not in secrets:
                try:
                    secrets[namespace, secret_name] = self._plain(
                        self._core.read_namespaced_secret(secret_name, namespace))
                except ApiException as exc:
                    if exc.status != 404:
                        raise
                    secrets[namespace, secret_name] = None
            secret = secrets[namespace, secret_name]
            if secret is not None and write_secret_volume(directory, secret, mode):
                _log.info("updated %s from Secret %s/%s", directory, namespace, secret_name)

    def stop_all(self) -> None:
        with self._lock:
            processes = list(self._pods.values())
        for process in processes:
            self._stop(process)
        self._api.close()  # type: ignore[no-untyped-call]

    def _plain(self, model: object) -> Obj:
        plain: Obj = self._api.sanitize_for_serialization(model)  # type: ignore[no-untyped-call]
        return plain

    def process_of(self, namespace: str, name: str) -> ProcessRecord | None:
        with self._lock:
            return next((p.record for p in self._pods.values()
                         if (p.namespace, p.name) == (namespace, name)), None)

    # Start / stop -----------------------------------------------------------------------------

    def _allocate_ip(self) -> str:
        for n in range(2, 255):
            ip = f"{self.ip_prefix}{n}"
            if ip not in self._used_ips:
                self._used_ips.add(ip)
                return ip
        raise DevClusterError(f"no free loopback address under {self.ip_prefix}")

    def _start(self, pod: Obj) -> _PodProcess:
        meta, spec = pod["metadata"], pod["spec"]
        namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
        pod_dir = self.work_dir / namespace / f"{name}-{uid[:8]}"
        pod_dir.mkdir(parents=True, exist_ok=True)
        container = spec["containers"][0]
        config_maps: dict[str, Obj] = {}
        volume_dirs: dict[str, str] = {}
        secret_volumes: list[tuple[str, Path, int | None]] = []
        for volume in spec.get("volumes") or []:
            if "secret" in volume:
                source = volume["secret"]
                secret = self._plain(self._core.read_namespaced_secret(source["secretName"],
                                                                       namespace))
                directory = pod_dir / "volumes" / volume["name"]
                write_secret_volume(directory, secret, source.get("defaultMode"))
                volume_dirs[volume["name"]] = str(directory)
                secret_volumes.append((source["secretName"], directory,
                                       source.get("defaultMode")))
                continue
            if "configMap" not in volume:
                continue
            cm_name = volume["configMap"]["name"]
            config_map = self._plain(self._core.read_namespaced_config_map(cm_name, namespace))
            config_maps[cm_name] = config_map
            directory = pod_dir / "volumes" / volume["name"]
            directory.mkdir(parents=True, exist_ok=True)
            for key, value in (config_map.get("data") or {}).items():
                (directory / key).write_text(value)
            volume_dirs[volume["name"]] = str(directory)
        mounts = {m["mountPath"]: volume_dirs[m["name"]]
                  for m in container.get("volumeMounts") or [] if m["name"] in volume_dirs}
        with self._lock:
            ip = self._allocate_ip()
        try:
            env = resolve_env(pod, container, ip, config_maps, mounts)
            service_account = spec.get("serviceAccountName") or "default"
            kubeconfig = service_account_kubeconfig(self.handle, namespace, service_account,
                                                    path=pod_dir / "kubeconfig")
            command = [_rewrite(arg, mounts) for arg in container["command"]]
            command += [_rewrite(arg, mounts) for arg in container.get("args") or []]
            argv = [sys.executable, "-m", "pd_transfer.cli", *command[1:]]
            process_env = {key: value for key, value in os.environ.items()
                           if not key.startswith(("KUBECONFIG", "UCX_", "PD_"))}
            tmp = pod_dir / "tmp"
            tmp.mkdir(exist_ok=True)
            process_env |= self.extra_env | env | {"KUBECONFIG": str(kubeconfig),
                                                   "TMPDIR": str(tmp)}
            record = spawn_daemon(f"engine {namespace}/{name}", argv, pod_dir / "engine.log",
                                  env=process_env)
        except BaseException:
            with self._lock:
                self._used_ips.discard(ip)
            raise
        process = _PodProcess(uid, namespace, name, ip, _engine_port(command), record, _now(),
                              secret_volumes=secret_volumes)
        with self._lock:
            self._pods[uid] = process
            self._save()
        _log.info("started pod %s/%s at %s (pid %d, log %s)", namespace, name, ip,
                  record.pid, record.log_path)
        return process

    def _stop(self, process: _PodProcess) -> None:
        _log.info("%s", stop_process(process.record, grace_s=5.0))
        with self._lock:
            self._pods.pop(process.uid, None)
            self._used_ips.discard(process.ip)
            self._save()

    def _save(self) -> None:
        path = self.work_dir / STATE_FILE
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps([p.record.to_json() for p in self._pods.values()]))
        partial.replace(path)

    # Status -----------------------------------------------------------------------------------

    def _healthy(self, process: _PodProcess) -> bool:
        try:
            with urllib.request.urlopen(f"http://{process.ip}:{process.port}/health",
                                        timeout=1.0) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def _update_status(self, pod: Obj, process: _PodProcess) -> None:
        alive = is_running(process.record)
        ready = alive and self._healthy(process)
        current = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
        gates = [g["conditionType"] for g in pod["spec"].get("readinessGates") or []]
        gates_true = all(current.get(g, {}).get("status") == "True" for g in gates)

        def condition(type_: str, ok: bool) -> Obj:
            status = "True" if ok else "False"
            previous = current.get(type_)
            since = (previous.get("lastTransitionTime") if previous is not None
                     and previous.get("status") == status else None) or _now()
            return {"type": type_, "status": status, "lastTransitionTime": since}

        image = pod["spec"]["containers"][0].get("image", "reference")
        state: Obj = ({"running": {"startedAt": process.started_at}} if alive else
                      {"terminated": {"exitCode": 1, "reason": "Error",
                                      "startedAt": process.started_at, "finishedAt": _now()}})
        desired: Obj = {
            "phase": "Running",
            "podIP": process.ip,
            "podIPs": [{"ip": process.ip}],
            "hostIP": "127.0.0.1",
            "startTime": process.started_at,
            "conditions": [condition("PodScheduled", True), condition("Initialized", True),
                           condition("ContainersReady", ready),
                           condition("Ready", ready and gates_true)],
            "containerStatuses": [{
                "name": pod["spec"]["containers"][0]["name"], "ready": ready,
                "restartCount": 0, "started": alive, "image": image,
                "imageID": f"fake://{image}", "containerID": f"fake://{process.record.pid}",
                "state": state,
            }],
        }
        comparable = json.dumps({**desired, "containerStatuses": [
            {**desired["containerStatuses"][0], "state": list(state)}]}, sort_keys=True)
        if process.last_status is not None and process.last_status.get("key") == comparable:
            return
        self._core.patch_namespaced_pod_status(
            pod["metadata"]["name"], pod["metadata"]["namespace"], {"status": desired},
            _content_type="application/strategic-merge-patch+json")
        process.last_status = {"key": comparable}


def stop_recorded_engines(work_dir: Path) -> list[str]:
    """Stop every engine a (possibly dead) fake kubelet recorded in ``work_dir``."""
    path = work_dir / STATE_FILE
    if not path.is_file():
        return []
    try:
        records = [ProcessRecord.from_json(item) for item in json.loads(path.read_text())]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{path} unreadable ({exc}); stop leftover engines by PID yourself"]
    lines = [stop_process(record, grace_s=5.0) for record in records]
    path.unlink(missing_ok=True)
    return lines
