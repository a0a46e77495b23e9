"""DEV TOOLING, not the product: a fake kubelet that runs engine pods as local processes.

The local control plane has no scheduler and no kubelet, so pods stay Pending. For the
end-to-end demo and tests this plays the kubelet's part for the pods labelled
``app.kubernetes.io/managed-by=pd-operator`` whose container it knows how to run
(``pod_runner``: ``pd-transfer ...`` commands, and vLLM's OpenAI server from the cached vLLM
virtualenv). Every other pod stays Pending, and so does one that asks for an extended
resource this node does not offer (GPUs, RDMA devices: ``missing_resources``), as a
scheduler would leave it; vLLM engines get one CPU per TP rank (``_cpus_for``).

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
  are written once per content and shared by the pods that mount them (one path for all, as
  one mount path inside each container);
- ``KUBECONFIG`` = a token for the pod's ServiceAccount (``service_account_kubeconfig``),
  so the in-pod agent and the router run with their own RBAC, not as admin;
- the container started as a recorded daemon (``processes.spawn_daemon``), one log per pod;
  a vLLM engine at ``ENGINE_NICENESS``, as a node keeps CPUs for its system daemons
  (system-reserved): the control plane, the operator, routers and sidecars run ahead of it;
- the pod status patched as a kubelet computes it (``pod_status``: phase, podIP,
  containerStatuses, ContainersReady from the readiness probes, Ready with the gates).
A pod that disappears is ended as a kubelet ends a deleted pod (``_terminate``, in a thread
of its own): each container's ``lifecycle.preStop`` exec command runs (planned like the
container, its loopback URLs at the pod's address; its output in the container's log),
then SIGTERM, all within the pod's ``terminationGracePeriodSeconds``. A process that dies
is restarted after ``restart_backoff_s`` (doubling per restart, up to 5 min, as a kubelet's
CrashLoopBackOff; ``None``: never, the container stays terminated — tests that kill an
engine to watch its pod go stale want that). Records of the running processes are kept in
``<work_dir>/kubelet.json`` so ``pd-dev cluster down`` stops them even if the
kubelet itself was killed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any, Final

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from pd_devcluster.cluster import ControlPlaneHandle, service_account_kubeconfig
from pd_devcluster.errors import DevClusterError
from pd_devcluster.pod_env import (
    resolve_env,
    rewrite_mounted,
    write_secret_volume,
)
from pd_devcluster.pod_runner import (
    VLLM_SERVER_MODULE,
    LaunchPlan,
    NotRunnable,
    missing_resources,
    plan_launch,
)
from pd_devcluster.pod_status import Container, PodProcess, now_stamp, pod_status
from pd_devcluster.processes import (
    ProcessRecord,
    is_running,
    spawn_daemon,
    stop_process,
)
from pd_devcluster.vllm_env import find_vllm_env

__all__ = ["FakeKubelet", "stop_recorded_engines"]

MANAGED_SELECTOR: Final = "app.kubernetes.io/managed-by=pd-operator"
STATE_FILE: Final = "kubelet.json"
MAX_BACKOFF_S: Final = 300.0
#: Niceness of vLLM engine processes (see `_niceness`).
ENGINE_NICENESS: Final = 10
VLLM_CPU_BIND_ENV: Final = "VLLM_CPU_OMP_THREADS_BIND"
_log = logging.getLogger("pd_devcluster.kubelet")

Obj = dict[str, Any]


def has_containers(pod: Obj) -> bool:
    return bool(pod.get("spec", {}).get("containers"))


class FakeKubelet:
    """Runs the engine pods of ``namespace`` (None: every namespace); see module doc."""

    def __init__(self, handle: ControlPlaneHandle, work_dir: Path, *,
                 namespace: str | None = None, ip_prefix: str = "127.0.1.",
                 extra_env: dict[str, str] | None = None,
                 restart_backoff_s: float | None = None,
                 extended_resources: Collection[str] = ()) -> None:
        self.handle = handle
        # Extended resources this node pretends to offer (e.g. an RDMA device plugin's
        # rdma/ib); a pod asking for any other stays Pending (``missing_resources``).
        self.extended_resources = frozenset(extended_resources)
        self.work_dir = work_dir
        self.namespace = namespace
        self.ip_prefix = ip_prefix
        self.restart_backoff_s = restart_backoff_s
        self._not_runnable: set[str] = set()  # pods logged once as not runnable
        self.extra_env = {"UCX_NET_DEVICES": "lo", **(extra_env or {})}
        self._api = handle.api_client()
        self._core = k8s.CoreV1Api(self._api)
        self._pods: dict[str, PodProcess] = {}
        self._used_ips: set[str] = set()
        self._next_cpu = 0
        self._terminating: set[str] = set()  # pods whose preStop hooks or stop are running
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
            if not has_containers(pod) or pod["metadata"].get("deletionTimestamp"):
                continue
            uid = pod["metadata"]["uid"]
            seen.add(uid)
            with self._lock:
                running = self._pods.get(uid)
            if running is None:
                try:
                    running = self._start(pod)
                except NotRunnable as exc:
                    if uid not in self._not_runnable:
                        self._not_runnable.add(uid)
                        _log.info("pod %s/%s stays Pending: %s", pod["metadata"]["namespace"],
                                  pod["metadata"]["name"], exc)
                    continue
                except (ApiException, DevClusterError) as exc:
                    _log.warning("cannot start pod %s/%s yet: %s", pod["metadata"]["namespace"],
                                 pod["metadata"]["name"], exc)
                    continue
            self._restart_if_due(pod, running)
            self._update_status(pod, running)
        with self._lock:
            gone = [p for uid, p in self._pods.items()
                    if uid not in seen and uid not in self._terminating]
            self._terminating.update(p.uid for p in gone)
        for process in gone:  # each in its own thread: a preStop hook may wait minutes
            threading.Thread(target=self._terminate, args=(process,), daemon=True,
                             name=f"terminate-{process.name}").start()
        self._not_runnable &= seen
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

    def process_of(self, namespace: str, name: str,
                   container: str | None = None) -> ProcessRecord | None:
        """The process of a pod's `container` (default: its first, the engine)."""
        with self._lock:
            pod = next((p for p in self._pods.values()
                        if (p.namespace, p.name) == (namespace, name)), None)
            if pod is None:
                return None
            return next((c.record for c in pod.containers
                         if container is None or c.name == container), None)

    # Start / stop -----------------------------------------------------------------------------

    def _allocate_ip(self) -> str:
        for n in range(2, 255):
            ip = f"{self.ip_prefix}{n}"
            if ip not in self._used_ips:
                self._used_ips.add(ip)
                return ip
        raise DevClusterError(f"no free loopback address under {self.ip_prefix}")

    def _start(self, pod: Obj) -> PodProcess:
        meta, spec = pod["metadata"], pod["spec"]
        namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
        lacking = missing_resources(pod, self.extended_resources)
        if lacking:
            raise NotRunnable(f"it asks for {', '.join(lacking)}, which this node does not "
                              "have (a scheduler would leave it Pending: Insufficient "
                              f"{lacking[0]})")
        pod_dir = self.work_dir / namespace / f"{name}-{uid[:8]}"
        pod_dir.mkdir(parents=True, exist_ok=True)
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
            directory = self._config_map_dir(namespace, config_map)
            volume_dirs[volume["name"]] = str(directory)
        with self._lock:
            ip = self._allocate_ip()
        started: list[Container] = []
        try:
            service_account = spec.get("serviceAccountName") or "default"
            kubeconfig = service_account_kubeconfig(self.handle, namespace, service_account,
                                                    path=pod_dir / "kubeconfig")
            # Short: engines put unix sockets under TMPDIR (vLLM's ZMQ IPC), and a socket
            # path may have at most 107 characters.
            tmp = Path(tempfile.mkdtemp(prefix=f"pdk-{uid[:8]}-"))
            base_env = {key: value for key, value in os.environ.items()
                        if not key.startswith(("KUBECONFIG", "UCX_", "PD_"))
                        and key not in ("PYTHONPATH", "VIRTUAL_ENV")}
            # Every container is planned before any starts: a pod runs whole or not at all.
            plans = [self._plan(pod, container, ip, volume_dirs, config_maps)
                     for container in spec["containers"]]
            for container, (plan, env) in zip(spec["containers"], plans, strict=True):
                process_env = base_env | self.extra_env | self._cpus_for(plan, env) | env \
                    | plan.env | {"KUBECONFIG": str(kubeconfig), "TMPDIR": str(tmp)}
                log_path = pod_dir / f"{container['name']}.log"
                record = spawn_daemon(f"{container['name']} {namespace}/{name}", plan.argv,
                                      log_path, env=process_env, niceness=_niceness(plan))
                started.append(Container(container["name"], container.get("image", ""),
                                          plan, process_env, log_path, record, now_stamp(),
                                          pre_stop=self._pre_stop(container, ip, plan)))
        except BaseException:
            for running in started:
                stop_process(running.record, grace_s=1.0)
            with self._lock:
                self._used_ips.discard(ip)
            raise
        process = PodProcess(uid, namespace, name, ip, started, tmp_dir=tmp,
                              secret_volumes=secret_volumes,
                              grace_s=float(spec.get("terminationGracePeriodSeconds", 30)))
        with self._lock:
            self._pods[uid] = process
            self._save()
        for running in started:
            _log.info("started %s of pod %s/%s at %s (pid %d, log %s)", running.name,
                      namespace, name, ip, running.record.pid, running.log_path)
        return process

    def _cpus_for(self, plan: LaunchPlan, env: dict[str, str]) -> dict[str, str]:
        """CPUs of a vLLM engine: one per TP rank, dealt round robin over this host's CPUs
        (`VLLM_CPU_OMP_THREADS_BIND`, one OpenMP thread per rank), as a node's CPU manager
        would give each engine pod its own cpuset; here they are shared once there are more
        ranks than CPUs. vLLM's own default gives every engine a thread on every CPU, and
        engines spin-waiting on the same cores delayed P/D requests by up to a second. A
        pod that sets the variable itself keeps its value. vLLM applies it in its
        multiprocess executor; a TP-1 engine run with `VLLM_ENABLE_V1_MULTIPROCESSING=0`
        (`examples/local-vllm.yaml`) keeps one unbound torch thread instead."""
        if VLLM_SERVER_MODULE not in plan.argv or VLLM_CPU_BIND_ENV in env:
            return {}
        argv = list(plan.argv)
        flag = "--tensor-parallel-size"
        ranks = int(argv[argv.index(flag) + 1]) if flag in argv[:-1] else 1
        cpus = sorted(os.sched_getaffinity(0))
        with self._lock:
            first, self._next_cpu = self._next_cpu, self._next_cpu + ranks
        return {VLLM_CPU_BIND_ENV: "|".join(str(cpus[(first + rank) % len(cpus)])
                                            for rank in range(ranks))}

    @staticmethod
    def _plan(pod: Obj, container: Obj, ip: str, volume_dirs: dict[str, str],
              config_maps: dict[str, Obj]) -> tuple[LaunchPlan, dict[str, str]]:
        """One container's process and environment, its mount paths rewritten."""
        mounts = {m["mountPath"]: volume_dirs[m["name"]]
                  for m in container.get("volumeMounts") or [] if m["name"] in volume_dirs}
        env = resolve_env(pod, container, ip, config_maps, mounts)
        command = [rewrite_mounted(arg, mounts) for arg in container.get("command") or []]
        command += [rewrite_mounted(arg, mounts) for arg in container.get("args") or []]
        return plan_launch(command, container, ip, vllm_python=_vllm_python), env

    def _restart_if_due(self, pod: Obj, process: PodProcess) -> None:
        """Restart each dead container after its back-off, as a kubelet does (restartPolicy
        Always, the default of StatefulSet and Deployment pods)."""
        for container in process.containers:
            if is_running(container.record):
                container.died_at = None
                continue
            if self.restart_backoff_s is None or pod["spec"].get("restartPolicy") == "Never":
                continue
            now = time.monotonic()
            if container.died_at is None:
                container.died_at = now
                continue
            backoff = min(self.restart_backoff_s * 2 ** container.restarts, MAX_BACKOFF_S)
            if now - container.died_at < backoff:
                continue
            record = spawn_daemon(f"{container.name} {process.namespace}/{process.name}",
                                  container.plan.argv, container.log_path, env=container.env,
                                  niceness=_niceness(container.plan))
            container.record, container.died_at = record, None
            container.restarts += 1
            container.started_at = now_stamp()
            with self._lock:
                self._save()
            _log.info("restarted %s of pod %s/%s (restart %d, pid %d)", container.name,
                      process.namespace, process.name, container.restarts, record.pid)

    def _config_map_dir(self, namespace: str, config_map: Obj) -> Path:
        """The files of a ConfigMap, written once per content and shared by every pod that
        mounts it: in a cluster each pod sees them at the same mount path, and engines that
        fingerprint their configuration (vLLM's NixlConnector hashes the model path) must
        see the same path here too."""
        data = config_map.get("data") or {}
        digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]
        directory = (self.work_dir / "configmaps" / namespace
                     / f"{config_map['metadata']['name']}-{digest}")
        if not directory.is_dir():
            partial = directory.with_name(directory.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            for key, value in data.items():
                (partial / key).write_text(value)
            partial.replace(directory)
        return directory

    def _pre_stop(self, container: Obj, ip: str, plan: LaunchPlan) -> LaunchPlan | None:
        """The container's preStop exec command as a local process (its loopback URLs at
        the pod's address, as `plan_launch` makes them), or None."""
        command = (((container.get("lifecycle") or {}).get("preStop") or {}).get("exec")
                   or {}).get("command")
        if not command:
            return None
        try:
            return plan_launch(command, {}, ip, vllm_python=_vllm_python)
        except NotRunnable as exc:
            _log.warning("preStop hook of %s not run: %s", container["name"], exc)
            return None

    def _terminate(self, process: PodProcess) -> None:
        """A deleted pod, as a kubelet ends it: every container's preStop hook (at once,
        each logged into its container's log), then SIGTERM, all within the pod's grace."""
        deadline = time.monotonic() + process.grace_s
        hooks = []
        for container in process.containers:
            if container.pre_stop is None:
                continue
            with container.log_path.open("ab") as log:
                log.write(f"preStop: {' '.join(container.pre_stop.argv)}\n".encode())
                hooks.append(subprocess.Popen(
                    container.pre_stop.argv, env=container.env | container.pre_stop.env,
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        for hook in hooks:
            try:
                hook.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hook.kill()
                hook.wait()
        try:
            self._stop(process)
        finally:
            with self._lock:
                self._terminating.discard(process.uid)

    def _stop(self, process: PodProcess) -> None:
        for container in process.containers:
            _log.info("%s", stop_process(container.record, grace_s=5.0))
        if process.tmp_dir is not None:
            shutil.rmtree(process.tmp_dir, ignore_errors=True)
        with self._lock:
            self._pods.pop(process.uid, None)
            self._used_ips.discard(process.ip)
            self._save()

    def _save(self) -> None:
        path = self.work_dir / STATE_FILE
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps([c.record.to_json() for p in self._pods.values()
                                       for c in p.containers]))
        partial.replace(path)

    # Status -----------------------------------------------------------------------------------

    def _update_status(self, pod: Obj, process: PodProcess) -> None:
        desired = pod_status(pod, process, crash_loop=self.restart_backoff_s is not None)
        comparable = json.dumps({**desired, "containerStatuses": [
            {**status, "state": list(status["state"])} for status in
            desired["containerStatuses"]]}, sort_keys=True)
        if process.last_status is not None and process.last_status.get("key") == comparable:
            return
        self._core.patch_namespaced_pod_status(
            pod["metadata"]["name"], pod["metadata"]["namespace"], {"status": desired},
            _content_type="application/strategic-merge-patch+json")
        process.last_status = {"key": comparable}


def _niceness(plan: LaunchPlan) -> int:
    """A vLLM engine's niceness: ``ENGINE_NICENESS``. On a host of 2 cores an engine whose
    NIXL threads busy-poll takes both (measured: a NixlConnector prefill at 126-137 % CPU
    between requests), and at the same priority the kube-apiserver answered a sidecar's
    status writes after their 5 s timeout."""
    return ENGINE_NICENESS if VLLM_SERVER_MODULE in plan.argv else 0


def _vllm_python() -> Path:
    env = find_vllm_env()
    if env is None:
        raise NotRunnable("the vLLM virtualenv is not built; `pd-dev cluster build` "
                          "builds it")
    return env.python


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
