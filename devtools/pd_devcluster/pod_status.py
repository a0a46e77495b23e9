"""DEV TOOLING, not the product: the fake kubelet's record of a running pod and the pod
status it reports, as a kubelet computes it.

``PodProcess`` is one pod run as local processes (``Container`` per container); the
kubelet (``kubelet.FakeKubelet``) starts, restarts and ends them. ``pod_status`` derives
what the kubelet patches into the pod: phase Running, podIP, containerStatuses (with
restartCount), and conditions ContainersReady (each container's readinessProbe: HTTP GET or
TCP connect against the pod's address with a kubelet's 1 s timeout; no probe: while it
runs) and Ready (ContainersReady AND every readiness-gate condition True). A condition
keeps its lastTransitionTime while its status stays. Gate conditions are the operator's;
they are read here, never written.
"""

from __future__ import annotations

import socket
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pd_devcluster.pod_runner import LaunchPlan, Probe
from pd_devcluster.processes import ProcessRecord, is_running

__all__ = ["Container", "PodProcess", "container_status", "now_stamp", "pod_status",
           "probe_passes"]

Obj = dict[str, Any]


@dataclass
class Container:
    """One container of a pod, run as a local process."""

    name: str
    image: str
    plan: LaunchPlan
    env: dict[str, str]
    log_path: Path
    record: ProcessRecord
    started_at: str
    restarts: int = 0
    died_at: float | None = None  # monotonic time it was seen dead
    pre_stop: LaunchPlan | None = None  # its lifecycle.preStop exec, run before SIGTERM


@dataclass
class PodProcess:
    uid: str
    namespace: str
    name: str
    ip: str
    containers: list[Container]
    tmp_dir: Path | None = None  # the pod's TMPDIR, removed when the pod stops
    last_status: Obj | None = None
    # (Secret name, directory, defaultMode) of each Secret volume, refreshed at every sync.
    secret_volumes: list[tuple[str, Path, int | None]] = field(default_factory=list)
    grace_s: float = 30.0  # terminationGracePeriodSeconds: preStop hooks and SIGTERM


def now_stamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def probe_passes(probe: Probe, ip: str) -> bool:
    """A readiness probe against the pod's address (a kubelet's 1 s timeout)."""
    try:
        if probe.http_path is None:
            with socket.create_connection((ip, probe.port), timeout=1.0):
                return True
        with urllib.request.urlopen(f"http://{ip}:{probe.port}{probe.http_path}",
                                    timeout=1.0) as response:
            return bool(200 <= response.status < 400)
    except OSError:  # refused, timed out, or an HTTP error status (urllib raises it)
        return False


def container_status(container: Container, ip: str, *, crash_loop: bool) -> Obj:
    """One container's status; a dead one is waiting in CrashLoopBackOff when the kubelet
    restarts containers (``crash_loop``), else terminated."""
    alive = is_running(container.record)
    probe = container.plan.readiness
    ready = alive and (probe is None or probe_passes(probe, ip))
    state: Obj = ({"running": {"startedAt": container.started_at}} if alive else
                  {"terminated": {"exitCode": 1, "reason": "Error",
                                  "startedAt": container.started_at,
                                  "finishedAt": now_stamp()}})
    if not alive and crash_loop:
        state = {"waiting": {"reason": "CrashLoopBackOff"}}
    image = container.image or "local"
    return {"name": container.name, "ready": ready, "restartCount": container.restarts,
            "started": alive, "image": image, "imageID": f"fake://{image}",
            "containerID": f"fake://{container.record.pid}", "state": state}


def pod_status(pod: Obj, process: PodProcess, *, crash_loop: bool) -> Obj:
    """The status a kubelet would report for ``pod`` (its last status read for the
    conditions' transition times and the readiness gates)."""
    statuses = [container_status(c, process.ip, crash_loop=crash_loop)
                for c in process.containers]
    ready = all(status["ready"] for status in statuses)
    current = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
    gates = [g["conditionType"] for g in pod["spec"].get("readinessGates") or []]
    gates_true = all(current.get(g, {}).get("status") == "True" for g in gates)

    def condition(type_: str, ok: bool) -> Obj:
        status = "True" if ok else "False"
        previous = current.get(type_)
        since = (previous.get("lastTransitionTime") if previous is not None
                 and previous.get("status") == status else None) or now_stamp()
        return {"type": type_, "status": status, "lastTransitionTime": since}

    return {
        "phase": "Running",
        "podIP": process.ip,
        "podIPs": [{"ip": process.ip}],
        "hostIP": "127.0.0.1",
        "startTime": process.containers[0].started_at,
        "conditions": [condition("PodScheduled", True), condition("Initialized", True),
                       condition("ContainersReady", ready),
                       condition("Ready", ready and gates_true)],
        "containerStatuses": statuses,
    }
