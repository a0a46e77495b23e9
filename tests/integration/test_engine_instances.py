"""Engine instances owned by the operator, against a real control plane: a pod deleted by
hand comes back under its name, a scale-down removes the instance whose leaving costs least
and says why, a delete spares the namesake of the instance a pass chose, and a PDDeployment
whose children a previous release made (a StatefulSet per role) moves to instances without
a dip. `pd_testbed.ready_kubelet.Kubelet` stands in for a kubelet (pods have no node, so a
deleted pod is removed at once)."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from kopf.testing import KopfRunner
from kubernetes import watch as k8s_watch

from pd_contract.identity import Authority, IdentityFile, verify_credential
from pd_contract.transferagent import Role
from pd_devcluster import ControlPlaneHandle
from pd_operator.api import parse_pdd
from pd_operator.api.revision_status import EngineRolloutStatus
from pd_operator.build.meta import object_meta
from pd_operator.build.names import LABEL_ROLE, role_selector, role_workload
from pd_operator.build.pod import build_pod_template
from pd_operator.engine_rollout.executor import InstanceExecutor
from pd_operator.engine_rollout.planner import EngineStep
from pd_operator.engine_rollout.pods import Instance
from pd_operator.kube import EVENTS, STATEFULSETS
from pd_testbed.cluster import CAPS, NAME, Cluster, example_body
from pd_testbed.kube_factories import make_agent
from pd_testbed.operator_runner import run_operator
from pd_testbed.polling import wait_for
from pd_testbed.ready_kubelet import Kubelet

pytestmark = [pytest.mark.apiserver, pytest.mark.timeout(120)]

Obj = dict[str, Any]


def create(cluster: Cluster, prefill: int, decode: int) -> Obj:
    body = example_body(cluster.ns)
    body["spec"]["prefill"]["replicas"] = prefill
    body["spec"]["decode"]["replicas"] = decode
    body["spec"]["router"] = {"enabled": False}
    return cluster.create(body)


def serving(cluster: Cluster, prefill: int, decode: int) -> None:
    wait_for(f"{prefill} prefill and {decode} decode instances Ready", lambda: len(
        cluster.instances("prefill")) == prefill and len(cluster.instances("decode")) == decode
        and cluster.condition("Ready").get("status") == "True", 60)


def events(cluster: Cluster, reason: str) -> list[str]:
    return [str(e["message"]) for e in cluster.kube.list_objects(EVENTS, cluster.ns, "")
            if e["reason"] == reason and e["involvedObject"]["name"] == NAME]


class PodWatch(threading.Thread):
    """Every pod event of the namespace, in order: (type, name, uid, deleting)."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.seen: list[tuple[str, str, str, bool]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        watcher = k8s_watch.Watch()
        while not self.stop.is_set():
            for event in watcher.stream(self.cluster.core.list_namespaced_pod, self.cluster.ns,
                                        timeout_seconds=1):
                pod = event["object"]
                self.seen.append((event["type"], pod.metadata.name, pod.metadata.uid,
                                  pod.metadata.deletion_timestamp is not None))

    def most_alive_per_name(self) -> int:
        """The most pods one name had at once (ADDED until DELETED), over the watch."""
        alive: dict[str, set[str]] = {}
        most = 0
        for kind, name, uid, _ in self.seen:
            mine = alive.setdefault(name, set())
            if kind == "DELETED":
                mine.discard(uid)
            else:
                mine.add(uid)
            most = max(most, len(mine))
        return most


@pytest.fixture
def pod_watch(cluster: Cluster) -> Iterator[PodWatch]:
    watch = PodWatch(cluster)
    watch.start()
    yield watch
    watch.stop.set()
    watch.join(5)


def test_a_pod_deleted_by_hand_comes_back_under_its_name_within_10_s(
        operator: KopfRunner, cluster: Cluster, kubelet: Kubelet, pod_watch: PodWatch) -> None:
    """Guards against a lost pod replaced by a new identity (its peers' state, its TransferAgent
    and its logs are keyed by the name), replaced late, or two pods of one name at once."""
    create(cluster, prefill=1, decode=2)
    serving(cluster, 1, 2)
    victim = cluster.instances("decode")[0]
    uid = cluster.core.read_namespaced_pod(victim, cluster.ns).metadata.uid
    deleted = time.monotonic()
    cluster.core.delete_namespaced_pod(victim, cluster.ns)
    back = wait_for(f"{victim} created again", lambda: (
        p if (p := next((x for x in cluster.pods("decode")
                         if x["metadata"]["name"] == victim), None)) is not None
        and p["metadata"]["uid"] != uid else None), 10, interval_s=0.05)
    took = time.monotonic() - deleted
    print(f"{victim} deleted by hand: created again under its name {took:.1f} s later")
    assert took < 10
    assert back["metadata"]["labels"]["pd.serving.dev/instance"] == victim
    serving(cluster, 1, 2)
    assert len(cluster.pods()) == 3
    time.sleep(1)  # the watch catches up
    assert pod_watch.most_alive_per_name() == 1, pod_watch.seen
    # Gone at once (no node to stop it on): created again as the role's missing instance.
    assert any(m.startswith(f"creating decode instance {victim}")
               for m in events(cluster, "ReplacingInstance") + events(cluster,
                                                                       "CreatingInstances"))


def test_each_instance_has_an_identity_of_its_own_and_loses_it_with_it(
        operator: KopfRunner, cluster: Cluster, kubelet: Kubelet) -> None:
    """Guards against pods that can speak as each other (docs/failure-modes.md #59): each
    instance's pod mounts an identity Secret of its own, issued by the deployment's authority
    (which no pod mounts) for its role and instance, and the Secret goes with the instance."""
    create(cluster, prefill=1, decode=2)
    serving(cluster, 1, 2)
    stored = cluster.core.read_namespaced_secret(f"{NAME}-transfer-authority", cluster.ns)
    authority = base64.b64decode(stored.data["authority.key"]).decode()
    public = Authority.from_private(authority).public
    keys = set()
    for pod in cluster.pods():
        name, role = pod["metadata"]["name"], pod["metadata"]["labels"]["pd.serving.dev/role"]
        secrets = {v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v}
        assert secrets == {f"{NAME}-transfer-key", f"{name}-transfer-identity"}
        held = cluster.core.read_namespaced_secret(f"{name}-transfer-identity", cluster.ns)
        file = IdentityFile.model_validate_json(base64.b64decode(held.data["identity.json"]))
        credential = verify_credential(file.credential, (public,))
        assert (credential.deployment, credential.role, credential.instance, credential.pod) \
            == (f"{cluster.ns}/{NAME}", role, name, name)
        keys.add(credential.x25519)
    assert len(keys) == 3
    gone = cluster.instances("decode")[-1]
    cluster.patch_spec({"decode": {"replicas": 1}})
    wait_for("one decode", lambda: len(cluster.instances("decode")) == 1, 30)
    wait_for(f"{gone}'s identity Secret deleted", lambda: not any(
        s.metadata.name == f"{gone}-transfer-identity"
        for s in cluster.core.list_namespaced_secret(cluster.ns).items), 10)


def test_scale_down_removes_the_idlest_instance_and_says_why(
        operator: KopfRunner, cluster: Cluster, kubelet: Kubelet) -> None:
    """Guards against a scale-down that removes the highest ordinal whatever it holds: of
    three decodes the last one holds requests in flight, and an idle one leaves instead."""
    create(cluster, prefill=1, decode=3)
    serving(cluster, 1, 3)
    decodes = cluster.instances("decode")
    busy = decodes[-1]
    for pod in cluster.pods():
        name, role = pod["metadata"]["name"], pod["metadata"]["labels"]["pd.serving.dev/role"]
        agent = make_agent(name, role=role, deployment=NAME, namespace=cluster.ns,
                           report_time=datetime.now(UTC), pod_uid=pod["metadata"]["uid"])
        status = agent.pop("status")
        status["engineRequests"] = 4 if name == busy else 0
        agent["metadata"]["ownerReferences"] = [{
            "apiVersion": "v1", "kind": "Pod", "name": name, "uid": pod["metadata"]["uid"]}]
        cluster.objects.create_namespaced_custom_object(
            "pd.serving.dev", "v1alpha1", cluster.ns, "transferagents", agent)
        cluster.objects.patch_namespaced_custom_object_status(
            "pd.serving.dev", "v1alpha1", cluster.ns, "transferagents", name,
            {"status": status})
    cluster.patch_spec({"decode": {"replicas": 2}})
    wait_for("two decodes", lambda: len(cluster.instances("decode")) == 2, 30)
    assert cluster.instances("decode") == [decodes[0], busy]
    left = decodes[1]  # of the two idle ones, the one created last
    (message,) = wait_for("the DeletingInstance Event",
                          lambda: events(cluster, "DeletingInstance"), 10)
    assert message == (
        f"decode 3 -> 2: deleting instance {left} (0 in flight, 0 B of KV waiting to be "
        f"pulled), the cheapest to lose; kept: {decodes[0]} (0 in flight, 0 B of KV waiting "
        f"to be pulled), {busy} (4 in flight, 0 B of KV waiting to be pulled)")


def test_an_instance_replaced_after_a_pass_chose_it_is_spared(cluster: Cluster) -> None:
    """Guards against a pass that deletes the namesake which replaced the instance it chose
    (the pod deleted by hand, or evicted, between the pass's read and its delete), or that
    fails on it or on a pod already gone: each delete carries the uid the pass saw."""
    pod: Obj = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{NAME}-decode-0"},
                "spec": {"containers": [{"name": "engine", "image": "engine:1"}]}}
    chosen = cluster.core.create_namespaced_pod(cluster.ns, pod).metadata.uid
    cluster.core.delete_namespaced_pod(f"{NAME}-decode-0", cluster.ns)  # no node: gone at once
    namesake = cluster.core.create_namespaced_pod(cluster.ns, pod).metadata.uid
    step = EngineStep((), tuple(
        Instance(name=name, uid=uid, role=Role.DECODE, revision="abcd1234", kv_compat="k",
                 ready=True, deleting=False, index=index)
        for index, (name, uid) in enumerate([
            (f"{NAME}-decode-0", chosen), (f"{NAME}-decode-1", "0b5e9f8a-gone")])),
        EngineRolloutStatus())
    assert InstanceExecutor(cluster.kube).delete(cluster.ns, NAME, step) == 0
    assert [(p.metadata.name, p.metadata.uid) for p in cluster.core.list_namespaced_pod(
        cluster.ns).items] == [(f"{NAME}-decode-0", namesake)]


def previous_release_statefulset(cluster: Cluster, role: Role) -> Obj:
    """A role's StatefulSet as the previous release built it (one per role, `OnDelete`,
    pods `<name>-<role>-<ordinal>`), with today's pod template."""
    pdd = parse_pdd(cluster.pdd())
    name = pdd.metadata.name
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": object_meta(pdd, role_workload(name, role), role.value,
                                {LABEL_ROLE: role.value}),
        "spec": {
            "replicas": (pdd.spec.prefill if role is Role.PREFILL else pdd.spec.decode).replicas,
            "serviceName": role_workload(name, role),
            "selector": {"matchLabels": role_selector(name, role)},
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "template": _without_identity(build_pod_template(pdd, role, CAPS.agent_image)),
        },
    }


def _without_identity(template: Obj) -> Obj:
    """`template` as the previous release built it: its pods had no identity of their own."""
    for container in template["spec"]["containers"]:
        container["volumeMounts"] = [m for m in container.get("volumeMounts") or []
                                     if m["name"] != "transfer-identity"]
        container["env"] = [e for e in container.get("env") or []
                            if e["name"] != "PD_TRANSFER_IDENTITY_FILE"]
    return template


def test_a_previous_release_deployment_moves_to_instances_without_a_dip(
        control_plane: ControlPlaneHandle, cluster: Cluster, kubelet: Kubelet,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards against an upgrade that stops the previous release's engines before their
    replacements serve, deletes a StatefulSet with its pods (the garbage collector's
    cascade), leaves them behind, or starts an engine twice."""
    create(cluster, prefill=1, decode=2)
    legacy = {f"{NAME}-prefill-0", f"{NAME}-decode-0", f"{NAME}-decode-1"}
    for role in Role:
        cluster.apps.create_namespaced_stateful_set(
            cluster.ns, previous_release_statefulset(cluster, role))
    wait_for("the previous release's pods Ready", lambda: {
        p["metadata"]["name"] for p in cluster.pods()} == legacy and all(
        any(c["type"] == "Ready" and c["status"] == "True"
            for c in (p.get("status") or {}).get("conditions") or [])
        for p in cluster.pods()), 60)
    before = set(kubelet.uids)
    kubelet.reset()
    with run_operator(control_plane, cluster.ns, monkeypatch) as runner:
        wait_for("every pod an instance", lambda: cluster.pods() and not {
            p["metadata"]["name"] for p in cluster.pods()} & legacy
            and len(cluster.instances("prefill")) == 1
            and len(cluster.instances("decode")) == 2
            and (cluster.status().get("rollout") or {}).get("phase") == "Complete", 90)
    assert runner.exception is None, runner.output
    assert cluster.kube.list_objects(STATEFULSETS, cluster.ns,
                                     f"pd.serving.dev/deployment={NAME}") == []
    # never fewer Ready pods than desired, one surge pod per role, each engine started once
    assert dict(kubelet.least_ready) == {"prefill": 1, "decode": 2}
    assert dict(kubelet.most_pods) == {"prefill": 2, "decode": 3}
    assert len(kubelet.uids - before) == 3
    assert cluster.children_match() == []
    drained = events(cluster, "DrainingOldInstance")
    assert sorted(m.split(" instance ")[1].split(" ")[0] for m in drained) == sorted(legacy)
