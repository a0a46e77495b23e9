"""Staging pool rollouts against a real API server, with the operator in-process (or, where
its leader is killed, as two `pd-operator run --leader-elect` processes) and simulated agents
(docs/failure-modes.md #25).

Each engine pod's agent is a `SimAgent` thread that behaves as the in-pod agent does, through
the per-PDDeployment agent ServiceAccount's token: it creates its TransferAgent with the
ConfigMap's sizes, follows its `spec.staging` after a short resize (reporting `resizing`,
then the new size in force with `stagingSince`), and reports every ~0.5 s. Like the real agent,
it takes at once, without a resize, a spec that changes only the size its role does not
allocate (a decode pod allocates decodePoolMiB, a prefill pod prefillBufferMiB). The agents
record from their own side how many of them were resizing at once, in which order they began
and finished, and every spec size they saw.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kopf.testing import KopfRunner
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from pd_devcluster import ControlPlaneHandle
from pd_operator.build.names import agent_service_account
from pd_operator.staging_rollout.planner import ANNOTATION_WRITTEN_AT
from pd_testbed.cluster import NAME, Cluster, agent_api_client, reference_body
from pd_testbed.kube_factories import make_agent
from pd_testbed.operator_process import OperatorReplicas
from pd_testbed.polling import wait_for, wait_for_events

pytestmark = [pytest.mark.apiserver, pytest.mark.timeout(120)]

GROUP, VERSION, AGENTS = "pd.serving.dev", "v1alpha1", "transferagents"
OLD, BIG, SMALL = (4096, 2048), (6144, 2048), (2048, 2048)
RESIZE_S = 0.5   # how long a simulated resize takes
TICK_S = 0.25    # how often a simulated agent reads its spec
REPORT_S = 0.5   # how often it reports when nothing changes

Obj = dict[str, Any]
Size = tuple[int, int]


def stamp(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


class Fleet:
    """Book-keeping shared by the simulated agents: who is resizing, the most at once, and
    the order of what they did: ("begin", pod, size) when a resize starts, ("in force", pod,
    size) when a size takes effect (at once for a spec its role allocates nothing of)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.resizing: set[str] = set()
        self.max_resizing = 0
        self.log: list[tuple[str, str, Size]] = []

    def begin(self, pod: str, size: Size) -> None:
        with self.lock:
            self.resizing.add(pod)
            self.max_resizing = max(self.max_resizing, len(self.resizing))
            self.log.append(("begin", pod, size))

    def end(self, pod: str, size: Size) -> None:
        with self.lock:
            self.resizing.discard(pod)
            self.log.append(("in force", pod, size))

    def index(self, what: str, pod: str, size: Size) -> int:
        with self.lock:
            return self.log.index((what, pod, size))


def allocated(role: str, size: Size) -> int:
    """The MiB of `size` a pod of `role` allocates: its decode ring or its prefill buffer."""
    return size[0] if role == "decode" else size[1]


class SimAgent(threading.Thread):
    """One pod's agent: follows its TransferAgent's spec, reports its size and health.

    `failing(size)`: whether transfers fail while `size` is in force (the window then shows
    a failure ratio of 0.5 and the agent calls itself unhealthy)."""

    def __init__(self, api: k8s.ApiClient, namespace: str, pod: Obj, fleet: Fleet,
                 failing: Callable[[Size], bool] = lambda size: False) -> None:
        super().__init__(name=f"sim-agent-{pod['metadata']['name']}", daemon=True)
        self.objects = k8s.CustomObjectsApi(api)
        self.ns = namespace
        self.pod = pod["metadata"]["name"]
        self.uid = pod["metadata"]["uid"]
        self.role = pod["metadata"]["labels"]["pd.serving.dev/role"]
        self.fleet = fleet
        self.failing = failing
        self.in_force: Size = OLD
        self.since = datetime.now(UTC)
        self.resize_started: float | None = None
        self.specs_seen: list[Size] = []
        self.stop_event = threading.Event()
        self.errors: list[str] = []

    # -- the agent's API calls -----------------------------------------------------------

    def _body(self) -> Obj:
        bad = self.failing(self.in_force)
        body = make_agent(self.pod, role=self.role, deployment=NAME, namespace=self.ns,
                          pod_uid=self.uid, report_time=datetime.now(UTC),
                          staging_mib=self.in_force, resizing=self.resize_started is not None,
                          window=(50, 25) if bad else (50, 0), healthy=not bad,
                          window_reasons={"GrantTimeout": 25} if bad else None,
                          transports=[("peer", "rc")])
        body["status"]["stagingSince"] = stamp(self.since)
        return body

    def create(self) -> None:
        body = self._body()
        status = body.pop("status")
        self.objects.create_namespaced_custom_object(GROUP, VERSION, self.ns, AGENTS, body)
        self._write(status)

    def report(self) -> None:
        self._write(self._body()["status"])

    def _write(self, status: Obj) -> None:
        self.objects.patch_namespaced_custom_object_status(GROUP, VERSION, self.ns, AGENTS,
                                                           self.pod, {"status": status})

    def spec_size(self) -> Size:
        got = self.objects.get_namespaced_custom_object(GROUP, VERSION, self.ns, AGENTS,
                                                        self.pod)
        staging = got["spec"]["staging"]
        return staging["decodePoolMiB"], staging["prefillBufferMiB"]

    # -- behaviour -----------------------------------------------------------------------

    def step(self) -> bool:
        """One look at the spec; True when the report changed."""
        want = self.spec_size()
        if not self.specs_seen or self.specs_seen[-1] != want:
            self.specs_seen.append(want)
        if self.resize_started is None:
            if want == self.in_force:
                return False
            if allocated(self.role, want) == allocated(self.role, self.in_force):
                # Nothing of ours changes size: in force at once, as the real agent does.
                self.in_force = want
                self.fleet.end(self.pod, want)
                return True
            self.resize_started = time.monotonic()
            self.fleet.begin(self.pod, want)
            return True
        if time.monotonic() - self.resize_started < RESIZE_S:
            return False
        # The resize is done: whatever the spec asks for now is what takes effect.
        self.in_force, self.since, self.resize_started = want, datetime.now(UTC), None
        self.fleet.end(self.pod, want)
        return True

    def run(self) -> None:
        last = 0.0
        while not self.stop_event.is_set():
            try:
                if self.step() or time.monotonic() - last > REPORT_S:
                    self.report()
                    last = time.monotonic()
            except ApiException as exc:  # recorded, asserted empty by the test
                self.errors.append(f"{exc.status} {exc.reason}")
            self.stop_event.wait(TICK_S)


def rollout_body(namespace: str) -> Obj:
    body = reference_body(namespace)
    body["spec"]["transfer"]["staging"]["rollout"] = {
        "maxUnavailable": 1, "analysisSeconds": 1, "maxFailureRatio": 0.01}
    return body


class Harness:
    """The PDDeployment, its pods marked Ready and a `SimAgent` per pod."""

    def __init__(self, control_plane: ControlPlaneHandle, cluster: Cluster,
                 failing: Callable[[str, Size], bool] = lambda pod, size: False) -> None:
        self.cluster = cluster
        cluster.create(rollout_body(cluster.ns))
        wait_for("4 engine pods", lambda: len(cluster.pods()) == 4)
        wait_for("the agent ServiceAccount and its RoleBinding", lambda: len([
            k for k in cluster.live() if k[3] == agent_service_account(NAME)]) == 3)
        cluster.mark_all_ready()
        self.api = agent_api_client(control_plane, cluster.ns)
        self.fleet = Fleet()
        self.agents = {
            p["metadata"]["name"]: SimAgent(
                self.api, cluster.ns, p, self.fleet,
                (lambda size, name=p["metadata"]["name"]: failing(name, size)))
            for p in cluster.pods()
        }
        for agent in self.agents.values():
            agent.create()
            agent.start()

    def stop(self) -> None:
        for agent in self.agents.values():
            agent.stop_event.set()
        for agent in self.agents.values():
            agent.join(timeout=5)
        self.api.close()
        assert all(not a.errors for a in self.agents.values()), \
            {n: a.errors for n, a in self.agents.items()}

    def rollout(self) -> Obj:
        return dict(self.cluster.status().get("stagingRollout") or {})

    def resize(self, size: Size) -> None:
        self.cluster.patch_spec({"transfer": {"staging": {
            "decodePoolMiB": size[0], "prefillBufferMiB": size[1]}}})

    def wait_phase(self, phase: str, to: Size | None = None, timeout_s: float = 40) -> Obj:
        def probe() -> Obj | None:
            r = self.rollout()
            if r.get("phase") != phase:
                return None
            if to is not None and r.get("toDecodePoolMiB") != to[0]:
                return None
            return r
        return dict(wait_for(f"stagingRollout phase {phase}", probe, timeout_s=timeout_s))

    def in_force(self) -> dict[str, Size]:
        return {name: a.in_force for name, a in self.agents.items()}

    def events(self) -> list[Obj]:
        listed = self.cluster.core.list_namespaced_event(self.cluster.ns)
        ours = [e for e in listed.items if e.involved_object.name == NAME]
        ours.sort(key=lambda e: int(e.metadata.resource_version))  # creation order
        return [{"type": e.type, "reason": e.reason, "message": e.message} for e in ours]

    def events_with(self, reason: str, count: int = 1) -> list[Obj]:
        """`events()` once `count` of them have `reason` (`wait_for_events`)."""
        return wait_for_events(self.events, reason, count)


@pytest.fixture
def harness_factory(control_plane: ControlPlaneHandle, cluster: Cluster) -> Iterator[
        Callable[..., Harness]]:
    made: list[Harness] = []

    def make(**kwargs: Any) -> Harness:
        made.append(Harness(control_plane, cluster, **kwargs))
        return made[-1]

    yield make
    for harness in made:
        harness.stop()


def test_grow_then_shrink_rolls_out_one_pod_at_a_time(
        reporting_operator: KopfRunner, cluster: Cluster,
        harness_factory: Callable[..., Harness]) -> None:
    """Grow, then shrink the decode pool over 2 prefill + 2 decode pods with maxUnavailable 1:
    each rollout completes, every agent runs the new size, never two resizing at once, and
    the steps are announced as Events. Once complete, nothing more is written. The prefill
    pods, whose buffer never changes, are never a batch (a rollout skips pods whose size in
    force does not change), yet take each new spec in the safe order: after the decode
    rings grew, before they shrink."""
    fleet = harness_factory()
    first = fleet.wait_phase("Idle", to=OLD)
    assert first["summary"] == "4096MiB"

    for size in (BIG, SMALL):
        started = time.monotonic()
        fleet.resize(size)
        done = fleet.wait_phase("Complete", to=size)
        elapsed = time.monotonic() - started
        assert fleet.in_force() == dict.fromkeys(fleet.agents, size), fleet.in_force()
        assert done["summary"] == f"{size[0]}MiB"
        assert sorted(done["updatedPods"]) == sorted(fleet.agents)
        assert done["totalPods"] == 4
        print(f"rollout to {size}: {elapsed:.1f} s")
    assert fleet.fleet.max_resizing == 1

    reasons = [e["reason"] for e in fleet.events_with("StagingRolloutComplete", 2)]
    assert reasons.count("StagingRolloutStarted") == 2
    assert reasons.count("StagingRolloutComplete") == 2
    assert reasons.count("StagingBatchResizing") == 4
    # Only the decode pods are batches: a decodePoolMiB-only change resizes no prefill pod.
    batches = [e["message"] for e in fleet.events() if e["reason"] == "StagingBatchResizing"]
    decode = [cluster.instance("decode", 0), cluster.instance("decode", 1)]
    prefill = [cluster.instance("prefill", 0), cluster.instance("prefill", 1)]
    assert [m.split()[1] for m in batches] == decode * 2
    assert not any(what == "begin" and pod in prefill for what, pod, _ in fleet.fleet.log)
    # A grow resizes decode rings first; a shrink, prefill chunk limits first.
    log = fleet.fleet.index
    assert (max(log("in force", p, BIG) for p in decode)
            < min(log("in force", p, BIG) for p in prefill))
    assert (max(log("in force", p, SMALL) for p in prefill)
            < min(log("begin", p, SMALL) for p in decode))

    # Steady state: no TransferAgent spec or annotation changes any more.
    versions = {name: a.objects.get_namespaced_custom_object(
        GROUP, VERSION, cluster.ns, AGENTS, name)["metadata"] for name, a in
        fleet.agents.items()}
    time.sleep(3)
    for name, agent in fleet.agents.items():
        meta = agent.objects.get_namespaced_custom_object(GROUP, VERSION, cluster.ns, AGENTS,
                                                          name)["metadata"]
        assert meta["generation"] == versions[name]["generation"]
        assert meta["annotations"] == versions[name]["annotations"]
        assert ANNOTATION_WRITTEN_AT in meta["annotations"]


def test_a_failing_first_batch_pauses_and_rolls_back(
        reporting_operator: KopfRunner, cluster: Cluster,
        harness_factory: Callable[..., Harness]) -> None:
    """The first resized pod fails transfers at the new size: the rollout pauses and rolls
    back by itself, every pod ends at the old size, and status + a Warning Event say why."""
    def first_decode(pod: str) -> bool:
        return pod.startswith(f"{NAME}-decode-") and pod.endswith("-0")

    fleet = harness_factory(failing=lambda pod, size: first_decode(pod) and size == BIG)
    bad = cluster.instance("decode", 0)
    fleet.wait_phase("Idle", to=OLD)
    fleet.resize(BIG)
    back = fleet.wait_phase("RolledBack")
    assert fleet.in_force() == dict.fromkeys(fleet.agents, OLD)
    assert fleet.fleet.max_resizing == 1
    assert back["fromDecodePoolMiB"] == OLD[0] and back["toDecodePoolMiB"] == BIG[0]
    assert bad in back["message"] and "failure ratio 0.500" in back["message"]
    assert "rolled back to decodePoolMiB=4096" in back["message"]
    assert back["summary"] == "4096MiB RolledBack"
    # Only the failing pod was ever resized: the others never saw the new size.
    assert all(BIG not in a.specs_seen for n, a in fleet.agents.items() if n != bad)
    warnings = {e["reason"]: e["message"] for e in fleet.events_with("StagingRolledBack")
                if e["type"] == "Warning"}
    assert bad in warnings["StagingRollbackStarted"]
    assert "rolled back" in warnings["StagingRolledBack"]


@pytest.mark.timeout(240)
def test_the_leader_killed_at_every_step_hands_the_rollout_on_with_no_step_twice(
        control_plane: ControlPlaneHandle, cluster: Cluster, tmp_path: Path,
        harness_factory: Callable[..., Harness]) -> None:
    """Guards against a rollout that a new leader forgets, restarts or repeats: two operator
    processes under leader election, and after every step the rollout takes (a spec written
    to a pod, a pod counted as updated, the phase) the leader is SIGKILLed and replaced, as
    a Deployment replaces a lost pod. The standby finishes each step from the API's state
    alone: every pod's spec goes OLD -> BIG exactly once, never two pods resize at once, one
    rollout is started and completed."""
    def step(fleet: Harness) -> tuple[object, ...]:
        rollout = fleet.rollout()
        return (rollout.get("phase"), tuple(sorted(rollout.get("updatedPods", []))),
                tuple(sorted(n for n, a in fleet.agents.items() if BIG in a.specs_seen)))

    operators = OperatorReplicas(control_plane, cluster.ns, tmp_path)
    try:
        fleet = harness_factory()
        fleet.wait_phase("Idle", to=OLD)
        fleet.resize(BIG)
        steps = [step(fleet)]
        takeovers: list[float] = []
        while steps[-1][0] != "Complete":
            operators.kill_leader()
            killed = time.monotonic()
            seen = steps[-1]
            steps.append(wait_for(f"a step after {seen}", lambda: step(fleet), 30,
                                  interval_s=0.05, until=seen.__ne__))
            takeovers.append(time.monotonic() - killed)
            assert len(steps) < 30, steps
        print(f"leaders killed: {len(takeovers)}; steps: {steps}; takeover to the next step: "
              f"{max(takeovers):.1f} s at most")
        time.sleep(2)  # an Event follows its status write: let the last ones land
        reasons = [e["reason"] for e in fleet.events()]
    finally:
        print(operators.stop())
    # Killed at every step: at least one kill per pod whose spec was written.
    assert len(takeovers) >= len(fleet.agents)
    assert fleet.in_force() == dict.fromkeys(fleet.agents, BIG)
    for name, agent in fleet.agents.items():
        # Each pod's spec went OLD -> BIG exactly once, never back.
        assert agent.specs_seen == [OLD, BIG], (name, agent.specs_seen)
    assert fleet.fleet.max_resizing == 1
    # A leader killed between a status write and its Event leaves that Event unsent (Events
    # are best effort, and the step that wrote Complete may be the killed leader's): a start
    # or an end may go unannounced, but none is announced twice.
    assert reasons.count("StagingRolloutStarted") <= 1
    assert reasons.count("StagingRolloutComplete") <= 1
    assert cluster.children_match() == []  # every child as the builders make it, no orphan


def test_a_size_below_one_chunk_is_refused_and_pods_keep_theirs(
        reporting_operator: KopfRunner, cluster: Cluster,
        harness_factory: Callable[..., Harness]) -> None:
    """A decode pool below one prefill chunk never reaches a pod: the spec is refused with
    the minimum in the message (status and a Warning Event)."""
    fleet = harness_factory()
    fleet.wait_phase("Idle", to=OLD)
    fleet.resize((512, 2048))
    condition = wait_for("SpecValid=False", lambda: cluster.condition("SpecValid")
                         if cluster.condition("SpecValid").get("status") == "False" else None)
    assert "at least 640" in condition["message"]
    time.sleep(2)
    assert all(a.specs_seen == [OLD] for a in fleet.agents.values())
    wait_for("a Warning Event naming the minimum", lambda: any(
        e["type"] == "Warning" and "at least 640" in e["message"] for e in fleet.events()), 15)
