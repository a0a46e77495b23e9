"""A live deployment for staging rollouts: control plane + operator (two leader-elected
processes, `OperatorReplicas`, so that a test can SIGKILL the leader under load) + fake
kubelet + reference engines (real processes, real NIXL over loopback, hot staging resize) +
steady load, with the bookkeeping a rollout is judged by.

`LiveFleet` is used by `tests/e2e/test_rollout_e2e.py` (asserts) and by
`benchmarks/staging_rollout.py` (figures). What it records:
- every request of the load (start, end, outcome, failure reason, KV-ready latency), so any
  time window can be summarised (`LoadLog.window`);
- from the TransferAgents, polled every 0.2 s: the most pods resizing at once (report says
  `resizing`, or its report differs from its spec in the size its role allocates: the
  decode ring on decode pods, the prefill buffer on prefill pods; a spec that changes only
  the other size is confirmed by the agent at once and resizes nothing) and every spec size
  each pod had;
- the engines' PIDs from the kubelet (a hot resize must not restart them);
- the operator's log lines at ERROR or with a traceback, over all its replicas.

`SizeFault` is a TEST-ONLY fault tied to a staging size: while one pod reports that size in
force, its engine drops its Grants (`POST /v1/faults`). It stands in for "this size hurts
that pod", which the CPU test bed cannot produce reliably (a ring too small for the live
load only queues here: 2 cores are slower than the ring drains).
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from kubernetes import client as k8s

from pd_devcluster import ControlPlaneHandle
from pd_devcluster.kubelet import FakeKubelet
from pd_testbed.checkout import EXAMPLES_DIR
from pd_testbed.cluster import instance_names
from pd_testbed.operator_process import QUICK_TAKEOVER, OperatorReplicas
from pd_testbed.polling import wait_for, wait_for_events
from pd_transfer.reference.load import Engines, LoadConfig, engines_from_pods, run_one
from pd_transfer.router.pods import pod_selector

__all__ = ["FLEET_OPERATOR", "NAME", "LiveFleet", "LoadLog", "Request", "SizeFault",
           "discover_engines", "live_fleet"]

GROUP, VERSION = "pd.serving.dev", "v1alpha1"
NAME = "rollout-reference"
# A fleet's operator: status refreshes at most once a second, a 5 s resync and two workers
# (the engines need the cores more than the queue does).
FLEET_OPERATOR = ("--status-interval-seconds", "1", "--resync-seconds", "5", "--workers", "2")

Obj = dict[str, Any]
Size = tuple[int, int]


def body(namespace: str, *, analysis_s: int, max_unavailable: int) -> Obj:
    """examples/local-reference.yaml with short health windows and a quick rollout policy."""
    pdd: Obj = yaml.safe_load((EXAMPLES_DIR / "local-reference.yaml").read_text())
    pdd["metadata"] = {"name": NAME, "namespace": namespace}
    pdd["spec"]["transfer"]["health"] = {"windowSeconds": 8, "maxFailureRatio": 0.05,
                                         "reportIntervalSeconds": 5, "staleAfterSeconds": 15}
    pdd["spec"]["transfer"]["staging"]["rollout"] = {
        "maxUnavailable": max_unavailable, "analysisSeconds": analysis_s,
        "maxFailureRatio": 0.05, "autoRollback": True}
    return pdd


@dataclass(frozen=True)
class Request:
    start: float
    end: float
    ok: bool
    reason: str
    latency_s: float
    detail: str = ""  # a failure's room, pair and the engine's words


@dataclass
class LoadLog:
    """Every finished request of the load, in completion order."""

    requests: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, request: Request) -> None:
        with self.lock:
            self.requests.append(request)

    def window(self, start: float, end: float) -> dict[str, Any]:
        """Requests that started in [start, end): served, failed (by reason), p50/p99."""
        with self.lock:
            inside = [r for r in self.requests if start <= r.start < end]
        ok = sorted(r.latency_s for r in inside if r.ok)
        failed = Counter(r.reason for r in inside if not r.ok)

        def pct(q: float) -> float | None:
            return round(ok[min(len(ok) - 1, int(q * len(ok)))], 4) if ok else None
        return {"requests": len(inside), "served": len(ok), "failed": sum(failed.values()),
                "failures_by_reason": dict(failed),
                "failures": [r.detail for r in inside if not r.ok][:5], "p50_latency_s": pct(0.5),
                "p99_latency_s": pct(0.99), "seconds": round(end - start, 2)}


class SizeFault(threading.Thread):
    """TEST-ONLY (module docstring): `pod`'s engine drops its Grants exactly while its
    TransferAgent reports `size` in force; records how often the fault was switched."""

    def __init__(self, fleet: LiveFleet, pod: str, size: Size) -> None:
        super().__init__(name=f"size-fault-{pod}", daemon=True)
        self.fleet, self.pod, self.size = fleet, pod, size
        self.switched_on = 0
        self.switched_off = 0
        self.done = threading.Event()

    def run(self) -> None:
        active = False
        while not self.done.wait(0.1):
            try:
                agent = next(a for a in self.fleet.agents()
                             if a["metadata"]["name"] == self.pod)
                wanted = _size((agent.get("status") or {}).get("staging")) == self.size
                if wanted != active:
                    self.fleet.set_faults(self.pod, {"drop_grants": 1.0} if wanted else None)
                    active = wanted
                    self.switched_on += wanted
                    self.switched_off += not wanted
            except Exception:  # a blip of the local API server or engine: look again
                continue
        if active:
            self.fleet.set_faults(self.pod, None)


class LiveFleet:
    """See the module docstring. Use as a context manager (`live_fleet`)."""

    def __init__(self, handle: ControlPlaneHandle, kube_client: k8s.ApiClient,
                 namespace: str, kubelet: FakeKubelet, operator: OperatorReplicas) -> None:
        self.handle, self.ns, self.kubelet, self.operator = handle, namespace, kubelet, operator
        self.objects = k8s.CustomObjectsApi(kube_client)
        self.core = k8s.CoreV1Api(kube_client)
        self.log = LoadLog()
        self.max_resizing = 0
        self.resizing_now: set[str] = set()
        self.specs_seen: dict[str, list[Size]] = {}
        self.stop = threading.Event()
        # Spans (start, end) in which the load found no prefill-decode pair of one key in
        # rotation (Ready, not leaving), as its discovery saw them; the load waits meanwhile.
        self.no_pair: list[tuple[float, float]] = []
        self.no_pair_since: float | None = None

    # -- reads -----------------------------------------------------------------------------

    def pdd(self) -> Obj:
        return cast(Obj, self.objects.get_namespaced_custom_object(
            GROUP, VERSION, self.ns, "pddeployments", NAME))

    def rollout(self) -> Obj:
        return dict((self.pdd().get("status") or {}).get("stagingRollout") or {})

    def condition(self, type_: str) -> Obj:
        conditions = (self.pdd().get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == type_), {})

    def agents(self) -> list[Obj]:
        listed = cast(Obj, self.objects.list_namespaced_custom_object(
            GROUP, VERSION, self.ns, "transferagents",
            label_selector=f"pd.serving.dev/deployment={NAME}"))
        return list(listed["items"])

    def in_force(self) -> dict[str, Size]:
        return {a["metadata"]["name"]: _size((a.get("status") or {}).get("staging"))
                for a in self.agents()}

    def without_pair_s(self, start: float, end: float) -> float:
        """Seconds of [start, end) in which the load found no pair in rotation (`no_pair`)."""
        since = self.no_pair_since
        spans = [*self.no_pair, *([(since, end)] if since is not None else [])]
        return round(sum(max(0.0, min(e, end) - max(s, start)) for s, e in spans), 1)

    def instances(self, role: str | None = None) -> list[str]:
        """Engine instances (of `role`, or both roles by role) whose pod is not being
        deleted, by index."""
        roles = [role] if role else ["decode", "prefill"]
        return [name for r in roles for name in instance_names([
            self.core.api_client.sanitize_for_serialization(p)
            for p in self.core.list_namespaced_pod(
                self.ns, label_selector=f"pd.serving.dev/deployment={NAME},"
                                        f"pd.serving.dev/role={r}").items])]

    def pids(self) -> dict[str, int]:
        pods = self.core.list_namespaced_pod(
            self.ns, label_selector=f"pd.serving.dev/deployment={NAME}").items
        found = {}
        for pod in pods:
            name = str(pod.metadata.name) if pod.metadata is not None else ""
            record = self.kubelet.process_of(self.ns, name)
            if record is not None:
                found[name] = record.pid
        return found

    def events(self) -> list[Obj]:
        items = [e for e in self.core.list_namespaced_event(self.ns).items
                 if e.involved_object.name == NAME]
        items.sort(key=lambda e: int(str(e.metadata.resource_version)))
        return [{"type": e.type, "reason": e.reason, "message": e.message} for e in items]

    def events_with(self, reason: str, count: int = 1) -> list[Obj]:
        """`events()` once `count` of them have `reason` (`wait_for_events`)."""
        return wait_for_events(self.events, reason, count)

    def engine_of(self, pod: str) -> str:
        """host:port of `pod`'s engine HTTP API, from its agent's report."""
        agent = next(a for a in self.agents() if a["metadata"]["name"] == pod)
        return str(agent["status"]["endpoints"]["engine"])

    # -- actions -----------------------------------------------------------------------------

    def set_faults(self, pod: str, faults: dict[str, float] | None) -> None:
        """TEST-ONLY fault injection into `pod`'s engine (None clears every fault)."""
        body = {"set": faults} if faults else {"clear": True}
        request = urllib.request.Request(
            f"http://{self.engine_of(pod)}/v1/faults", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=5) as response:
            response.read()

    def resize(self, size: Size, *, analysis_s: int | None = None) -> None:
        """Ask for staging `size` (decodePoolMiB, prefillBufferMiB), and optionally another
        rollout analysis period, in one spec change."""
        staging: Obj = {"decodePoolMiB": size[0], "prefillBufferMiB": size[1]}
        if analysis_s is not None:
            staging["rollout"] = {"analysisSeconds": analysis_s}
        self.objects.patch_namespaced_custom_object(
            GROUP, VERSION, self.ns, "pddeployments", NAME,
            {"spec": {"transfer": {"staging": staging}}})

    def wait_phase(self, phase: str, to: int | None = None, timeout_s: float = 120) -> Obj:
        def reached(r: Obj) -> bool:
            return r.get("phase") == phase and (to is None or r.get("toDecodePoolMiB") == to)

        # The rollout status itself is returned, so a timeout shows the last one seen.
        return dict(wait_for(f"stagingRollout {phase} (to {to})", self.rollout, timeout_s,
                             until=reached))

    # -- background threads -----------------------------------------------------------------

    def watch_resizes(self) -> None:
        while not self.stop.wait(0.2):
            try:
                agents = self.agents()
            except Exception:  # the API server is ours and local; a blip is not a finding
                continue
            now = set()
            for agent in agents:
                name = agent["metadata"]["name"]
                spec = _size((agent.get("spec") or {}).get("staging"))
                seen = self.specs_seen.setdefault(name, [])
                if not seen or seen[-1] != spec:
                    seen.append(spec)
                status = agent.get("status") or {}
                role = (agent.get("spec") or {}).get("role", "")
                if status.get("resizing") or (status.get("staging") and _allocated(
                        role, _size(status["staging"])) != _allocated(role, spec)):
                    now.add(name)
            self.resizing_now = now
            self.max_resizing = max(self.max_resizing, len(now))

    def drive_load(self, engines: Callable[[], Engines], config: LoadConfig) -> None:
        pairs = itertools.count()
        slots = threading.Semaphore(config.concurrency)
        current = engines()
        refreshed = time.monotonic()
        with ThreadPoolExecutor(max_workers=config.concurrency) as pool:
            while not self.stop.is_set():
                if time.monotonic() - refreshed > config.discover_s:
                    with suppress(Exception):  # keep the last known engines
                        current = engines()
                    refreshed = time.monotonic()
                    if not current.pairs:  # as a router waits for an endpoint
                        self.no_pair_since = self.no_pair_since or refreshed
                    elif self.no_pair_since is not None:
                        self.no_pair.append((self.no_pair_since, refreshed))
                        self.no_pair_since = None
                if not current.pairs:
                    self.stop.wait(0.2)
                    continue
                if not slots.acquire(timeout=0.1):
                    continue
                started = time.monotonic()

                def one(pair: int, started: float = started, seen: Engines = current) -> None:
                    try:
                        got = run_one(seen, pair, config)
                    except Exception as exc:  # a bug in run_one must not stop the stream
                        got = {"state": "Failed", "reason": f"LoadError {exc}"}
                    finally:
                        slots.release()
                    ok = got.get("state") == "Succeeded"
                    self.log.add(Request(
                        started, time.monotonic(), ok, "" if ok else str(got.get("reason")),
                        float(got.get("latency_s", 0.0)), "" if ok else (
                            f"{got.get('room')} {got.get('prefill_pod')} -> "
                            f"{got.get('decode_pod')}: {got.get('detail')}")))
                pool.submit(one, next(pairs))
                self.stop.wait(1.0 / config.rate)


def _allocated(role: str, size: Size) -> int:
    """The MiB of `size` a pod of `role` allocates: its decode ring or its prefill buffer."""
    return size[0] if role == "decode" else size[1]


def _size(staging: Obj | None) -> Size:
    staging = staging or {}
    return int(staging.get("decodePoolMiB", 0)), int(staging.get("prefillBufferMiB", 0))


@contextmanager
def live_fleet(handle: ControlPlaneHandle, kube_client: k8s.ApiClient, work_dir: Path, *,
               analysis_s: int = 2, max_unavailable: int = 1, rate: float = 4.0,
               tokens: int = 200, concurrency: int = 2) -> Iterator[LiveFleet]:
    """The deployment up, every engine reporting, TransferHealthy=True and the load running."""
    core = k8s.CoreV1Api(kube_client)
    created = core.create_namespace(k8s.V1Namespace(
        metadata=k8s.V1ObjectMeta(generate_name="pdroll-")))
    assert created.metadata is not None and created.metadata.name is not None
    namespace: str = created.metadata.name
    with ExitStack() as stack:
        patch = stack.enter_context(pytest.MonkeyPatch.context())
        patch.setenv("KUBECONFIG", str(handle.kubeconfig_path))
        (work_dir / "kubelet").mkdir(parents=True, exist_ok=True)
        operator = OperatorReplicas(handle, namespace, work_dir,
                                    extra_args=(*QUICK_TAKEOVER, *FLEET_OPERATOR))
        prefix = f"127.{random.randint(100, 250)}.{random.randint(1, 250)}."
        # A container that exits is restarted (2 s, doubling), as a StatefulSet's pod is.
        kubelet = FakeKubelet(handle, work_dir / "kubelet", namespace=namespace,
                              ip_prefix=prefix, restart_backoff_s=2.0)
        fleet = LiveFleet(handle, kube_client, namespace, kubelet, operator)
        kubelet_stop = threading.Event()
        kubelet_thread = threading.Thread(target=kubelet.run, args=(kubelet_stop, 0.5),
                                          daemon=True)
        kubelet_thread.start()
        threads: list[threading.Thread] = []
        try:
            fleet.objects.create_namespaced_custom_object(
                GROUP, VERSION, namespace, "pddeployments",
                body(namespace, analysis_s=analysis_s, max_unavailable=max_unavailable))
            wait_for("4 engines reporting their endpoints", lambda: len([
                a for a in fleet.agents()
                if ((a.get("status") or {}).get("endpoints") or {}).get("engine")]) == 4, 120)
            config = LoadConfig(namespace=namespace, deployment=NAME, rate=rate,
                                duration_s=3600, tokens=tokens, concurrency=concurrency,
                                timeout_s=10.0, discover_s=2.0)
            engines = discover_engines(kube_client, namespace, NAME)
            threads = [threading.Thread(target=fleet.watch_resizes, daemon=True),
                       threading.Thread(target=fleet.drive_load, daemon=True,
                                        args=(engines, config))]
            for thread in threads:
                thread.start()
            wait_for("TransferHealthy=True", lambda: fleet.condition("TransferHealthy")
                     .get("status") == "True", 90)
            yield fleet
        finally:
            fleet.stop.set()
            for thread in threads:
                thread.join(30)
            kubelet_stop.set()
            kubelet_thread.join(60)
            operator.stop()
            core.delete_namespace(namespace)
    assert not operator.errors(), "\n".join(operator.errors())


def discover_engines(api: k8s.ApiClient, namespace: str, name: str) -> Callable[[], Engines]:
    """What the load calls to find a PDDeployment's engines: its pods that are endpoints now,
    as `pd-transfer load` lists them (a router's rule: Ready, not leaving, paired by key)."""
    core = k8s.CoreV1Api(api)

    def discover() -> Engines:
        pods = core.list_namespaced_pod(namespace, label_selector=pod_selector(name),
                                        _request_timeout=10)
        return engines_from_pods(api.sanitize_for_serialization(pods)["items"])  # type: ignore[no-untyped-call]
    return discover
